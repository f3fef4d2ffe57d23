"""LoRA in the engine: PEFT adapters applied per token in mixed batches, against transformers +
PEFT on the same weights; prefix-cache isolation per adapter; LRU slots; the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cachekey import Prompt
from tests.support.engine import make_engine, run_all, sampled_logits, tokens
from tests.support.lora_fixtures import (
    ALL_PROJECTIONS,
    hf_greedy,
    hf_model,
    write_peft_adapter,
    write_tiny_llama,
)
from worker.engine.lora_adapter import LoRAError
from worker.engine.sampling_params import SamplingParams

N_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
PROMPTS = [[(7 * i + 13 * j) % 1900 + 50 for j in range(n)] for i, n in enumerate((5, 37, 70))]


@pytest.fixture(scope="module")
def models(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-engine")
    base = write_tiny_llama(root / "base", demo_model_dir)
    other = write_tiny_llama(root / "other-base", demo_model_dir, hidden_size=32)
    return {
        "base": base,
        # every projection, plain scaling
        "alpha": write_peft_adapter(
            base, root / "alpha", 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS
        ),
        # a few projections (one shard of each merged one), rsLoRA scaling, a smaller rank
        "beta": write_peft_adapter(
            base,
            root / "beta",
            2,
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        ),
        "other": write_peft_adapter(other, root / "other", 3, r=4, target_modules=["q_proj"]),
        "head": write_peft_adapter(base, root / "head", 4, r=4, target_modules=["lm_head"]),
    }


@pytest.fixture(scope="module")
def expected(models: dict[str, Path]) -> dict[tuple[str, int], list[int]]:
    """transformers' greedy tokens for every (adapter or base, prompt)."""
    out = {}
    for name in ("base", "alpha", "beta"):
        model = hf_model(models["base"], None if name == "base" else models[name])
        for i, prompt in enumerate(PROMPTS):
            out[(name, i)] = hf_greedy(model, prompt, N_NEW)
    return out


def lora_engine(models: dict[str, Path], **overrides: object):
    settings: dict[str, object] = {
        "max_loras": 2,
        "max_lora_rank": 8,
        "lora_modules": (f"alpha={models['alpha']}", f"beta={models['beta']}"),
    }
    settings.update(overrides)
    return make_engine(models["base"], **settings)


def add(engine, name: str, prompt: list[int], adapter: str | None, params=GREEDY) -> None:
    engine.add_request(name, Prompt(tuple(prompt)), params, lora_name=adapter)


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole-prompts", "chunked-prefill"])
def test_mixed_batch_matches_transformers_with_peft(models, expected, chunk: int) -> None:
    engine = lora_engine(models, max_num_batched_tokens=chunk)
    steps = record_steps(engine)
    for name in ("base", "alpha", "beta"):
        for i, prompt in enumerate(PROMPTS):
            add(engine, f"{name}-{i}", prompt, None if name == "base" else name)
    outs = run_all(engine)
    # The base model and both adapters shared steps: prefill (and chunked, mixed) steps, and
    # with whole prompts the decode steps too (the decode runner).
    mixed = {-1, *range(2)}
    assert any(kind == "eager" and slots == mixed for kind, slots in steps)
    if chunk > 100:
        assert any(kind == "decode" and slots == mixed for kind, slots in steps)
    for (name, i), want in expected.items():
        assert tokens(outs[f"{name}-{i}"]) == want, (name, i)
    # Not vacuous: each adapter changes what the model says.
    for i in range(len(PROMPTS)):
        assert expected[("alpha", i)] != expected[("base", i)]
        assert expected[("beta", i)] != expected[("base", i)]


def record_steps(engine) -> list[tuple[str, set[int]]]:
    """Watch (not replace) the runner: each step's kind and the LoRA slots of its rows."""
    steps: list[tuple[str, set[int]]] = []
    runner = engine.runner
    execute, decode = runner.execute, runner.decoder.run

    def watched_execute(batch):
        steps.append(("eager", {item.lora_slot for item in batch}))
        return execute(batch)

    def watched_decode(batch, feed=None):
        steps[-1] = ("decode", steps[-1][1])
        return decode(batch, feed)

    runner.execute, runner.decoder.run = watched_execute, watched_decode
    return steps


def test_first_logits_match_peft_closely(models) -> None:
    engine = lora_engine(models)
    for name in ("base", "alpha", "beta"):
        add(engine, name, PROMPTS[1], None if name == "base" else name)
    run_all(engine)
    for name in ("base", "alpha", "beta"):
        model = hf_model(models["base"], None if name == "base" else models[name])
        with torch.no_grad():
            want = model(torch.tensor([PROMPTS[1]])).logits[0, -1]
        got = sampled_logits(engine, name)[0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (name, (got - want).abs().max())


def test_same_prompt_under_two_adapters_shares_no_block(models) -> None:
    engine = lora_engine(models)
    prompt = PROMPTS[2]  # 70 tokens: 4 full blocks
    cached = {}
    for run, adapter in enumerate(("alpha", "beta", None, "alpha", "beta")):
        add(engine, f"r{run}", prompt, adapter)
        cached[run] = run_all(engine)[f"r{run}"][-1].num_cached_tokens
    assert cached[0] == cached[1] == cached[2] == 0  # alpha, then beta, then the base: all cold
    assert cached[3] == cached[4] == 64  # each adapter hits its own blocks
    stored = [b for b in engine.snapshot_blocks() if b.extra_keys]
    assert {b.extra_keys for b in stored} == {("alpha",), ("beta",)}


def test_one_slot_runs_adapters_in_turn_and_evicts_the_least_recent(models, expected) -> None:
    engine = lora_engine(models, max_loras=1)
    add(engine, "alpha-1", PROMPTS[1], "alpha")
    add(engine, "beta-1", PROMPTS[1], "beta")
    add(engine, "base-1", PROMPTS[1], None)
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        running = {s.lora_name for s in engine.scheduler.running}
        assert len(running - {None}) <= 1  # beta waits while alpha holds the only slot
        if "alpha-1" not in outs or not outs["alpha-1"][-1].finished:
            assert engine.stats().lora.resident == ("alpha",)  # in use: never evicted
    for name in ("alpha", "beta", "base"):
        assert tokens(outs[f"{name}-1"]) == expected[(name, 1)]
    stats = engine.stats().lora
    assert stats.loads == 2 and stats.resident == ("beta",)
    add(engine, "alpha-2", PROMPTS[0], "alpha")
    assert tokens(run_all(engine)["alpha-2"]) == expected[("alpha", 0)]
    assert engine.stats().lora.loads == 3  # beta was the least recently used: evicted


def test_unload_lets_running_requests_finish_and_refuses_new_ones(models, expected) -> None:
    engine = lora_engine(models)
    add(engine, "a", PROMPTS[1], "alpha")
    first = engine.step()
    engine.remove_lora("alpha")
    with pytest.raises(LoRAError) as e:
        add(engine, "b", PROMPTS[1], "alpha")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert tokens(first + run_all(engine)["a"]) == expected[("alpha", 1)]
    assert engine.stats().lora.resident == ()  # its slot was freed once the request finished
    engine.add_lora("alpha", str(models["alpha"]))  # the name can be loaded again
    add(engine, "c", PROMPTS[1], "alpha")
    assert tokens(run_all(engine)["c"]) == expected[("alpha", 1)]


@pytest.mark.parametrize(
    ("adapter", "max_rank", "status", "message"),
    [
        ("alpha", 4, 400, "LoRA rank 8 is greater than max_lora_rank 4."),
        ("other", 8, 400, "incompatible with the base model: layer 0 q_proj has lora_A [4, 32]"),
        ("head", 8, 400, "weights for modules this engine does not adapt"),
        ("missing", 8, 404, "No adapter found for"),
    ],
)
def test_load_errors(models, tmp_path, adapter, max_rank, status, message) -> None:
    engine = make_engine(models["base"], enable_lora=True, max_lora_rank=max_rank)
    path = models.get(adapter, tmp_path / "nowhere")
    with pytest.raises(LoRAError) as e:
        engine.add_lora(adapter, str(path))
    assert e.value.status_code == status
    assert message in e.value.message
    assert engine.stats().lora.adapters == ()


def test_request_errors(models) -> None:
    engine = lora_engine(models)
    with pytest.raises(LoRAError) as e:
        add(engine, "x", PROMPTS[0], "gamma")
    assert (e.value.status_code, e.value.message) == (404, "The model `gamma` does not exist.")
    with pytest.raises(LoRAError, match="has already been loaded"):
        engine.add_lora("alpha", str(models["beta"]))
    with pytest.raises(LoRAError) as e:
        engine.remove_lora("gamma")
    assert (e.value.status_code, e.value.message) == (
        404,
        "The lora adapter 'gamma' cannot be found.",
    )
    plain = make_engine(models["base"])
    with pytest.raises(LoRAError, match="--enable-lora"):
        add(plain, "y", PROMPTS[0], "alpha")
    assert not engine.has_unfinished_requests() and not plain.has_unfinished_requests()


def test_demo_adapters_match_peft_on_the_demo_llava(demo_model_dir, tmp_path) -> None:
    """The generated demo adapters are PEFT adapters: PEFT applies them to transformers' LLaVA
    and the engine gives the same logits."""
    import peft
    import transformers

    from worker.demo.lora import DEMO_ADAPTERS, write_demo_adapter

    prompt = [1, 50, 60, 70, 80, 90, 100, 110, 120]
    modules = tuple(f"{n}={write_demo_adapter(tmp_path / n, n)}" for n in DEMO_ADAPTERS)
    engine = make_engine(demo_model_dir, enable_lora=True, max_loras=2, lora_modules=modules)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for name in (None, *DEMO_ADAPTERS):
        add(engine, f"r-{name}", prompt, name, params)
    run_all(engine)
    llava = transformers.LlavaForConditionalGeneration
    logits = {}
    for name in (None, *DEMO_ADAPTERS):
        model = llava.from_pretrained(demo_model_dir, torch_dtype=torch.float32)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, tmp_path / name)
        with torch.no_grad():
            logits[name] = model.eval()(input_ids=torch.tensor([prompt])).logits[0, -1]
        got = sampled_logits(engine, f"r-{name}")[0]
        assert torch.allclose(got, logits[name], atol=1e-4), name
    for name in DEMO_ADAPTERS:
        assert (logits[name] - logits[None]).abs().max() > 0.1  # each adapter changes the model


def test_padded_decode_with_the_lora_path_always_on_equals_eager(models, expected) -> None:
    """What a captured CUDA graph does, run eagerly: rows padded to a bucket (slot -1) and the
    LoRA matmuls run for every step, base-only steps too; the tokens do not change."""
    from worker.engine.decode_runner import batch_buckets

    engine = lora_engine(models, max_num_seqs=8)
    decoder = engine.runner.decoder
    decoder.buckets = batch_buckets(8)
    stage = decoder.stage
    decoder.stage = lambda batch, rows, feed=None: (stage(batch, rows, feed)[0], True)
    steps = record_steps(engine)
    for i, prompt in enumerate(PROMPTS):  # 3 base, then alpha and beta: 5 rows pad to 8
        add(engine, f"base-{i}", prompt, None)
    add(engine, "alpha-1", PROMPTS[1], "alpha")
    add(engine, "beta-2", PROMPTS[2], "beta")
    outs = run_all(engine)
    assert any(kind == "decode" for kind, _ in steps)
    for i in range(len(PROMPTS)):
        assert tokens(outs[f"base-{i}"]) == expected[("base", i)]
    assert tokens(outs["alpha-1"]) == expected[("alpha", 1)]
    assert tokens(outs["beta-2"]) == expected[("beta", 2)]
