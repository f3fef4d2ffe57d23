"""LoRAManager: the adapters a worker serves, by name, and the `max_loras` slots they run from.

Registered adapters (from --lora-modules or /v1/load_lora_adapter) are read and checked once and
kept on the host. A request names one; the scheduler admits it only when its adapter holds a
slot or can take one (`can_acquire`), and `acquire` copies the adapter into a slot when it is not
resident already. A slot stays referenced while any running request uses it, so a slot in use is
never evicted; the least recently used unreferenced slot is. Unloading an adapter stops new
requests at once; the requests already added finish on its weights.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from worker.engine.config import EngineConfig
from worker.engine.lora_adapter import BaseShapes, LoRAAdapter, LoRAError, read_adapter
from worker.engine.outputs import LoRAStats

NO_SLOT = -1  # the base model's rows


class LoRAWeights(Protocol):
    """Where adapters' weights live: the torch runner's LoRAModel, or NoWeights (sim)."""

    def load_lora(self, adapter: LoRAAdapter) -> None:
        """Read the adapter's weights onto the host (may raise LoRAError)."""

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy a loaded adapter into a device slot."""

    def drop_lora(self, adapter: LoRAAdapter) -> None:
        """Forget the adapter's host weights."""


class NoWeights:
    """The sim engine's adapters: checked and slotted like the real ones, with no tensors."""

    def load_lora(self, adapter: LoRAAdapter) -> None:
        pass

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        pass

    def drop_lora(self, adapter: LoRAAdapter) -> None:
        pass


class LoRAManager:
    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        base: BaseShapes,
        base_model_name: str,
        weights: LoRAWeights,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.base = base
        self.base_model_name = base_model_name
        self.weights = weights
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRAAdapter] = {}
        self._slots: list[LoRAAdapter | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._refs = [0] * max_loras  # running requests per slot
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._bound: dict[str, LoRAAdapter] = {}  # unfinished request id -> its adapter
        self._holding: set[str] = set()  # request ids that hold a slot reference
        self.num_loads = 0

    # -- registry ----------------------------------------------------------------------------

    def add(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Register an adapter; `replace` swaps one of that name (vLLM's load_inplace): requests
        already added finish on the old weights."""
        if not name or not path:
            raise LoRAError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._by_name and not replace:
            message = f"The lora adapter '{name}' has already been loaded."
            raise LoRAError(message, param="lora_name")
        if name == self.base_model_name:
            raise LoRAError(f"'{name}' is the base model's name", param="lora_name")
        adapter = read_adapter(next(self._ids), name, path, self.base, self.max_rank)
        self.weights.load_lora(adapter)
        old = self._by_name.get(name)
        self._by_name[name] = adapter
        if old is not None:
            self._forget_if_unused(old)
        return adapter

    def remove(self, name: str) -> None:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        self._forget_if_unused(adapter)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoRAError(
                f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
            )
        return adapter

    # -- requests ----------------------------------------------------------------------------

    def bind(self, request_id: str, name: str) -> None:
        """The request runs on adapter `name` (LoRAError 404 if no such adapter)."""
        self._bound[request_id] = self.get(name)

    def unbind(self, request_id: str) -> None:
        self.release(request_id)
        adapter = self._bound.pop(request_id, None)
        if adapter is not None:
            self._forget_if_unused(adapter)

    def can_acquire(self, request_id: str) -> bool:
        adapter = self._bound[request_id]
        return adapter.id in self._slot_of or min(self._refs) == 0

    def acquire(self, request_id: str) -> None:
        """Reference the request's adapter slot, loading the adapter into one if needed."""
        if request_id in self._holding:
            return
        adapter = self._bound[request_id]
        slot = self._slot_of.get(adapter.id)
        if slot is None:
            slot = self._take_slot()
            self.weights.set_lora_slot(slot, adapter)
            self._slots[slot] = adapter
            self._slot_of[adapter.id] = slot
            self.num_loads += 1
        self._refs[slot] += 1
        self._lru.move_to_end(slot)
        self._holding.add(request_id)

    def release(self, request_id: str) -> None:
        """Drop the request's slot reference (preempted or finished); a no-op if it has none."""
        if request_id not in self._holding:
            return
        self._holding.remove(request_id)
        adapter = self._bound[request_id]
        slot = self._slot_of[adapter.id]
        self._refs[slot] -= 1

    def slot_index(self, request_id: str) -> int:
        """The slot the request's tokens read their adapter from (NO_SLOT: the base model)."""
        adapter = self._bound.get(request_id)
        return NO_SLOT if adapter is None else self._slot_of[adapter.id]

    # -- state -------------------------------------------------------------------------------

    def stats(self, running: list[str], waiting: list[str]) -> LoRAStats:
        return LoRAStats(
            max_loras=self.max_loras,
            max_lora_rank=self.max_rank,
            adapters=tuple((a.name, a.path) for a in self._by_name.values()),
            resident=tuple(sorted(a.name for a in self._slots if a is not None)),
            running=tuple(sorted(set(running))),
            waiting=tuple(sorted(set(waiting))),
            loads=self.num_loads,
        )

    def _take_slot(self) -> int:
        """A free slot, else the least recently used one no running request references."""
        for slot, adapter in enumerate(self._slots):
            if adapter is None:
                return slot
        for slot in self._lru:
            if self._refs[slot] == 0:
                self._evict(slot)
                return slot
        raise RuntimeError("no LoRA slot is free; can_acquire must be checked first")

    def _evict(self, slot: int) -> None:
        adapter = self._slots[slot]
        assert adapter is not None
        self._slots[slot] = None
        del self._slot_of[adapter.id]
        self._forget_if_unused(adapter)

    def _forget_if_unused(self, adapter: LoRAAdapter) -> None:
        """Free an unloaded adapter's slot and host weights once no request still needs them."""
        if self._by_name.get(adapter.name) is adapter:
            return
        if any(a is adapter for a in self._bound.values()):
            return
        slot = self._slot_of.pop(adapter.id, None)
        if slot is not None:
            self._slots[slot] = None
        self.weights.drop_lora(adapter)


def lora_manager(config: EngineConfig, weights: LoRAWeights | None) -> LoRAManager | None:
    """The engine's LoRA manager with every --lora-modules adapter loaded (None: LoRA is off)."""
    if not config.enable_lora:
        return None
    assert weights is not None and config.served_model_name is not None
    config_file = Path(config.model) / "config.json"
    base = BaseShapes.from_config(json.loads(config_file.read_text()))
    manager = LoRAManager(
        config.max_loras, config.max_lora_rank, base, config.served_model_name, weights
    )
    for name, path in config.lora_module_paths():
        manager.add(name, path)
    return manager
