"""The messages between the API server and its engine core process (engine_core.py).

msgspec msgpack over ZMQ, as vLLM v1's EngineCoreRequest/EngineCoreOutputs: commands go in on
one PUSH socket, and everything comes back on another, the outputs **one message per step**.
A command that expects an answer carries a `call` number; its `Done` names it. The engine's own
types (Prompt, SamplingParams, RequestOutput, EngineStats, CachedBlock) are dataclasses and
cross as they are; a hidden-states array crosses as dtype, shape and bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from cachekey.types import Prompt
from worker.engine.outputs import CachedBlock, EngineStats, RequestOutput
from worker.engine.sampling_params import SamplingParams

# -- API server -> core ------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    """Engine requests of one API request, added in one go so siblings share a step."""

    call: int
    request_ids: list[str]
    prompts: list[Prompt]
    params: list[SamplingParams]
    lora_name: str | None = None
    cache_salt: str | None = None
    hidden_states: str | None = None
    param: str = "messages"  # the request field the prompts came from, named in errors


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Snapshot(msgspec.Struct, tag=True, array_like=True):
    call: int


class Reset(msgspec.Struct, tag=True, array_like=True):
    call: int


class AddLora(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str
    path: str
    replace: bool = False


class RemoveLora(msgspec.Struct, tag=True, array_like=True):
    call: int
    name: str


class RefreshPrefix(msgspec.Struct, tag=True, array_like=True):
    """The gateway's x-kvgate-prefix hint: keep the chain ending at `key` (no answer)."""

    key: bytes


class Fault(msgspec.Struct, tag=True, array_like=True):
    """--enable-fault-injection only: crash_engine, stall_engine or drop_events (no answer)."""

    kind: str
    count: int = 1


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = Add | Abort | Snapshot | Reset | AddLora | RemoveLora | RefreshPrefix | Fault | Shutdown

# -- core -> API server ------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is loaded and its publisher bound: what the API server cannot know alone."""

    max_model_len: int
    hidden_layers: tuple[int, ...]
    stats: EngineStats


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not start (a bad flag, a busy port): the worker exits with this."""

    message: str


class Steps(msgspec.Struct, tag=True, array_like=True):
    """One step's outputs; with none, a heartbeat of an idle loop. `stats` when they moved."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class CallError(msgspec.Struct, array_like=True):
    """A failed call as the client must see it (errors.as_api_error, run in the core)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


class SnapshotResult(msgspec.Struct, array_like=True):
    seq: int | None
    blocks: list[CachedBlock]
    host_blocks: list[CachedBlock] = []  # the host KV tier's, parents first


class Done(msgspec.Struct, tag=True, array_like=True):
    call: int
    value: SnapshotResult | bool | None = None
    error: CallError | None = None


class Dead(msgspec.Struct, tag=True, array_like=True):
    """The loop died (an exception escaped a step): the core exits after sending this."""

    reason: str


Report = Ready | Failed | Steps | Done | Dead

# -- encoding ----------------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (str(obj.dtype), list(obj.shape), obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind.__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command, dec_hook=_dec_hook)


def report_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Report, dec_hook=_dec_hook)
