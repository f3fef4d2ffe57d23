"""The Triton decode kernel against the portable reference: compiled on CUDA, and on the CPU the
same kernel in Triton's interpreter (triton is a test dependency on Linux x86_64)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton wheels exist for Linux x86_64 only")

import worker.engine.triton_decode as triton_decode
from tests.support.paths import REPO
from worker.engine.decode_attention import ReferenceDecode

TRITON_CASES = {
    # heads, kv heads, head dim, block size, splits
    "gqa": (4, 2, 32, 16, 1),
    "gqa_splits_odd_dim": (8, 2, 24, 4, 3),
    "mha_more_splits_than_pages": (4, 4, 16, 16, 4),
}


def triton_errors(device: str) -> dict[str, float]:
    """Max |triton - reference| per case and dtype, over scattered tables and ragged lengths."""
    errors = {}
    reference = ReferenceDecode()
    for case, (heads, kv_heads, dim, block_size, splits) in sorted(TRITON_CASES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(7)
            num_blocks, pages = 24, 6
            shape = (num_blocks, block_size, kv_heads, dim)
            k_cache = torch.randn(shape, generator=gen).to(device, dtype)
            v_cache = torch.randn(shape, generator=gen).to(device, dtype)
            lens = torch.tensor([1, block_size + 3, pages * block_size, 2], device=device)
            perms = [torch.randperm(num_blocks, generator=gen)[:pages] for _ in lens]
            tables = torch.stack(perms).to(device)
            q = torch.randn(len(lens), heads, dim, generator=gen).to(device, dtype)
            got = triton_decode.paged_decode_triton(q, k_cache, v_cache, tables, lens, 0.3, splits)
            ref = reference.run(q, k_cache, v_cache, reference.plan(tables, lens, block_size), 0.3)
            assert got.dtype == dtype and got.shape == ref.shape
            errors[f"{case}/{str(dtype)[6:]}"] = (got.float() - ref.float()).abs().max().item()
    return errors


def test_triton_decode_matches_reference() -> None:
    """On CUDA the compiled kernel; on the CPU the same kernel in Triton's interpreter, in a
    fresh interpreter process (TRITON_INTERPRET must be set before triton is first imported)."""
    if torch.cuda.is_available():
        errors = triton_errors("cuda")
    else:
        code = (
            "import json; import tests.worker.engine.test_triton_decode as t;"
            " print(json.dumps(t.triton_errors('cpu')))"
        )
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 2 * len(TRITON_CASES)
    for name, err in errors.items():
        assert err <= (1e-5 if name.endswith("float32") else 2e-2), (name, err)


def test_triton_split_count_covers_the_gpu() -> None:
    assert triton_decode.num_splits_for(1, 8, 132) == 16
    assert triton_decode.num_splits_for(64, 8, 132) == 1
    assert triton_decode.num_splits_for(16, 8, 132) == 3
    assert triton_decode.supports(16, 128) and not triton_decode.supports(12, 128)
