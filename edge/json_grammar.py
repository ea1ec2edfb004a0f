"""JSON schemas as grammars (structured output), checked without a tokenizer: what the
job checks at intake (edge/protocol/response_format.py) and the text branch enforces
while decoding (edge/text/runtime/grammar.py, which says why llguidance). A module of its
own at the top of the package, importing nothing of ours: the protocol reaches it without
reaching into the text branch.

Its import is guarded: a box without llguidance serves every other job, and a job that
asks for structured output is told it is unavailable (`available`, `missing_reason`).
"""

from __future__ import annotations

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
# whitespace, so the model cannot spend its token budget on spaces and newlines.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar that admits exactly the JSON texts the schema validates (as the engine
    reads the schema), checked without a tokenizer; GrammarError naming what is wrong."""
    llg = require()
    try:
        grammar: str = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as err:
        raise GrammarError(str(err)) from err
    problem: str = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem.strip().splitlines()[0][:300])
    return grammar
