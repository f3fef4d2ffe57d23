"""A deterministic multi-tenant chat workload: shared system prompts, users, turns, images.

Each tenant has a long system prompt; each user of a tenant holds a multi-turn conversation; some
turns carry an image, drawn from a pool shared across tenants or from the tenant's own pool. The
same seed always gives the same trace, so policies can be compared on identical input.

    python -m harness.workload --out bench/results/trace.jsonl      # write a JSONL trace
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

_WORDS = (
    "the a cluster cache block prefix route model token image request replica gateway worker "
    "latency memory tenant user answer question policy system prompt scheduler batch decode "
    "prefill event index hash vision tower layer attention head value key query shard rank pod "
    "node service metric dashboard alert budget queue load balance hit miss evict store remove "
    "please explain describe summarize compare list why how what when where which short long "
    "red green blue bright dark small large fast slow new old first last next every each many"
).split()


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    tenants: int = 3
    users_per_tenant: int = 4
    turns: int = 3
    system_words: int = 600
    user_words: int = 40
    image_prob: float = 0.3
    shared_images: int = 2
    images_per_tenant: int = 2
    shared_image_prob: float = 0.5
    max_tokens: int = 8
    seed: int = 0
    # Share of the conversations that tenant 0 holds (0: every tenant has users_per_tenant).
    hot_share: float = 0.0
    # The image before the question in a turn (visual Q&A: one image, several questions);
    # False: after it.
    image_first: bool = False

    def __post_init__(self) -> None:
        for name in ("tenants", "users_per_tenant", "turns", "system_words"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0.0 <= self.image_prob <= 1.0:
            raise ValueError("image_prob must be in [0, 1]")
        if not 0.0 <= self.hot_share < 1.0:
            raise ValueError("hot_share must be in [0, 1)")

    def users(self, tenant: int) -> int:
        """Conversations of `tenant`: tenant 0 gets `hot_share` of them all when set."""
        if tenant or not self.hot_share:
            return self.users_per_tenant
        others = (self.tenants - 1) * self.users_per_tenant
        return max(1, round(self.hot_share / (1 - self.hot_share) * others))


@dataclass(slots=True)
class Turn:
    """One request of a conversation: the new user message (history is kept by the driver)."""

    tenant: int
    user: int
    turn: int
    content: list[dict] = field(default_factory=list)

    @property
    def conversation(self) -> str:
        return f"t{self.tenant}-u{self.user}"


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def make_image(seed: int, size: int = 64) -> bytes:
    """A small deterministic PNG: a gradient with a seeded colour and stripe pattern."""
    rng = random.Random(seed)
    base = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    stripe = rng.randrange(2, 9)
    img = Image.new("RGB", (size, size))
    px = img.load()
    for y in range(size):
        for x in range(size):
            on = ((x + y * (seed % 3 + 1)) // stripe) % 2
            px[x, y] = tuple((c + on * 90 + x) % 256 for c in base)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


class Workload:
    """The system prompts and the ordered turns of a workload."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)
        self.system_prompts = [
            f"You are the assistant of tenant {t}. " + _text(rng, spec.system_words)
            for t in range(spec.tenants)
        ]
        self.shared_images = [data_url(make_image(10_000 + i)) for i in range(spec.shared_images)]
        self.tenant_images = [
            [data_url(make_image(1_000 * (t + 1) + i)) for i in range(spec.images_per_tenant)]
            for t in range(spec.tenants)
        ]
        self.turns = self._build_turns(rng)

    def _image(self, rng: random.Random, tenant: int) -> str | None:
        s = self.spec
        if rng.random() >= s.image_prob:
            return None
        if self.shared_images and (rng.random() < s.shared_image_prob or not s.images_per_tenant):
            return rng.choice(self.shared_images)
        return rng.choice(self.tenant_images[tenant]) if s.images_per_tenant else None

    def _build_turns(self, rng: random.Random) -> list[Turn]:
        s = self.spec
        # Interleave conversations turn by turn, so caches see pressure from every tenant at once.
        order = [(t, u) for t in range(s.tenants) for u in range(s.users(t))]
        turns: list[Turn] = []
        for k in range(s.turns):
            rng.shuffle(order)
            for t, u in order:
                content: list[dict] = [{"type": "text", "text": _text(rng, s.user_words)}]
                image = self._image(rng, t)
                if image is not None:
                    part = {"type": "image_url", "image_url": {"url": image}}
                    content.insert(0 if s.image_first else 1, part)
                turns.append(Turn(tenant=t, user=u, turn=k, content=content))
        return turns

    def __iter__(self) -> Iterator[Turn]:
        return iter(self.turns)

    def __len__(self) -> int:
        return len(self.turns)

    def initial_messages(self, tenant: int) -> list[dict]:
        return [{"role": "system", "content": self.system_prompts[tenant]}]

    def write_trace(self, path: Path, model: str = "demo", canned_reply: str = "ok") -> int:
        """Write one OpenAI chat request per line, histories filled with a canned reply, for
        third-party load tools that replay requests without running the conversation."""
        history: dict[str, list[dict]] = {}
        with path.open("w") as f:
            for turn in self.turns:
                msgs = history.setdefault(turn.conversation, self.initial_messages(turn.tenant))
                msgs.append({"role": "user", "content": turn.content})
                body = {"model": model, "messages": msgs, "max_tokens": self.spec.max_tokens}
                f.write(json.dumps(body) + "\n")
                msgs.append({"role": "assistant", "content": canned_reply})
        return len(self.turns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = WorkloadSpec()  # on a slots dataclass the class attributes are descriptors, not defaults
    ap.add_argument("--out", type=Path, default=Path("bench/results/trace.jsonl"))
    ap.add_argument("--tenants", type=int, default=d.tenants)
    ap.add_argument("--users-per-tenant", type=int, default=d.users_per_tenant)
    ap.add_argument("--turns", type=int, default=d.turns)
    ap.add_argument("--system-words", type=int, default=d.system_words)
    ap.add_argument("--image-prob", type=float, default=d.image_prob)
    ap.add_argument("--seed", type=int, default=d.seed)
    args = ap.parse_args()
    spec = WorkloadSpec(
        tenants=args.tenants,
        users_per_tenant=args.users_per_tenant,
        turns=args.turns,
        system_words=args.system_words,
        image_prob=args.image_prob,
        seed=args.seed,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = Workload(spec).write_trace(args.out)
    print(f"wrote {n} requests to {args.out}")


if __name__ == "__main__":
    main()
