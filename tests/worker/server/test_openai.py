"""The official openai client against a live torch worker with the demo model."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from PIL import Image

from harness.workload import data_url
from tests.support.chat import image_message, user
from tests.support.worker_harness import WorkerProcess

BLOCK = 16
LONG_TEXT = "Paged attention keeps the KV cache in fixed-size blocks. " * 6


def png_data_url(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return data_url(buf.getvalue())


def expected_hit(prompt_tokens: int) -> int:
    return ((prompt_tokens - 1) // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def worker(demo_model_dir):
    with WorkerProcess(demo_model_dir, "--device", "cpu", engine="torch") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_served_name(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def _messages(text: str, image: str | None = None) -> list[dict]:
    """LONG_TEXT as the system prompt, then `text` (after `image`, if given)."""
    asked = image_message(image, text=text) if image is not None else user(text)[0]
    return [{"role": "system", "content": LONG_TEXT}, asked]


def test_chat_text_repeat_hits_all_full_blocks_but_last_token(client):
    messages = _messages("Tell me about blocks, first time.")
    first = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=5, temperature=0
    )
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= 5
    p = first.usage.prompt_tokens
    assert p > 3 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens < p
    second = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=5, temperature=0
    )
    assert second.usage.prompt_tokens == p
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit(p)
    # No host KV tier: usage is vLLM's, without kvgate's `cpu_cached_tokens`.
    assert second.usage.prompt_tokens_details.model_dump(exclude_none=True) == {
        "cached_tokens": expected_hit(p)
    }
    # Greedy decoding of the same prompt is deterministic whatever came from the cache.
    assert second.choices[0].message.content == first.choices[0].message.content


def test_chat_streamed_text_with_usage(client):
    messages = _messages("Stream me something.")
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert content_chunks[-1].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens >= 1
    assert usage.prompt_tokens_details.cached_tokens is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    plain = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=6, temperature=0
    )
    assert plain.choices[0].message.content == streamed
    assert plain.usage.prompt_tokens_details.cached_tokens == expected_hit(
        plain.usage.prompt_tokens
    )


def test_chat_with_image_data_url_streamed_and_not(client):
    messages = _messages("What colour is this picture?", png_data_url((200, 30, 30)))
    first = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=4, temperature=0
    )
    p = first.usage.prompt_tokens
    assert p > 64  # the image expands to 64 placeholder tokens
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens == p
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_hit(p)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == first.choices[0].message.content
    # Another image behind the same placeholders must not reuse blocks holding the image.
    other = client.chat.completions.create(
        model="demo",
        messages=_messages("What colour is this picture?", png_data_url((0, 0, 250))),
        max_tokens=4,
        temperature=0,
    )
    assert other.usage.prompt_tokens == p
    assert other.usage.prompt_tokens_details.cached_tokens < expected_hit(p)


def test_a_truncated_image_names_its_content_part(worker):
    """Its header passes the renderer's probe; decoding its pixels in the engine fails, and the
    refusal names the part as every other image error does."""
    whole = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(whole, format="PNG")
    cut = data_url(whole.getvalue()[: len(whole.getvalue()) // 2])
    body = {"model": "demo", "max_tokens": 2, "messages": _messages("look", cut)}
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_image", "messages[1].content[0]"), err


def test_completions_text_and_token_ids_streamed_and_not(client):
    prompt = LONG_TEXT + " Completion:"
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    p = first.usage.prompt_tokens
    assert first.object == "text_completion" and first.choices[0].finish_reason
    again = client.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == expected_hit(p)
    assert again.choices[0].text == first.choices[0].text
    chunks = list(
        client.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_hit(p)
    ids = client.completions.create(
        model="demo", prompt=[5, 6, 7, 8] * 9, max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 36
    assert ids.usage.completion_tokens >= 1


def test_n_and_seed_give_n_choices_with_summed_usage(client):
    kwargs = dict(
        model="demo",
        prompt="Sampling several:",
        max_tokens=4,
        n=3,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_extra_fields_from_peer_routers_are_ignored(client):
    out = client.chat.completions.create(
        model="demo",
        messages=_messages("extra fields"),
        max_completion_tokens=2,
        temperature=0,
        extra_body={
            "no_stop_trim": True,
            "return_hidden_states": False,
            "separate_reasoning": True,
            "skip_special_tokens": True,
            "ignore_eos": True,
        },
    )
    assert out.usage.completion_tokens == 2
    assert out.choices[0].finish_reason == "length"


def test_cache_salt_isolates_prefix_cache(client):
    messages = _messages("Salted question.")
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=1)
    p = plain.usage.prompt_tokens
    salted = [
        client.chat.completions.create(
            model="demo", messages=messages, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
        )
        for _ in range(2)
    ]
    assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
    assert salted[1].usage.prompt_tokens_details.cached_tokens == expected_hit(p)
    other = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=1, extra_body={"cache_salt": "tenant-b"}
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_stop_string_truncates_and_reports_stop(client):
    kwargs = dict(
        model="demo",
        prompt="Stop strings end the text",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 4
    stop = full[len(full) // 2 :][:3]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 1e-300}, {"top_p": 1e-46}],
    ids=["temperature-1e-300", "temperature-denormal", "top_p-1e-300", "top_p-below-float32"],
)
def test_vanishing_temperature_or_top_p_leaves_the_engine_alive(client, worker, sampling):
    """Both are within their bounds. Before, the logits over 1e-300 were inf, a top_p that
    float32 rounds to 0 dropped every token, torch.multinomial raised inside the engine step
    and the engine loop died: one request, a dead worker (and, through a gateway that retried
    it, every worker). Now a temperature under 1e-5 samples greedily, as vLLM's does, and top_p
    keeps the top token."""
    kwargs = dict(
        model="demo", prompt="Tiny numbers", max_tokens=4, extra_body={"ignore_eos": True}
    )
    greedy = client.completions.create(**kwargs, temperature=0).choices[0].text
    out = client.completions.create(**kwargs, **sampling).choices[0].text
    assert out == greedy
    assert httpx.get(worker.url + "/health", timeout=10).status_code == 200
