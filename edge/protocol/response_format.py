"""A qa job's `response_format`, checked at intake: the shape (ours, `{type, schema}`, or
OpenAI's, `{type, json_schema: {name, schema, strict}}`) and the schema itself, compiled
by the grammar engine without a tokenizer, so a schema the engine cannot enforce is
refused naming the field and the reason before the job is queued. (The grammar's
compile for the model's tokenizer comes later, on the text branch, once per distinct
schema: edge/tasks/structured.py; a failure there is the same structured error.)"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from edge.protocol.errors import ErrorCode, JobError

if TYPE_CHECKING:
    from edge.protocol.jobs import ResponseFormat

logger = logging.getLogger(__name__)

# What `json_object` asks for: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def schema_of(fmt: ResponseFormat | None, prefix: str = "") -> tuple[dict[str, Any], str] | None:
    """The schema a response_format enforces and the field it came from; None where it
    constrains nothing. JobError naming the field where its shape is wrong."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and (fmt.schema_ is not None or fmt.json_schema is not None):
            raise JobError(ErrorCode.INVALID_FIELD, "type 'text' takes no schema", f"{prefix}response_format.type")
        return None
    field = f"{prefix}response_format"
    if fmt.type == "json_object":
        if fmt.schema_ is not None or fmt.json_schema is not None:
            why = "type 'json_object' takes no schema (give type 'json_schema' to enforce one)"
            raise JobError(ErrorCode.INVALID_FIELD, why, f"{field}.schema")
        return ANY_OBJECT, f"{field}.type"
    if fmt.schema_ is not None and fmt.json_schema is not None:
        why = "give the schema once: 'schema' or 'json_schema.schema'"
        raise JobError(ErrorCode.INVALID_FIELD, why, f"{field}.json_schema")
    if fmt.schema_ is not None:
        return fmt.schema_, f"{field}.schema"
    if fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        return fmt.json_schema.schema_, f"{field}.json_schema.schema"
    where = f"{field}.json_schema.schema" if fmt.json_schema is not None else f"{field}.schema"
    raise JobError(ErrorCode.MISSING_FIELD, "type 'json_schema' needs a schema", where)


def grammar_of(fmt: ResponseFormat | None, prefix: str = "") -> str | None:
    """The grammar the text branch enforces for a response_format (None: unconstrained);
    JobError naming the field and the engine's reason where it cannot be enforced."""
    found = schema_of(fmt, prefix)
    if found is None:
        return None
    schema, field = found
    from edge import json_grammar as grammar  # here: only a job with a schema needs the engine

    if not grammar.available():
        raise JobError(ErrorCode.UNAVAILABLE, grammar.missing_reason(), f"{prefix}response_format")
    try:
        return grammar.json_schema_grammar(schema)
    except grammar.GrammarError as err:
        raise JobError(ErrorCode.INVALID_FIELD, f"the schema cannot be enforced: {err}", field) from err
