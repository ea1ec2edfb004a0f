#!/usr/bin/env python3
"""Structured output: answers constrained to JSON schemas (a qa job's `response_format`)
on the engine the shipped profile builds for a device (the clinic build), each prompt
answered greedily with its schema enforced, then without it for exactly as many tokens
(same prompt, same engine, same run), so the two costs per token sit side by side; each
pair `--repeats` times in alternating order, the fastest of each counting.

Per device row: valid_rate (answers that parse and validate against their schema, by
jsonschema; must be 1.0), cost_per_token_ms (decode time over answer tokens, constrained)
beside unconstrained_cost_per_token_ms, mask_ms_per_token (the host's share of it:
computing and applying the masks), compile_ms (each schema's first compile for the
model's tokenizer, the largest), the grammar engine and its version, how many schemas
and prompts, and the machine's load average as the run ended (other work slows both
columns alike, not their ratio).

`engines`: the grammar engines compared on the same schemas and the model's tokenizer,
by a fixed token trace of a valid instance per schema: compile_ms, mask_ms per token, and
whether each accepted every valid trace and refused an invalid token; xgrammar where it is
installed (it is not a dependency; this is how llguidance was chosen).

Writes bench/results/structured.json (merging rows of other devices) and prints a table.

    python -m bench.structured cpu|cuda [--threads 2]
    python -m bench.structured cpu --engines-only   (the engines' table alone)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from bench.common import REPO, RESULTS, write_json
from bench.text_engines import engine_fields, fixed, load_engine
from edge.protocol.jobs import QAJob, ResponseFormat
from edge.text.engine import TextEngine
from edge.text.runtime import grammar

NEW_TOKENS = 96

SCHEMAS: dict[str, dict[str, Any]] = {
    "part": {
        "type": "object",
        "properties": {"serial": {"type": "string", "maxLength": 24}, "defect": {"type": "boolean"}},
        "required": ["serial", "defect"],
        "additionalProperties": False,
    },
    "patient": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 32},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "allergies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        },
        "required": ["name", "age", "allergies"],
        "additionalProperties": False,
    },
    "triage": {
        "type": "object",
        "properties": {
            "severity": {"enum": ["low", "medium", "high"]},
            "fever_c": {"type": "number", "minimum": 30, "maximum": 45},
            "see_doctor": {"type": "boolean"},
        },
        "required": ["severity", "fever_c", "see_doctor"],
        "additionalProperties": False,
    },
    "rework": {
        "type": "object",
        "properties": {
            "defect": {"enum": ["scratch", "dent", "stain", "missing_print", "none"]},
            "steps": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer", "minimum": 1},
                        "action": {"type": "string", "maxLength": 40},
                    },
                    "required": ["n", "action"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["defect", "steps"],
        "additionalProperties": False,
    },
    "dose": {
        "type": "object",
        "properties": {
            "drug": {"type": "string", "maxLength": 24},
            "mg": {"type": "number", "exclusiveMinimum": 0},
            "every_hours": {"type": "integer", "minimum": 1, "maximum": 48},
            "with_food": {"type": ["boolean", "null"]},
        },
        "required": ["drug", "mg", "every_hours"],
        "additionalProperties": False,
    },
}

# (schema, question): two per schema, asking for what it holds as a requester would.
PROMPTS: list[tuple[str, str]] = [
    ("part", "Part SN-4471 has a crack along its edge. Give its serial and whether it is defective."),
    ("part", "Label reads 'LOT 22-B7, serial AX-9913'. The surface is clean. Record the part."),
    ("patient", "Ana Ruiz, 34, is allergic to penicillin. Record her name, age and allergies."),
    ("patient", "Record the patient: Tom Berg, 71 years old, no known allergies."),
    ("triage", "A child has a temperature of 39.2 and a rash. Triage the case."),
    ("triage", "An adult reports a mild headache and 37.1 degrees. Triage the case."),
    ("rework", "Inspection found a dent near the mounting hole. Write the rework note."),
    ("rework", "The label print is missing on the housing. Write the rework note."),
    ("dose", "Paracetamol 500 mg every 6 hours, after meals. Record the dose."),
    ("dose", "Ibuprofen 200 mg every 8 hours. Record the dose."),
]

# A valid instance per schema: the token trace the grammar engines are compared on.
INSTANCES: dict[str, Any] = {
    "part": {"serial": "SN-4471", "defect": True},
    "patient": {"name": "Ana Ruiz", "age": 34, "allergies": ["penicillin"]},
    "triage": {"severity": "high", "fever_c": 39.2, "see_doctor": True},
    "rework": {"defect": "dent", "steps": [{"n": 1, "action": "Remove the part"}, {"n": 2, "action": "Refit"}]},
    "dose": {"drug": "Paracetamol", "mg": 500, "every_hours": 6, "with_food": True},
}


def job(schema: str, question: str) -> QAJob:
    return QAJob(
        id="bench",
        question=question + " Answer in JSON.",
        max_new_tokens=NEW_TOKENS,
        response_format=ResponseFormat.model_validate({"type": "json_schema", "schema": SCHEMAS[schema]}),
    )


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def compile_ms(engine: TextEngine) -> float:
    """The largest first compile of a schema for the model's tokenizer, in an empty cache
    (the engine's view of the tokenizer built before, as an earlier job would have built it)."""
    batcher = engine.batcher
    grammars = grammar.Grammars(engine.tokenizer, batcher.eos_ids, batcher.model.config.vocab_size)
    grammars.constraint(grammar.json_schema_grammar({"type": "object"}))
    worst = 0.0
    for schema in SCHEMAS.values():
        text = grammar.json_schema_grammar(schema)
        t0 = time.perf_counter()
        grammars.constraint(text)
        worst = max(worst, (time.perf_counter() - t0) * 1000.0)
    return worst


def decode(engine: TextEngine, device: str, repeats: int) -> dict[str, Any]:
    """Each prompt constrained, then unconstrained for as many tokens, `repeats` times in
    alternating order; per prompt and mode the fastest run counts (other work on the
    machine only ever adds time), and the mask's host time of those runs likewise."""
    from edge.tasks.qa import job_sequence

    batcher = engine.batcher
    good, tokens = 0, 0
    constrained_s, free_s, mask_s = 0.0, 0.0, 0.0
    for i, (name, question) in enumerate(PROMPTS):
        runs: dict[str, list[float]] = {"on": [], "off": [], "mask": []}
        texts: set[str] = set()
        count = 0
        for r in range(repeats):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                if mode == "off" and not count:  # its length is the constrained answer's
                    continue
                if mode == "on":
                    before = batcher.mask_s
                    seq = batcher.single(job_sequence(engine, job(name, question)), "bench")
                    runs["mask"].append(batcher.mask_s - before)
                    count = max(1, len(seq.tokens))
                    texts.add(seq.text)
                    ok = seq.finish == "eos" and valid(seq.text, SCHEMAS[name])
                else:
                    plain = job_sequence(engine, QAJob(id="bench", question=question + " Answer in JSON."))
                    plain.params = fixed(count)
                    seq = batcher.single(plain, "bench")
                runs[mode].append(seq.decode_s)
        assert len(texts) == 1, "greedy constrained answers differ between repeats"
        good += ok
        tokens += count
        constrained_s += min(runs["on"])
        free_s += min(runs["off"])
        mask_s += min(runs["mask"])
        print(f"{i + 1}/{len(PROMPTS)} {name}: {count} tokens, valid {ok}: {texts.pop()[:80]}", flush=True)
    return {
        "device": device,
        "valid_rate": good / len(PROMPTS),
        "cost_per_token_ms": constrained_s * 1000.0 / tokens,
        "unconstrained_cost_per_token_ms": free_s * 1000.0 / tokens,
        "mask_ms_per_token": mask_s * 1000.0 / tokens,
        "compile_ms": compile_ms(engine),
        "tokens": tokens,
        "repeats": repeats,
        "grammar_engine": grammar.engine_version(),
        "schemas": len(SCHEMAS),
        "prompts": len(PROMPTS),
        "new_tokens": NEW_TOKENS,
    }


def _trace(engine: TextEngine, name: str) -> list[int]:
    text = json.dumps(INSTANCES[name])
    return list(engine.tokenizer.encode(text, add_special_tokens=False).ids)


def compare_engines(engine: TextEngine) -> list[dict[str, Any]]:
    """llguidance, as served, and xgrammar where installed, on the model's tokenizer."""
    import llguidance

    tokenizer = engine.tokenizer
    vocab = engine.batcher.model.config.vocab_size
    eos = sorted(engine.batcher.eos_ids)
    rows = []

    def measure(name: str, version: str, compile_one: Any, mask: Any, accept: Any) -> None:
        compiles, masks, correct = [], [], True
        for schema_name, schema in SCHEMAS.items():
            trace = _trace(engine, schema_name)
            t0 = time.perf_counter()
            state = compile_one(schema)
            compiles.append((time.perf_counter() - t0) * 1000.0)
            for token in trace:
                t0 = time.perf_counter()
                words = mask(state)
                masks.append((time.perf_counter() - t0) * 1000.0)
                correct = correct and bool(_unpack(words, vocab)[token]) and accept(state, token)
            # After the whole instance only an end may follow: a further "{" is refused.
            brace = tokenizer.token_to_id("{")
            correct = correct and not bool(_unpack(mask(state), vocab)[brace])
        rows.append(
            {
                "engine": name,
                "version": version,
                "compile_ms_max": max(compiles),
                "compile_ms_mean": statistics.mean(compiles),
                "mask_ms_mean": statistics.mean(masks),
                "mask_ms_p99": sorted(masks)[int(0.99 * (len(masks) - 1))],
                "correct": correct,
            }
        )

    lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    words = -(-vocab // 32)

    def ll_compile(schema: dict[str, Any]) -> Any:
        return llguidance.LLMatcher(lltok, grammar.json_schema_grammar(schema), log_level=0)

    def ll_mask(m: Any) -> torch.Tensor:  # the bitmask words, as each engine's own call gives them
        out = torch.empty(words, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(out.data_ptr(), words * 4)
        return out

    measure("llguidance", grammar.engine_version().split()[-1], ll_compile, ll_mask, lambda m, t: m.consume_token(t))
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return rows
    from importlib.metadata import version

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)  # type: ignore[no-untyped-call]
    info = xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    # Typed here: where xgrammar is not installed, mypy sees its module as Any.
    bitmask: torch.Tensor = xgrammar.allocate_token_bitmask(1, vocab)

    def xg_compile(schema: dict[str, Any]) -> Any:
        # The same JSON layout as llguidance's (json_grammar.JSON_OPTIONS): ", " and ": ", no free whitespace.
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    def xg_mask(m: Any) -> torch.Tensor:
        m.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    measure("xgrammar", version("xgrammar"), xg_compile, xg_mask, lambda m, t: m.accept_token(t))
    return rows


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].bool()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engines.text.text_build import build_text_engine

    torch.set_num_threads(args.threads)
    path = build_text_engine(args.engine_dir, "clinic", "awq-int4", progress=False)
    engine = load_engine(path, args.device, threads=args.threads)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.engines_only:  # the grammar engines compared again (with xgrammar installed); rows kept
        return {**previous, "engines": compare_engines(engine), "engines_machine": platform.machine()}
    row = decode(engine, args.device, args.repeats)
    row.update(engine_fields(engine))
    row["machine"] = platform.machine()
    row["threads"] = args.threads
    row["torch"] = torch.__version__
    # Other work on the machine slows both columns alike (they alternate prompt by prompt),
    # but not the absolute figures: what it was, said beside them.
    row["load_average_1m"] = os.getloadavg()[0]
    row["cpus"] = os.cpu_count()
    rows = [r for r in previous.get("rows", []) if r["device"] != args.device] + [row]
    out = {"rows": sorted(rows, key=lambda r: str(r["device"])), "engines": previous.get("engines", [])}
    if args.device == "cpu":  # the comparison is of host work: measured on the CPU box
        out["engines"] = compare_engines(engine)
        out["engines_machine"] = platform.machine()
    elif "engines_machine" in previous:
        out["engines_machine"] = previous["engines_machine"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each prompt and mode; the fastest counts")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured.json")
    parser.add_argument(
        "--engines-only",
        action="store_true",
        help="only compare the grammar engines (llguidance, and xgrammar where installed) on the model's "
        "tokenizer; the device rows are kept as they are",
    )
    args = parser.parse_args()
    if args.engines_only and args.device != "cpu":
        parser.error("--engines-only compares host work: run it with cpu")
    result = run(args)
    write_json(args.out, result)
    print(f"{'device':<6} {'valid':>6} {'ms/tok':>7} {'free':>7} {'mask':>6} {'compile':>8}")
    for r in result["rows"]:
        print(
            f"{r['device']:<6} {r['valid_rate']:>6.0%} {r['cost_per_token_ms']:>7.2f} "
            f"{r['unconstrained_cost_per_token_ms']:>7.2f} {r['mask_ms_per_token']:>6.3f} {r['compile_ms']:>8.2f}"
        )
    for e in result["engines"]:
        print(f"{e['engine']} {e['version']}: compile {e['compile_ms_max']:.1f} ms, mask {e['mask_ms_mean']:.3f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
