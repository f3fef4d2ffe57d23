"""Chat templates rendered as Hugging Face's apply_chat_template does, in a jinja2 sandbox.

The environment mirrors transformers' (trim_blocks, lstrip_blocks, loopcontrols, `tojson`,
`raise_exception`, `strftime_now`) so a model's own template renders the same text here as in
the engine it was written for. Templates are compiled once by the caller and reused.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cachekey.errors import TemplateError

# Names the renderer owns; chat_template_kwargs may not replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template rejected the request: {message}", param="messages")


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja's default would turn '<' into \u003c).
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; a syntax error is the model's fault, reported as such."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the model's chat template does not compile: {e}") from e


def render_template(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages`; `extra` holds the request's chat_template_kwargs."""
    context: dict[str, Any] = dict(extra or {})
    context.update(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )
    if tools is not None:
        context["tools"] = tools
    try:
        return template.render(context)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"chat template tried an unsafe operation: {e}") from e
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise TemplateError(
            f"chat template failed on these messages: {type(e).__name__}: {e}", param="messages"
        ) from e
