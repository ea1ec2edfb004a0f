"""Structured output (response_format): a JSON schema enforced while decoding by masking
the constrained rows of the batch (edge/text/runtime/grammar.py), on the served SmolLM2
build; the job field checked at intake naming the field; and a job through the daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from bench.structured import SCHEMAS
from edge.config.text import QAModelConfig
from edge.protocol.errors import JobError
from edge.protocol.jobs import JobLimits, QAJob, ResponseFormat, parse_job
from edge.tasks.qa import job_sequence, result_of
from edge.text.engine import TextEngine
from edge.text.runtime.continuous import Sequence
from edge.text.runtime.grammar import apply_masks, unpack_on
from tests.conftest import LABELS, DaemonProc, Requester

LIMITS = JobLimits(max_payload_bytes=1 << 20, max_prompt_chars=8000, max_new_tokens_limit=512)

# The benchmark's sample schemas (bench/structured.py), and one of the tests' own.
PART = SCHEMAS["part"]
PATIENT = SCHEMAS["patient"]
TRIAGE = {
    "type": "object",
    "properties": {"severity": {"enum": ["low", "medium", "high"]}, "fever": {"type": "number"}},
    "required": ["severity", "fever"],
    "additionalProperties": False,
}
# (schema, question): each asks for what the schema holds, as a requester would.
CASES: list[tuple[dict[str, Any], str]] = [
    (PART, "Part SN-4471 has a crack along its edge. Give its serial and whether it is defective."),
    (PATIENT, "Ana Ruiz, 34, is allergic to penicillin. Record her name, age and allergies."),
    (TRIAGE, "A child has a temperature of 39.2 and a rash. How severe is it, and what is the fever?"),
]
NEW_TOKENS = 40
HUGE = {"enum": [f"value {i:05d}" for i in range(9000)]}  # over json_grammar.MAX_SCHEMA_BYTES
NESTED: dict[str, Any] = {"type": "object"}
for _ in range(40):
    NESTED = {"type": "object", "properties": {"a": NESTED}}


@pytest.fixture(scope="module")
def engine(engine_dir: Path) -> TextEngine:
    """The served build (clinic adapter, AWQ INT4) with room for the test's batches."""
    from engines.text.text_build import build_text_engine

    path = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    cfg = QAModelConfig(max_context_tokens=384, max_sequences=4, kv_offload="off", prefix_cache_mib=0)
    return TextEngine.load(path, cfg)


def fmt(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if schema is None else {"type": "json_schema", "schema": schema}


def job(question: str, schema: dict[str, Any] | None, **fields: Any) -> QAJob:
    body = {"id": "s", "question": question, "max_new_tokens": NEW_TOKENS, **fields}
    if schema is not None:
        body["response_format"] = fmt(schema)
    parsed = parse_job(body, "qa", LIMITS).request
    assert isinstance(parsed, QAJob)
    return parsed


def run(engine: TextEngine, jobs: list[QAJob], speculative: int = 0) -> list[Sequence]:
    engine.batcher.speculative_tokens = speculative
    try:
        return engine.batcher.run_all([job_sequence(engine, j, f"s{i}") for i, j in enumerate(jobs)])
    finally:
        engine.batcher.speculative_tokens = 0


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize(
    ("response_format", "field", "words"),
    [
        ({"type": "xml"}, "response_format.type", "json_schema"),
        ({"type": "json_schema"}, "response_format.schema", "needs a schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "needs"),
        ({"type": "json_schema", "schema": {"type": "colour"}}, "response_format.schema", "Invalid type"),
        ({"type": "json_schema", "schema": [1, 2]}, "response_format.schema", "dictionary"),
        ({"type": "json_schema", "schema": {"type": "integer", "minimum": "x"}}, "response_format.schema", "minimum"),
        ({"type": "json_schema", "schema": {"$ref": "#/missing"}}, "response_format.schema", "missing"),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(("}}},
            "response_format.json_schema.schema",
            "regex",
        ),
        ({"type": "json_schema", "schema": PART, "json_schema": {"schema": PART}}, "response_format.json_schema", ""),
        ({"type": "json_object", "schema": PART}, "response_format.schema", "json_object"),
        ({"type": "json_schema", "schema": PART, "strict": True}, "response_format.strict", "unknown"),
        # Hostile schemas are refused before the engine compiles anything.
        ({"type": "json_schema", "schema": NESTED}, "response_format.schema", "nests"),
        (
            {"type": "json_schema", "schema": {"enum": [f"v{i:05d}" for i in range(9000)]}},
            "response_format.schema",
            "bytes",
        ),
    ],
)
def test_a_bad_response_format_is_refused_at_intake_naming_the_field(
    response_format: dict[str, Any], field: str, words: str
) -> None:
    body = {"id": "b", "question": "q", "response_format": response_format}
    with pytest.raises(JobError) as err:
        parse_job(body, "qa", LIMITS)
    assert err.value.field == field and words in err.value.message, err.value
    # A pipeline's ask is checked the same way, its field under ask.
    inspect = {"id": "b", "image": {"path": "p.png"}, "ask": {"question": "q", "response_format": response_format}}
    with pytest.raises(JobError) as err:
        parse_job(inspect, "inspect", LIMITS)
    assert err.value.field == f"ask.{field}"


def test_masks_unpack_alike_on_the_host_and_on_the_device_path() -> None:
    """apply_masks's CPU path (numpy) and the path a GPU takes (shifts on the device, run
    here on the CPU) mask the same tokens, tokens past the bitmask's included."""
    words = -(-100 // 32)
    seeded = torch.Generator().manual_seed(3)
    masks = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=seeded)
    logits = torch.randn(3, 130)
    masked = logits.clone()
    apply_masks(masked, [0, 2], masks)
    allowed = unpack_on(masks, torch.device("cpu"), 130)
    assert not allowed[:, words * 32 :].any()
    for i, row in enumerate((0, 2)):
        assert torch.equal(masked[row], logits[row].masked_fill(~allowed[i], float("-inf")))
        word, bit = 1, 5  # token 37: bit 5 of word 1
        assert bool(allowed[i, 32 * word + bit]) == bool((int(masks[i, word]) >> bit) & 1)
    assert torch.equal(masked[1], logits[1])


def test_openai_shape_and_json_object_are_accepted() -> None:
    openai = {"type": "json_schema", "json_schema": {"name": "part", "schema": PART, "strict": True}}
    for rf in (openai, {"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "schema": PART}):
        request = parse_job({"id": "a", "question": "q", "response_format": rf}, "qa", LIMITS).request
        assert isinstance(request, QAJob) and isinstance(request.response_format, ResponseFormat)


@pytest.mark.slow
def test_answers_parse_and_validate_and_do_not_without_the_mask(engine: TextEngine) -> None:
    """Every schema and prompt, batched: each answer is JSON its schema validates, carried
    parsed in the result. The same prompts unconstrained (asked for JSON in words) do not
    all give valid JSON: the mask is what makes them."""
    constrained = run(engine, [job(q + " Answer in JSON.", s) for s, q in CASES])
    for seq, (schema, _) in zip(constrained, CASES, strict=True):
        assert seq.finish == "eos" and valid(seq.text, schema), seq.text
        out = result_of(seq)
        assert out["json"] == json.loads(seq.text) and "json_error" not in out
    free = run(engine, [job(q + " Answer in JSON.", None) for _, q in CASES])
    assert not all(valid(seq.text, schema) for seq, (schema, _) in zip(free, CASES, strict=True))
    assert all("json" not in result_of(seq) for seq in free)


@pytest.mark.slow
def test_json_object_and_sampling_stay_within_the_grammar(engine: TextEngine) -> None:
    question = CASES[1][1]
    anything = job(question, None, response_format={"type": "json_object"}, max_new_tokens=120)
    part_schema, part_question = CASES[0]
    sampled = [job(part_question, part_schema, temperature=1.0, seed=seed, max_new_tokens=64) for seed in (1, 2)]
    first, *draws = run(engine, [anything, *sampled])
    out = result_of(first)
    assert first.text.startswith("{") and (
        isinstance(out["json"], dict) or (first.finish == "length" and out["json"] is None)
    ), out
    for seq in draws:
        assert valid(seq.text, part_schema) and result_of(seq)["json"] == json.loads(seq.text), seq.text
    assert draws[0].text != draws[1].text  # sampled, not greedy: the mask left a choice


@pytest.mark.slow
def test_an_unconstrained_row_beside_constrained_ones_decodes_as_alone(engine: TextEngine) -> None:
    """Masks touch only their own rows: the plain sequence's tokens are its solo greedy
    decode's, token for token, and the constrained ones' are what they are alone too. With
    speculative decoding on, the constrained rows never draft and answer the same."""
    plain = job("What should I do if a dressing gets wet?", None)
    schema, question = CASES[0]
    (alone,) = run(engine, [plain])
    (part_alone,) = run(engine, [job(question, schema)])
    mixed = run(engine, [job(question, schema), plain, job(CASES[2][1], CASES[2][0])])
    assert mixed[1].tokens == alone.tokens
    assert mixed[0].tokens == part_alone.tokens
    assert valid(mixed[2].text, CASES[2][0])
    spec = run(engine, [job(question, schema), plain], speculative=4)
    assert spec[0].drafted == 0 and spec[0].tokens == part_alone.tokens
    assert spec[1].tokens == alone.tokens


@pytest.mark.slow
def test_an_answer_cut_short_is_never_passed_off_as_json(engine: TextEngine) -> None:
    schema, question = CASES[1]
    short, stopped = run(engine, [job(question, schema, max_new_tokens=6), job(question, schema, stop=['"age"'])])
    for seq in (short, stopped):
        out = result_of(seq)
        assert out["json"] is None and "before its JSON was complete" in out["json_error"], out
    assert short.finish == "length" and stopped.finish == "stop"


@pytest.mark.slow
def test_compiled_grammars_are_cached_by_schema(engine: TextEngine) -> None:
    grammars = engine.batcher.grammars
    before = grammars.compiled
    for _ in range(3):
        job_sequence(engine, job("q", TRIAGE | {"title": "cache test"}))
    assert grammars.compiled == before + 1


@pytest.mark.integration
@pytest.mark.slow
def test_structured_jobs_through_the_daemon(daemon: DaemonProc, requester: Requester) -> None:
    """Over MQTT: a qa job's JSON validates and comes parsed; OpenAI's shape is taken;
    a bad schema is an error naming the field and the next job is served."""
    jobs = "edge/t1/jobs/qa"
    schema, question = CASES[0]
    openai = {"type": "json_schema", "json_schema": {"name": "part", "schema": schema, "strict": True}}
    for i, rf in enumerate(({"type": "json_schema", "schema": schema}, openai)):
        body = {"id": f"sj-{i}", "question": question, "max_new_tokens": NEW_TOKENS, "response_format": rf}
        result = requester.request(jobs, body, timeout=120)
        assert result["status"] == "ok", result.get("error")
        out = result["output"]
        assert valid(out["answer"], schema) and out["json"] == json.loads(out["answer"]), out
    bad = {"id": "sj-bad", "question": "q", "response_format": {"type": "json_schema", "schema": {"type": "colour"}}}
    result = requester.request(jobs, bad, timeout=60)
    assert result["status"] == "error" and result["error"]["field"] == "response_format.schema", result
    after = requester.request(jobs, {"id": "sj-after", "question": "Hello?", "max_new_tokens": 4}, timeout=120)
    assert after["status"] == "ok", after
    # A pipeline job's text part with a schema: the inspection's verdict goes in as context.
    rework = {
        "type": "object",
        "properties": {"defect": {"type": "boolean"}, "note": {"type": "string", "maxLength": 40}},
        "required": ["defect", "note"],
        "additionalProperties": False,
    }
    ask = {"question": "Write the rework note.", "max_new_tokens": 48, "response_format": fmt(rework)}
    body = {"id": "sj-pipe", "image": {"path": f"labels/{LABELS[1]['name']}"}, "ask": ask}
    result = requester.request("edge/t1/jobs/inspect", body, timeout=120)
    assert result["status"] == "ok", result.get("error")
    answer = result["output"]["answer"]
    assert valid(answer["answer"], rework) and answer["json"] == json.loads(answer["answer"]), answer


def test_a_pipeline_questions_compile_error_names_its_field_under_ask(
    engine: TextEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema intake accepted that the grammar engine then cannot compile for this
    model's tokenizer is an error naming `response_format`, or `ask.response_format` for
    a pipeline's question."""
    from edge.text.runtime.grammar import GrammarError

    def refuse(grammar: str) -> None:
        raise GrammarError("the tokenizer has no token for a required byte")

    monkeypatch.setattr(engine.batcher.grammars, "constraint", refuse)
    for fields in ("", "ask."):
        with pytest.raises(JobError) as err:
            job_sequence(engine, job(CASES[0][1], PART), "owner", fields=fields)
        assert err.value.field == f"{fields}response_format" and "cannot be enforced" in err.value.message


def test_a_schema_cannot_loosen_how_its_json_is_written() -> None:
    """The schema's own x-guidance options are overridden by ours: no free whitespace and
    never lenient (keywords the engine does not enforce refused, not ignored)."""
    from edge.json_grammar import json_schema_grammar

    loose = {**PART, "x-guidance": {"whitespace_flexible": True, "lenient": True}}
    options = json.loads(json_schema_grammar(loose))["grammars"][0]["json_schema"]["x-guidance"]
    assert options["whitespace_flexible"] is False and options["lenient"] is False


def test_a_row_whose_grammar_fails_ends_alone_and_the_batch_goes_on(engine: TextEngine) -> None:
    """A constrained sampled row whose matcher has failed (a token it refused was forced on
    it) is ended with the grammar's error; the sampled row beside it finishes as usual
    (drawing from a row of -inf scores would have failed the whole batch's step)."""
    bad = job_sequence(engine, job(CASES[0][1], PART, temperature=0.8, seed=1), "bad")
    good = job_sequence(engine, job(CASES[0][1], None, temperature=0.8, seed=2), "good")
    assert bad.grammar is not None
    refused = next(t for t in range(engine.model.config.vocab_size) if not bad.grammar.accept(t))
    assert bad.grammar.error is not None, refused
    done = engine.batcher.run_all([bad, good])
    assert done[0].finish == "error" and "grammar" in (done[0].error or "")
    assert done[1].finish in ("eos", "length") and done[1].tokens


def test_a_compile_that_breaks_is_tried_again_and_a_tokenizer_refusal_is_remembered(
    engine: TextEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile that breaks on the grammar thread (out of memory, say) is not remembered
    as the schema's refusal: the job is let through and its compile tried again. A
    tokenizer the engine cannot read is asked once, and every schema is refused with why."""
    from edge.json_grammar import json_schema_grammar, require
    from edge.text.runtime.grammar import GrammarError, Grammars

    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    grammars = Grammars(engine.tokenizer, engine.batcher.eos_ids, engine.model.config.vocab_size)
    real = Grammars._compile
    calls: list[str] = []

    def breaks_once(self: Grammars, text: str) -> Any:
        calls.append(text)
        if len(calls) == 1:
            raise MemoryError("no room")
        return real(self, text)

    monkeypatch.setattr(Grammars, "_compile", breaks_once)
    assert grammars.ready(grammar, wait_s=30)  # done (broken): the job may go on
    assert grammars.constraint(grammar) is not None and len(calls) == 2  # compiled again
    assert grammars.ready(grammar) and grammars.compiled == 1

    asked: list[int] = []
    llg = require()

    class Unreadable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            asked.append(1)
            raise ValueError("no such vocabulary")

    monkeypatch.setattr(llg, "LLTokenizer", Unreadable)
    fresh = Grammars(engine.tokenizer, engine.batcher.eos_ids, engine.model.config.vocab_size)
    other = json_schema_grammar({"type": "object", "properties": {"s": {"type": "string"}}})
    for text in (grammar, other):
        with pytest.raises(GrammarError, match="cannot read this model's tokenizer"):
            fresh.constraint(text)
    assert asked == [1]
