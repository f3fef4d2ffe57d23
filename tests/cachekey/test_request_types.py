"""Strict request types on both sides of the gateway, worded as OpenAI words them (in process).

The attacks over HTTP are in tests/gateway/test_bodies.py; here the gateway's and the worker's
request models are held to the same types, field by field.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachekey.openai.errors import APIError
from cachekey.openai.validation import invalid_request, validation_error
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving.embeddings import EmbeddingRequest as GatewayEmbedding
from worker.server.embedding_protocol import EmbeddingRequest as WorkerEmbedding
from worker.server.protocol import ChatCompletionRequest as WorkerChat
from worker.server.protocol import CompletionRequest as WorkerCompletion

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"n": "64"}, "Invalid type for 'n': expected an integer, but got a string instead.", "n"),
        ({"n": 64.0}, "expected an integer, but got a decimal number instead.", "n"),
        ({"max_tokens": True}, "expected an integer, but got a boolean instead.", "max_tokens"),
        ({"seed": 2**64}, "integer above maximum value", "seed"),
        ({"temperature": "1"}, "expected a number, but got a string instead.", "temperature"),
        ({"stop": 5}, "expected one of str, list[str], but got an integer instead.", "stop"),
        ({"stop": ["a", 1]}, "Invalid type for 'stop[1]': expected a string", "stop[1]"),
        ({"stream": "true"}, "expected a boolean, but got a string instead.", "stream"),
        ({"logprobs": 1}, "expected a boolean, but got an integer instead.", "logprobs"),
        ({"messages": "hi"}, "expected an array, but got a string instead.", "messages"),
    ],
)
def test_gateway_messages(body: dict, message: str, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": MSG, **body})
    got, got_param, code = invalid_request(info.value.errors())
    assert message in got and got_param == param
    assert code in ("invalid_type", "integer_above_max_value")


@pytest.mark.parametrize(
    "body",
    [
        {"n": "2"}, {"n": 2.0}, {"n": True}, {"max_tokens": "5"}, {"max_tokens": 5.0},
        {"max_completion_tokens": "5"}, {"seed": "1"}, {"seed": 1.0}, {"top_k": "3"},
        {"temperature": "0.5"}, {"top_p": True}, {"stream": "false"}, {"ignore_eos": 1},
        {"stop": 3}, {"stop_token_ids": [1.0]}, {"stream_options": {"include_usage": "yes"}},
    ],
)  # fmt: skip
def test_both_sides_refuse_the_same_types(body: dict) -> None:
    for model in (ChatCompletionRequest, WorkerChat):
        with pytest.raises(ValidationError):
            model.model_validate({"messages": MSG, **body})


@pytest.mark.parametrize(
    "body",
    [
        {"n": 2, "max_tokens": 5, "seed": 1, "top_k": 3, "temperature": 1, "top_p": 1},
        {"n": None, "max_tokens": None, "stream": None, "ignore_eos": None, "seed": None},
        {"temperature": 0.5, "stop": ["a"], "stop_token_ids": [1], "logprobs": False},
        {"stream": True, "stream_options": {"include_usage": True}, "unknown_field": [1]},
    ],
)
def test_both_sides_accept_the_same_bodies(body: dict) -> None:
    gw = ChatCompletionRequest.model_validate({"messages": MSG, **body})
    worker = WorkerChat.model_validate({"messages": MSG, **body})
    assert gw.requested_max_tokens() == worker.requested_max_tokens()
    assert worker.n >= 1 and isinstance(worker.stream, bool)


def test_completions_default_and_null() -> None:
    assert CompletionRequest.model_validate({"prompt": "x"}).requested_max_tokens() == 16
    assert WorkerCompletion.model_validate({"prompt": "x"}).max_tokens == 16
    null = {"prompt": "x", "max_tokens": None}
    assert CompletionRequest.model_validate(null).requested_max_tokens() is None
    for bad in ({"prompt": [1, "a"]}, {"prompt": [[1], [True]]}, {"prompt": "x", "logprobs": 1.0}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)


@pytest.mark.parametrize(
    ("models", "body"),
    [
        ((ChatCompletionRequest, WorkerChat), {"messages": []}),
        ((ChatCompletionRequest, WorkerChat), {"messages": MSG, "max_completion_tokens": 0}),
        ((ChatCompletionRequest, WorkerChat), {"messages": MSG, "add_generation_prompt": 1}),
        ((ChatCompletionRequest, WorkerChat), {"messages": MSG, "temperature": -1}),
        ((ChatCompletionRequest, WorkerChat), {"messages": MSG, "stop": ["a", 1]}),
        ((ChatCompletionRequest, WorkerChat), {}),
        ((CompletionRequest, WorkerCompletion), {"prompt": [[1], [True]]}),
        ((CompletionRequest, WorkerCompletion), {"prompt": "x", "max_tokens": 0}),
        ((GatewayEmbedding, WorkerEmbedding), {"input": "x", "messages": MSG}),
        ((GatewayEmbedding, WorkerEmbedding), {"input": "x", "stream": True}),
        ((GatewayEmbedding, WorkerEmbedding), {"input": 5}),
        ((GatewayEmbedding, WorkerEmbedding), {"messages": []}),
    ],
)
def test_both_sides_answer_a_shared_field_with_the_same_error(models, body: dict) -> None:
    """The fields both sides take from cachekey/openai/ are refused with one error body."""
    bodies = []
    for model in models:
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        err = validation_error(info.value.errors())
        assert isinstance(err, APIError) and err.status == 400
        bodies.append(err.body())
    assert bodies[0] == bodies[1]
    assert bodies[0]["error"]["type"] == "invalid_request_error"


# vLLM's bounds on the sampling fields, declared once (cachekey/openai/protocol.py SamplingFields):
# each value on a bound is taken by both sides, each one past it refused by both with one error.
BOUNDS = [
    ("n", 16384, 16385), ("n", 1, 0),
    ("seed", 2**63 - 1, 2**63), ("seed", -(2**63), -(2**63) - 1),
    ("temperature", 2, 2.001), ("temperature", 0, -0.001),
    ("top_p", 1, 1.001), ("top_k", -1, -2), ("top_k", 2**63 - 1, 2**63),
    ("presence_penalty", 2, 2.5), ("frequency_penalty", -2, -2.5),
]  # fmt: skip


@pytest.mark.parametrize(("field", "inside", "outside"), BOUNDS)
def test_both_sides_hold_the_sampling_fields_to_vllms_bounds(field, inside, outside) -> None:
    ChatCompletionRequest.model_validate({"messages": MSG, field: inside})
    if field.endswith("_penalty"):  # in bounds, but the worker's engine applies no penalty
        with pytest.raises(ValidationError) as refused:
            WorkerChat.model_validate({"messages": MSG, field: inside})
        assert validation_error(refused.value.errors()).code == "invalid_value"
    else:
        WorkerChat.model_validate({"messages": MSG, field: inside})
    bodies = []
    for model in (ChatCompletionRequest, WorkerChat):
        with pytest.raises(ValidationError) as info:
            model.model_validate({"messages": MSG, field: outside})
        bodies.append(validation_error(info.value.errors()).body())
    assert bodies[0] == bodies[1] and bodies[0]["error"]["param"] == field


def test_one_declaration_of_the_sampling_fields() -> None:
    """Neither side declares a sampling field of its own: both take the shared one."""
    from cachekey.openai.protocol import SamplingFields

    for model in (ChatCompletionRequest, CompletionRequest, WorkerChat, WorkerCompletion):
        for name, shared in SamplingFields.model_fields.items():
            assert repr(model.model_fields[name]) == repr(shared), (model, name)
