"""JSON schemas as grammars (structured output), checked without a tokenizer: what the
job checks at intake (edge/protocol/response_format.py) and the text branch enforces
while decoding (edge/text/runtime/grammar.py, which says why llguidance). A module of its
own at the top of the package, importing nothing of ours: the protocol reaches it without
reaching into the text branch.

Its import is guarded: a box without llguidance serves every other job, and a job that
asks for structured output is told it is unavailable (`available`, `missing_reason`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

_llg: Any
_import_error: str | None = None
try:  # guarded: see the module's docstring
    import llguidance as _llg
except ImportError as _err:  # a box without the wheel serves every job but structured ones
    _llg = None
    _import_error = str(_err)

ENGINE = "llguidance"

# How a JSON schema becomes a grammar: compact-but-readable separators and no free
# whitespace, so the model cannot spend its token budget on spaces and newlines; never
# lenient (keywords the engine does not enforce are refused, not ignored). Applied over
# the schema's own `x-guidance` options: a requester cannot loosen them.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}

# Bounds on what a job's schema may cost before the engine sees it, and on what the engine
# may build from it: a compile runs on the text branch's thread and its memory is not in
# the ledger, so a hostile schema must be refused, not compiled. A few kilobytes and a
# nesting of ten or so is what a plant's or a clinic's record takes; these leave room.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
# A fifth of the engine's defaults (its grammar symbols and lexer states).
MAX_GRAMMAR_SIZE = 100_000
MAX_LEXER_STATES = 50_000


class GrammarError(ValueError):
    """A grammar (or the schema it came from) that cannot be enforced; the message says why."""


def available() -> bool:
    return _llg is not None


def missing_reason() -> str:
    return f"structured output needs the {ENGINE} package, which is not installed on this box ({_import_error})"


def engine_version() -> str:
    """The grammar engine's name and version, for the records benchmarks write."""
    if _llg is None:
        return f"{ENGINE} (not installed)"
    from importlib.metadata import version

    return f"{ENGINE} {version(ENGINE)}"


def require() -> Any:
    """The engine's module; GrammarError where it is not installed."""
    if _llg is None:
        raise GrammarError(missing_reason())
    return _llg


def limits() -> Any:
    """The engine's parser limits for a job's grammar (MAX_GRAMMAR_SIZE, MAX_LEXER_STATES)."""
    return require().LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, max_lexer_states=MAX_LEXER_STATES)


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iterative: a hostile
    nesting must not exhaust Python's stack here either)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar that admits exactly the JSON texts the schema validates (as the engine
    reads the schema), checked without a tokenizer; GrammarError naming what is wrong,
    whatever the engine raised."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a schema is a JSON object (a dictionary), not {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH}")
    text = json.dumps(schema)
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema is {len(text.encode('utf-8'))} bytes; at most {MAX_SCHEMA_BYTES}")
    return _grammar(text)


# A schema's grammar is asked for at intake and again when its job is admitted (the text
# worker's thread, each step while the grammar compiles): its conversion and check cost
# about as much as the compile itself, so the last few are kept, by the schema's text (in
# its own key order, which is the order the answer's fields are written in).
@functools.lru_cache(maxsize=64)
def _grammar(text: str) -> str:
    llg = require()
    try:
        grammar: str = llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        problem: str = llg.LLMatcher.validate_grammar(grammar, limits=limits())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a panic in the engine's Rust code is a BaseException
        raise GrammarError(f"{type(err).__name__}: {err}"[:300]) from err
    if problem:
        raise GrammarError(problem.strip().splitlines()[0][:300])
    return grammar
