#!/usr/bin/env python3
"""Speculative decoding by prompt lookup on the CPU: the engine profiles/cpu-dev.yaml's qa
section builds (the clinic build), with models.qa.speculative 'prompt-lookup', which the
shipped profile leaves off (so the result's `served` is false), answering the
retrieval questions of the leaflets set (engines/retrieval/rag_data.py), each with its
leaflet's passages as a `qa` job with a collection puts them into its prompt (the
chunk stating the fact first, then the leaflet's others, up to the profile's top_k),
greedy. Each question is answered with speculation off and on in turn, on the same
engine, so both see the same machine state.

Per method (off, and prompt lookup at each draft length asked for: the profile's
default is marked `default`): acceptance_rate (draft tokens taken over those checked), tokens_per_step
(answer tokens over the decode steps that made them), effective_tok_s (answer tokens
over decode time), baseline_tok_s (speculation off), speedup, and identical_greedy (every
answer token for token the same as with speculation off).

Writes bench/results/speculative.json and prints a table.

    python -m bench.speculative [--questions 36] [--threads 2] [--tokens 2 3 4 6]

On a GPU, `--verify-cost` measures instead what verifying k drafts costs on the 8B shape
(random INT4 weights at the group size a build gives it, the GPU profile's engine): the
chunk of k + 1 tokens the batcher verifies in one call, against one decode step as served
(CUDA graphs), for k = 1..8, into the same file's `verify_cost`; and what the acceptance
measured on the CPU's real answers would make of it there, called a projection.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, write_json
from bench.text_engines import engine_fields, load_engine
from edge.docs.chunking import chunk_sections
from edge.docs.extract import extract
from edge.docs.retrieve import Passage, context_of
from edge.protocol.jobs import QAJob
from edge.text.engine import TextEngine
from edge.text.runtime.continuous import Sequence
from engines.retrieval import rag_data

NEW_TOKENS = 48  # as bench/eval_rag.py's answers


def questions(count: int, top_k: int) -> list[tuple[str, str]]:
    """(question, context) for the set's first `count` facts: the fact's chunk of its
    leaflet first, then the leaflet's other chunks, `top_k` in all, tagged with their ids
    as retrieval tags them (edge/docs/retrieve.py context_of)."""
    data = rag_data.build(count)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for fact in data.facts:
            path = Path(tmp) / fact.document
            path.write_text(data.documents[fact.document], encoding="utf-8")
            chunks = chunk_sections(fact.document, extract(path, 1 << 20))
            chunks.sort(key=lambda c: fact.passage not in c.text)  # the fact's own first
            shown = [Passage(c.id, 1.0, c.text, c.title) for c in chunks[:top_k]]
            out.append((fact.question, context_of(shown)))
    return out


def answer(engine: TextEngine, question: str, context: str, draft_tokens: int) -> tuple[Sequence, int]:
    """One answer alone on the engine's batcher with `draft_tokens` drafts a step (0:
    speculation off); the sequence and the decode steps it took."""
    from edge.tasks.qa import job_sequence

    engine.batcher.speculative_tokens = draft_tokens
    job = QAJob(id="bench", question=question, context=context, max_new_tokens=NEW_TOKENS)
    steps = engine.batcher.steps
    seq = engine.batcher.single(job_sequence(engine, job), "bench")
    return seq, engine.batcher.steps - steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engines.text.text_build import build_text_engine

    torch.set_num_threads(args.threads)
    path = build_text_engine(args.engine_dir, "clinic", "awq-int4", progress=False)
    engine = load_engine(path, "cpu", threads=args.threads, speculative="prompt-lookup")
    asked = questions(args.questions, engine.cfg.top_k)
    drafts = [0, *args.tokens]  # 0: speculation off, the baseline
    totals = {k: {"tokens": 0, "steps": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0} for k in drafts}
    identical = dict.fromkeys(args.tokens, True)
    for i, (question, context) in enumerate(asked):
        # Each method first in turn, so none always runs on a machine another warmed.
        order = drafts[i % len(drafts) :] + drafts[: i % len(drafts)]
        got: dict[int, list[int]] = {}
        for k in order:
            seq, steps = answer(engine, question, context, k)
            got[k] = seq.tokens
            t = totals[k]
            t["tokens"] += len(seq.tokens)
            t["steps"] += steps
            t["decode_s"] += seq.decode_s
            t["drafted"] += seq.drafted
            t["accepted"] += seq.accepted
        for k in args.tokens:
            identical[k] = identical[k] and got[k] == got[0]
        same = all(got[k] == got[0] for k in args.tokens)
        print(f"{i + 1}/{len(asked)}: {len(got[0])} tokens, same {same}", flush=True)
    engine.batcher.speculative_tokens = engine.cfg.speculative_tokens
    baseline = totals[0]["tokens"] / totals[0]["decode_s"] if totals[0]["decode_s"] else 0.0
    rows = []
    for k in drafts:
        t = totals[k]
        rate = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        rows.append(
            {
                "device": "cpu",
                "method": f"prompt-lookup k={k}" if k else "off",
                "speculative_tokens": k,
                "default": k == engine.cfg.speculative_tokens,
                "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
                "tokens_per_step": t["tokens"] / t["steps"] if t["steps"] else None,
                "effective_tok_s": rate,
                "baseline_tok_s": baseline,
                "speedup": rate / baseline if baseline else None,
                "identical_greedy": identical.get(k, True),
                **t,
            }
        )
    return {
        "machine": platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "questions": len(asked),
        "new_tokens": NEW_TOKENS,
        "rows": rows,
        **engine_fields(engine),
    }


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification yields when each of k drafts is taken with probability
    `acceptance` given the ones before it: the drafts taken, and the model's own token
    after them."""
    return float(sum(acceptance**i for i in range(k + 1)))


def project(entry: dict[str, Any], acceptance: float | None) -> dict[str, Any]:
    """A verify_cost row with its projection at `acceptance` (arithmetic on its measured
    times: what the drafts taken at that rate would make of them)."""
    entry = {k: v for k, v in entry.items() if not k.startswith("projected_")}
    if acceptance is not None:
        tokens = expected_tokens(acceptance, entry["k"])
        speedup = tokens * entry["decode_ms"] / entry["verify_ms"]
        entry |= {"projected_tokens_per_step": tokens, "projected_speedup": speedup}
    return entry


def default_acceptance(rows: list[dict[str, Any]]) -> float | None:
    """The measured acceptance of the profile's default draft length (the projection's)."""
    measured = [r for r in rows if r.get("acceptance_rate") is not None and r.get("default")]
    return measured[0]["acceptance_rate"] if measured else None


def verify_cost(args: argparse.Namespace, acceptance: float | None) -> dict[str, Any]:
    """Per k: the verification call's time against one served decode step, on CUDA."""
    import statistics

    from edge.text.runtime.generate import SamplingParams
    from engines.text.random_llama import LLAMA3_8B, write_random_checkpoint
    from engines.text.text_build import serving_group

    group = serving_group(LLAMA3_8B.parameter_count())
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (512,), generator=torch.Generator().manual_seed(5)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "llama3-8b-int4-random", LLAMA3_8B, device="cuda", group=group)
        engine = load_engine(path, "cuda", max_sequences=1, max_context_tokens=1024)
        rates = [
            engine.generate(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True)).tokens_per_s for _ in range(4)
        ]
        decode_ms = 1000.0 / statistics.median(rates[1:])
        batcher = engine.batcher
        row = batcher.cache.rows(0, 1)
        with torch.inference_mode():
            batcher.model(torch.tensor([prompt], device="cuda"), row, 0)
            rows = []
            for k in range(1, 9):
                chunk = torch.randint(0, LLAMA3_8B.vocab_size, (1, k + 1), device="cuda")
                times = []
                for _ in range(12):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    start.record()
                    batcher.model(chunk, row, len(prompt), last_only=False)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                verify_ms = statistics.median(times[2:])
                entry = project(
                    {"k": k, "verify_ms": verify_ms, "decode_ms": decode_ms, "ratio": verify_ms / decode_ms}, acceptance
                )
                rows.append(entry)
                print(json.dumps(entry), flush=True)
        return {
            "device": torch.cuda.get_device_name(0),
            "model": f"Llama-3-8B shape, INT4 g{group}, random weights: cost only",
            "context": len(prompt),
            "acceptance_rate": acceptance,
            "projection": "projected_speedup = expected tokens per verification at the CPU row's acceptance "
            "rate (each draft taken independently) x decode step time / verification time; not measured",
            "rows": rows,
            **engine_fields(engine),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=36)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[2, 3, 4, 6],
        help="draft tokens a step to measure, a row each (models.qa.speculative_tokens)",
    )
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    parser.add_argument("--verify-cost", action="store_true", help="on a GPU: the 8B shape's verification cost")
    args = parser.parse_args()
    if args.verify_cost:
        result = json.loads(args.out.read_text()) if args.out.exists() else {}
        result["verify_cost"] = verify_cost(args, default_acceptance(result.get("rows", [])))
        write_json(args.out, result)
        print(f"wrote {args.out}")
        return
    result = run(args)
    if args.out.exists():
        # The GPU's verification cost is measured apart (--verify-cost): kept, not lost,
        # its projection made again at this run's acceptance (the times are its own).
        earlier = json.loads(args.out.read_text())
        if "verify_cost" in earlier:
            cost = earlier["verify_cost"]
            acceptance = default_acceptance(result["rows"])
            result["verify_cost"] = {
                **cost,
                "acceptance_rate": acceptance,
                "rows": [project(entry, acceptance) for entry in cost["rows"]],
            }
    write_json(args.out, result)
    print(f"{'method':<20} {'accept':>7} {'tok/step':>8} {'tok/s':>7} {'speedup':>7} same")
    for r in result["rows"]:
        accept = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        print(
            f"{r['method']:<20} {accept:>7} {r['tokens_per_step'] or 0:>8.2f} {r['effective_tok_s']:>7.1f} "
            f"{r['speedup'] or 0:>7.2f} {r['identical_greedy']}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
