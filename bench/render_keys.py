"""Render + block-key throughput of the gateway's per-request path (cachekey only, no network).

For chat prompts of about 128, 1k, 8k and 32k tokens, with and without one image, it times:
  cold: a fresh Renderer (empty segment cache) renders the request and keys its blocks;
  warm: a second request sharing the long system prompt, with a new user turn, on the same Renderer.
The demo model's tokenizer and template are used, with its context limit raised to 64k tokens.

    .venv/bin/python -m bench.render_keys [--repeats 5] [--out bench/results/render_keys.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from cachekey import HashNamespace, ModelAssets, Renderer, block_keys
from worker.demo.model import write_demo_model

SIZES = (128, 1024, 8192, 32768)
WORDS = "the cache block token router gateway replica prefix image model request worker".split()
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def load_assets(max_len: int = 65536) -> ModelAssets:
    with tempfile.TemporaryDirectory() as tmp:
        files = ModelAssets.from_dir(write_demo_model(tmp)).files
    config = json.loads(files["config.json"])
    config["text_config"]["max_position_embeddings"] = max_len
    return ModelAssets.from_files({**files, "config.json": json.dumps(config).encode()})


def image_url() -> str:
    """A 336x336 JPEG of seeded noise: a realistic size for hashing and header probing."""
    pixels = np.random.default_rng(0).integers(0, 256, (336, 336, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def system_text(assets: ModelAssets, tokens: int, seed: int) -> str:
    """Varied seeded text (real and made-up words), so the tokenizer's own word cache misses."""
    rng = np.random.default_rng(seed)

    def word() -> str:
        if rng.random() < 0.5:
            return WORDS[rng.integers(len(WORDS))]
        return "".join(SYLLABLES[i] for i in rng.integers(len(SYLLABLES), size=rng.integers(2, 4)))

    sample = " ".join(word() for _ in range(2000))
    per_word = len(assets.tokenizer.encode(sample, add_special_tokens=False).ids) / 2000
    return " ".join(word() for _ in range(int(tokens / per_word)))


def messages(system: str, question: str, url: str | None) -> list[dict]:
    user: list[dict] = [{"type": "text", "text": question}]
    if url is not None:
        user.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def timed(renderer: Renderer, msgs: list[dict], ns: HashNamespace) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    prompt = renderer.render_chat(msgs)
    t1 = time.perf_counter()
    block_keys(prompt.token_ids, ns, prompt.mm_items)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(prompt)


def run_case(assets: ModelAssets, size: int, url: str | None, repeats: int) -> dict:
    ns = HashNamespace("demo", 16)
    cold, warm, keys = [], [], []
    n_tokens = 0
    Renderer(assets).render_chat(messages("warm up the template and tokenizer", "?", url))
    for r in range(repeats):
        system = system_text(assets, size, seed=size * 1000 + r)
        renderer = Renderer(assets)
        render_s, keys_s, n_tokens = timed(renderer, messages(system, f"Question {r}?", url), ns)
        cold.append(render_s + keys_s)
        keys.append(keys_s)
        render_s, keys_s, _ = timed(renderer, messages(system, f"Follow-up {r}?", url), ns)
        warm.append(render_s + keys_s)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "target_tokens": size,
        "prompt_tokens": n_tokens,
        "image": url is not None,
        "cold_ms": round(cold_s * 1e3, 2),
        "cold_tokens_per_s": round(n_tokens / cold_s),
        "warm_ms": round(warm_s * 1e3, 2),
        "warm_tokens_per_s": round(n_tokens / warm_s),
        "keys_ms": round(statistics.median(keys) * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/render_keys.json"))
    args = parser.parse_args()
    assets, url = load_assets(), image_url()
    rows = [run_case(assets, s, u, args.repeats) for s in SIZES for u in (None, url)]
    header = "| prompt tokens | image | cold ms | cold tok/s | warm ms | warm tok/s | keys ms |"
    print(header)
    print("|" + "---|" * 7)
    for r in rows:
        print(
            f"| {r['prompt_tokens']} | {'yes' if r['image'] else 'no'} | {r['cold_ms']} | "
            f"{r['cold_tokens_per_s']:,} | {r['warm_ms']} | {r['warm_tokens_per_s']:,} | "
            f"{r['keys_ms']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine()}
    args.out.write_text(json.dumps({"meta": meta, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
