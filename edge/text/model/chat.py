"""A model's own chat template (Jinja), rendered the way Hugging Face transformers renders
it: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson`
filter that keeps non-ASCII text, `raise_exception` and `strftime_now`, and the special
tokens as variables beside `messages` and `add_generation_prompt`, and `enable_thinking`
(Qwen3's switch: its template writes an empty reasoning block when it is false, and the
model answers at once; templates without the switch ignore it).

A template is compiled once per checkpoint; rendering a prompt is a plain call.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or is broken."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template does not compile: {err}") from err
        self._specials = {k: v for k, v in special_tokens.items() if v is not None}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, thinking: bool = False) -> str:
        """The prompt text. `thinking` is off by default: a Q&A job wants the answer, not
        a reasoning trace of hundreds of tokens before it."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=thinking,
                tools=None,
                documents=None,
                **self._specials,
            )
        except ChatTemplateError:
            raise
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from err
