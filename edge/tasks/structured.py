"""Structured output for the text tasks: a job's `response_format` (checked at intake by
edge/protocol/response_format.py) bound to its sequence as a grammar the batcher masks
decoding with, and the result's parsed JSON, given only where the grammar was completed."""

from __future__ import annotations

import json
import logging
from typing import Any

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import ResponseFormat
from edge.protocol.response_format import grammar_of
from edge.text.engine import TextEngine
from edge.text.runtime.continuous import Sequence
from edge.text.runtime.grammar import GrammarError

logger = logging.getLogger(__name__)


def constrain(engine: TextEngine, seq: Sequence, fmt: ResponseFormat | None, prefix: str = "") -> None:
    """Give the sequence the grammar its response_format asks for (none: left as it is).
    The grammar is compiled for the model's tokenizer once per distinct schema (cached by
    hash in the batcher's Grammars); the first such job also builds the engine's view of
    the tokenizer."""
    grammar = grammar_of(fmt, prefix)
    if grammar is None:
        return
    try:
        seq.grammar = engine.batcher.grammars.constraint(grammar)
    except GrammarError as err:
        field = f"{prefix}response_format"
        raise JobError(ErrorCode.INVALID_FIELD, f"the schema cannot be enforced: {err}", field) from err


def grammar_ready(engine: TextEngine, fmt: ResponseFormat | None, prefix: str = "", wait_s: float = 0.0) -> bool:
    """Whether `constrain` would not wait for a compile: no grammar asked, or its schema
    compiled (or refused) for this model's tokenizer already. If not, the compile starts on
    the grammar engine's own thread, waited for up to `wait_s`; the job waits in its queue
    meanwhile, and the text branch's thread decodes on. A response_format that cannot
    become a grammar is ready: `constrain` says why."""
    try:
        grammar = grammar_of(fmt, prefix)
    except JobError:
        return True
    return grammar is None or engine.batcher.grammars.ready(grammar, wait_s)


def structured_result(seq: Sequence) -> dict[str, Any]:
    """`json`: the answer parsed, where its grammar was completed (the JSON closed); else
    None and `json_error` saying why, so that an answer cut short (max_new_tokens, a stop
    string, the context window) is never taken for a whole object."""
    assert seq.grammar is not None
    if seq.finish in ("eos", "length") and seq.grammar.complete:
        try:
            return {"json": json.loads(seq.text)}
        except json.JSONDecodeError as err:  # the grammar admits only JSON: a fault if this happens
            logger.error("a completed structured answer did not parse: %s", err)
            return {"json": None, "json_error": f"the answer did not parse as JSON: {err}"}
    if seq.finish == "error":
        why = f"generation failed: {seq.error}"
    elif seq.finish == "stop":
        why = "a stop string ended the answer before its JSON was complete"
    else:
        why = f"the answer ended (finish_reason {seq.finish}) before its JSON was complete"
    return {"json": None, "json_error": why}
