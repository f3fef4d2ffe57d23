"""The fused elementwise kernels (worker/models/triton_ops.py) against the torch code they replace:
compiled on CUDA, and on the CPU the same kernels in Triton's interpreter, for several shapes and
dtypes and every rotary scaling rule rotary.py supports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton", reason="triton wheels exist for Linux x86_64 only")

from tests.support.paths import REPO
from worker.models.elementwise import select_kernels, use_kernels
from worker.models.layers import GatedActivation, RMSNorm
from worker.models.rotary import RotaryEmbedding

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (atol, rtol): float32 differs only in summation order and libm; half precision computes in
# float32 and rounds once where the reference rounds after each op (a rounding or two apart).
TOLERANCE = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 1.6e-2), "float16": (2e-3, 2e-3)}
NORM_SHAPES = [(1, 64), (7, 96), (33, 256)]  # rows, hidden (96: the block is padded to 128)
SILU_SHAPES = [(1, 64), (5, 1500), (16, 2048)]  # rows, intermediate (1500: a ragged last block)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ROTARY_CASES = {
    # config, head dim, q heads, kv heads
    "default": ({"rope_theta": 10000.0}, 32, 4, 2),
    "linear": (
        {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        32,
        4,
        4,
    ),
    "llama3": ({"rope_theta": 500000.0, "rope_scaling": _LLAMA3}, 64, 6, 2),
    "yarn_attention_factor": (
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        32,
        4,
        1,
    ),
    "partial_rotary": ({"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 24, 4, 2),
}
# Up to 131,000: the angles reach 1e5 radians, where a kernel without range reduction breaks.
POSITIONS = [0, 1, 2, 17, 1000, 8191, 40000, 131000]


def _score(got: Tensor, ref: Tensor) -> float:
    """max |got - ref| / (atol + rtol |ref|): at most 1 passes."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    atol, rtol = TOLERANCE[str(ref.dtype)[6:]]
    err = (got.float() - ref.float()).abs() / (atol + rtol * ref.float().abs())
    return err.max().item()


def _norm_scores(device: str, gen: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    scores = {}
    for rows, hidden in NORM_SHAPES:
        norm = RMSNorm(hidden, eps=1e-5).to(device, dtype)
        norm.weight.data = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(device, dtype)
        # x with a row stride wider than its rows (a view into a wider tensor); delta dense.
        x = torch.randn(rows, 2 * hidden, generator=gen).to(device, dtype)[:, :hidden]
        delta = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        ref_norm, (ref_sum, ref_add_norm) = norm(x), norm.add_forward(x, delta)
        use_kernels(norm, select_kernels("triton", torch.device(device)))
        got_sum, got_add_norm = norm.add_forward(x, delta)
        scores[f"rms_norm/{rows}x{hidden}"] = _score(norm(x), ref_norm)
        scores[f"add_rms_norm.sum/{rows}x{hidden}"] = _score(got_sum, ref_sum)
        scores[f"add_rms_norm.norm/{rows}x{hidden}"] = _score(got_add_norm, ref_add_norm)
    return scores


def _silu_scores(device: str, gen: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    scores = {}
    for rows, inter in SILU_SHAPES:
        act = GatedActivation("silu")
        gate_up = (2 * torch.randn(rows, 2 * inter, generator=gen)).to(device, dtype)
        ref = act(gate_up)
        use_kernels(act, select_kernels("triton", torch.device(device)))
        scores[f"silu_and_mul/{rows}x{inter}"] = _score(act(gate_up), ref)
    return scores


def _rotary_scores(device: str, gen: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    scores = {}
    positions = torch.tensor(POSITIONS, device=device)
    tokens = len(POSITIONS)
    for case, (config, head_dim, q_heads, kv_heads) in ROTARY_CASES.items():
        rotary = RotaryEmbedding.from_config(config, head_dim, 131072)
        # q and k as the model hands them over: strided views of one qkv projection.
        widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        qkv = torch.randn(tokens, sum(widths), generator=gen).to(device, dtype)
        q, k, _ = qkv.split(widths, dim=-1)
        q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)
        ref_q, ref_k = rotary(positions, q, k)
        use_kernels(rotary, select_kernels("triton", torch.device(device)))
        got_q, got_k = rotary(positions, q, k)
        scores[f"rotary.q/{case}"] = _score(got_q, ref_q)
        scores[f"rotary.k/{case}"] = _score(got_k, ref_k)
    return scores


SCORERS: list[Callable[[str, torch.Generator, torch.dtype], dict[str, float]]] = [
    _norm_scores,
    _silu_scores,
    _rotary_scores,
]


def kernel_scores(device: str) -> dict[str, float]:
    """Every case's score (`_score`) per dtype: name/dtype -> score."""
    scores = {}
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(11)
        for scorer in SCORERS:
            for name, score in scorer(device, gen, dtype).items():
                scores[f"{name}/{str(dtype)[6:]}"] = score
    return scores


@pytest.fixture(scope="module")
def scores() -> dict[str, float]:
    """On CUDA the compiled kernels; on the CPU the same kernels in Triton's interpreter, in a
    fresh process (TRITON_INTERPRET must be set before triton is first imported)."""
    if torch.cuda.is_available():
        return kernel_scores("cuda")
    code = (
        "import json; import tests.worker.models.test_fused_kernels as t;"
        " print(json.dumps(t.kernel_scores('cpu')))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _within(scores: dict[str, float], prefix: str, cases: int) -> None:
    mine = {name: s for name, s in scores.items() if name.startswith(prefix)}
    assert len(mine) == cases * len(DTYPES), sorted(mine)
    bad = {name: s for name, s in mine.items() if not s <= 1.0}  # NaN fails too
    assert not bad, bad


def test_rms_norm_matches_reference(scores: dict[str, float]) -> None:
    _within(scores, "rms_norm/", len(NORM_SHAPES))


def test_add_rms_norm_matches_reference(scores: dict[str, float]) -> None:
    _within(scores, "add_rms_norm.sum/", len(NORM_SHAPES))
    _within(scores, "add_rms_norm.norm/", len(NORM_SHAPES))


def test_silu_and_mul_matches_reference(scores: dict[str, float]) -> None:
    _within(scores, "silu_and_mul/", len(SILU_SHAPES))


def test_rotary_matches_reference_for_every_scaling_rule(scores: dict[str, float]) -> None:
    _within(scores, "rotary.q/", len(ROTARY_CASES))
    _within(scores, "rotary.k/", len(ROTARY_CASES))


def test_auto_picks_the_kernels_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.models import triton_ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_kernels("auto", torch.device("cpu")) is None
    assert select_kernels("auto", torch.device("cuda")) is triton_ops
    assert select_kernels("reference", torch.device("cuda")) is None
    with pytest.raises(ValueError, match="need CUDA"):
        select_kernels("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' case: kernels run interpreted
    assert select_kernels("triton", torch.device("cpu")) is triton_ops
    with pytest.raises(ValueError, match="elementwise kernels must be one of"):
        select_kernels("fused", torch.device("cuda"))


def test_use_kernels_points_every_fusable_module_and_back() -> None:
    from worker.models import triton_ops

    model = torch.nn.ModuleList(
        [
            RMSNorm(8),
            GatedActivation("silu"),
            GatedActivation("gelu"),
            RotaryEmbedding.from_config({}, 8, 64),
        ]
    )
    assert use_kernels(model, triton_ops) == "triton"
    assert [getattr(m, "kernels", None) for m in model] == [
        triton_ops,
        triton_ops,
        None,
        triton_ops,
    ]
    assert use_kernels(model, None) == "reference"
    assert all(getattr(m, "kernels", None) is None for m in model)


# The launch signatures of a Llama-3.2-1B-shaped model in bfloat16 (hidden 2048, 32 heads of 64
# with 8 KV heads, intermediate 8192); ints are strides, the floats eps and the rotary scaling.
_HOPPER_BUILDS = {
    "_rms_norm_kernel": (
        ["*bf16"] * 5 + ["i32"] * 4 + ["fp32"],
        {"N": 2048, "BLOCK": 2048, "ADD": True},
    ),
    "_rotary_kernel": (
        ["*i64", "*fp32"] + ["*bf16"] * 4 + ["i32"] * 4 + ["fp32"],
        {
            "Q_HEADS": 32,
            "Q_HEADS_PAD": 32,
            "K_HEADS": 8,
            "K_HEADS_PAD": 8,
            "HEAD_DIM": 64,
            "HALF": 32,
            "HALF_PAD": 32,
            "TAIL_PAD": 0,
        },
    ),
    "_silu_and_mul_kernel": (["*bf16"] * 2 + ["i32"] * 2, {"N": 8192, "BLOCK": 1024}),
}


def test_kernels_compile_for_a_hopper_gpu() -> None:
    """The interpreter runs the kernels' Python, not Triton's compiler: compile each one for
    sm_90 (H100/H200) here too. It needs no GPU, only the ptxas that triton's wheel carries."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.models import triton_ops

    for name, (types, constexprs) in _HOPPER_BUILDS.items():
        kernel = getattr(triton_ops, name)
        args = [a for a in kernel.arg_names if a not in constexprs]
        assert len(args) == len(types), name
        signature = {
            **dict(zip(args, types, strict=True)),
            **dict.fromkeys(constexprs, "constexpr"),
        }
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32)
        )
        assert ".entry " + name in compiled.asm["ptx"], name
        assert compiled.asm["cubin"], name
