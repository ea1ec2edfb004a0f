#!/usr/bin/env python3
"""Retrieval with checked citations, evaluated on the set made for this project
(engines/retrieval/rag_data.py: a clinic's leaflets, manuals, ward guides and procedure sheets,
and questions worded apart from them, beside the Python manual's topics).

- retrieval, through the product's own path (edge.docs.ingest.add: chunked, embedded
  with all-MiniLM-L6-v2 through onnxruntime, indexed; edge.docs.retrieve.Retriever):
  recall@1 and recall@5 of the chunk stating each question's fact;
- answers, by the clinic text engine (the served checkpoint, greedy) given the top
  passages as a `qa` job with a collection gets them, for each of several top_k:
  citation precision (cited ids that are the right chunk, over all cited ids), the
  share of citations the check marks supported, and answer accuracy (the fact's value
  stated in the answer); the headline figures are at the profile's default top_k;
- search latency per question on 2 threads at 10k and 100k chunks: the set's vectors
  and perturbed copies of them (unit length), the index kind the product picks at each
  size (exact to edge.docs.index.EXACT_MAX, HNSW beyond), and both kinds for reference,
  with HNSW's recall@5 against the exact scan.

Writes bench/results/rag.json and prints a table.

    python -m bench.eval_rag [--answers 120] [--top-k 1,2,4] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO, RESULTS, write_json
from edge.docs import index
from edge.docs.embed import Embedder, locate
from edge.docs.ingest import add
from edge.docs.retrieve import Passage, Retriever, context_of
from edge.docs.store import DocStore
from edge.tasks.grounding import GroundingPolicy, before_generating, judge
from engines.retrieval import hard_data, rag_data
from engines.retrieval.embed_build import build_embedder

SIZES = (10_000, 100_000)


def _norm(text: str) -> str:
    return " ".join(text.lower().replace("°", " ").split())


def retrieval(
    store: DocStore, name: str, embedder: Embedder, facts: list[rag_data.Fact]
) -> tuple[dict[str, Any], Found]:
    """Recall of the chunk stating each fact, through the product's Retriever; the top 5
    passages of each question."""
    collection = store.load(name)
    gold = {}
    for fact in facts:
        ids = [c.id for c in collection.chunks if c.document == fact.document and fact.passage in c.text]
        assert len(ids) == 1, (fact, ids)
        gold[fact.question] = ids[0]
    retriever = Retriever(store, embedder)
    at1 = at5 = 0
    found: Found = []
    ms = []
    for fact in facts:
        passages, took = retriever.search(name, fact.question, 5)
        ms.append(took["embed"] + took["search"])
        ids = [p.id for p in passages]
        at1 += ids[:1] == [gold[fact.question]]
        at5 += gold[fact.question] in ids
        found.append((fact, gold[fact.question], passages))
    n = len(facts)
    return {
        "questions": n,
        "chunks": len(collection.chunks),
        "documents": len(collection.documents),
        "recall_at_1": at1 / n,
        "recall_at_5": at5 / n,
        "retrieve_p50_ms": float(np.percentile(ms, 50)),
        "retrieve_p95_ms": float(np.percentile(ms, 95)),
    }, found


def unanswerable(store: DocStore, name: str, embedder: Embedder, facts: list[rag_data.Fact]) -> Found:
    retriever = Retriever(store, embedder)
    return [(fact, None, retriever.search(name, fact.question, 5)[0]) for fact in facts]


def ingest(store: DocStore, name: str, documents: dict[str, str], embedder: Embedder, folder: Path) -> float:
    folder.mkdir()
    for doc, text in documents.items():
        (folder / doc).write_text(text, encoding="utf-8")
    t0 = time.perf_counter()
    add(store, name, [folder], embedder)
    return time.perf_counter() - t0


Found = list[tuple[rag_data.Fact, str | None, list[Passage]]]  # (fact, its chunk or None, top passages)


def _right(fact: rag_data.Fact, answer: str) -> bool:
    return bool(fact.document) and _norm(fact.answer) in _norm(answer)


def answer_set(engine: Any, found: Found, top_k: int, policy: GroundingPolicy) -> dict[str, Any]:
    """Each question answered as a `qa` job with a collection is: the top_k passages, the
    grounding policy's decision before generating (edge/tasks/grounding.before_generating),
    the answer, its citations checked and judged (grounding.judge, which may answer with the
    passage's own sentence). Under `require` an answer is passed on only when grounded; the
    figures count it so (`raw_accuracy`: the model's own answers, before any of this). A
    citation is right when it cites the chunk stating the fact and the answer states the
    fact's value."""
    from edge.protocol.jobs import QAJob
    from edge.tasks.qa import answer

    flag = dataclasses.replace(policy, mode="flag")  # the answer kept, to grade what require withholds
    counts = {"answered": 0, "answered_right": 0, "wrong_grounded": 0, "raw_right": 0, "supported": 0,
              "supported_right": 0, "right_citations": 0, "from_passage": 0}  # fmt: skip
    reasons: dict[str, int] = {}
    examples: list[dict[str, Any]] = []
    for fact, gold, passages in found:
        shown = passages[:top_k]
        early = before_generating(policy, True, shown)
        if early is not None:
            reasons[early["abstain_reason"]] = reasons.get(early["abstain_reason"], 0) + 1
            continue
        out = answer(engine, QAJob(id="eval", question=fact.question, context=context_of(shown), max_new_tokens=48))
        judged = judge(flag, out, fact.question, shown)
        counts["raw_right"] += _right(fact, out["answer"])
        right = _right(fact, judged["answer"])
        for c in judged["citations"]:
            good = right and c["id"] == gold
            counts["supported"] += c["supported"]
            counts["right_citations"] += good
            counts["supported_right"] += good and c["supported"]
        if judged["grounded"]:
            counts["answered"] += 1
            counts["answered_right"] += right
            counts["wrong_grounded"] += not right
            counts["from_passage"] += judged["answer_source"] == "passage"
        else:
            reasons["unsupported"] = reasons.get("unsupported", 0) + 1
        if (judged["grounded"] and not right and len(examples) < 8) or len(examples) < 3:
            examples.append({"question": fact.question, "gold": gold, "value": fact.answer,
                             "model_answer": out["answer"], "answer": judged["answer"], "right": right,
                             "grounded": judged["grounded"], "citations": judged["citations"]})  # fmt: skip
    n = len(found)
    answered = counts["answered"]
    return {
        "questions": n,
        "top_k": top_k,
        "answered_accuracy": counts["answered_right"] / answered if answered else None,
        "wrong_grounded_rate": counts["wrong_grounded"] / n,
        "abstain_rate": (n - answered) / n,
        "right_rate": counts["answered_right"] / n,
        "raw_accuracy": counts["raw_right"] / n,
        "supported_precision": counts["supported_right"] / counts["supported"] if counts["supported"] else None,
        "supported_recall": counts["supported_right"] / counts["right_citations"]
        if counts["right_citations"]
        else None,
        "abstain_reasons": reasons,
        **counts,
        "examples": examples,
    }


def scores(found: Found) -> list[float]:
    return [passages[0].score for _, _, passages in found]


def threshold_figures(
    policy: GroundingPolicy, answerable: list[float], absent: list[float], off_topic: list[float]
) -> dict[str, Any]:
    """How the best passage's score separates answerable questions from absent ones and
    from questions about nothing clinical, and what the profile's abstain_below does to each."""
    return {
        "abstain_below": policy.abstain_below,
        "off_topic_under": float(np.mean(np.array(off_topic) < policy.abstain_below)),
        "off_topic_max": float(max(off_topic)),
        "answerable_under": float(np.mean(np.array(answerable) < policy.abstain_below)),
        "absent_under": float(np.mean(np.array(absent) < policy.abstain_below)) if absent else None,
        "answerable_min": float(min(answerable)),
        "answerable_p01": float(np.percentile(answerable, 1)),
        "absent_p50": float(np.percentile(absent, 50)) if absent else None,
        "absent_max": float(max(absent)) if absent else None,
    }


def _timed(idx: Any, queries: np.ndarray, k: int) -> tuple[list[float], np.ndarray]:
    ms, rows = [], []
    for q in queries:
        t0 = time.perf_counter()
        _, r = idx.search(q[None, :], k)
        ms.append((time.perf_counter() - t0) * 1000.0)
        rows.append(r[0])
    return ms, np.array(rows)


def latency(vectors: np.ndarray, queries: np.ndarray, threads: int) -> list[dict[str, Any]]:
    """Per-query search time at each size, the product's index kind and the other."""
    index.set_threads(threads)
    rng = np.random.default_rng(0)
    rows = []
    for size in SIZES:
        reps = -(-size // len(vectors))
        grown = np.concatenate([vectors + (0.0 if r == 0 else 0.08) * rng.standard_normal(vectors.shape)
                                for r in range(reps)])[:size].astype(np.float32)  # fmt: skip
        grown /= np.linalg.norm(grown, axis=1, keepdims=True)
        chosen = "flat" if size <= index.EXACT_MAX else "hnsw"  # what the product builds at this size
        exact_rows = None
        for kind in ("flat", "hnsw"):
            t0 = time.perf_counter()
            idx, _ = index.build(grown, kind)
            build_s = time.perf_counter() - t0
            _timed(idx, queries[:20], 5)  # warm
            ms, found = _timed(idx, queries, 5)
            row: dict[str, Any] = {
                "chunks": size,
                "kind": kind,
                "product_choice": kind == chosen,
                "p50_ms": float(np.percentile(ms, 50)),
                "p95_ms": float(np.percentile(ms, 95)),
                "build_s": build_s,
            }
            if kind == "flat":
                exact_rows = found
            elif exact_rows is not None:
                row["recall_at_5_vs_exact"] = float(
                    np.mean([len(set(a) & set(b)) / 5 for a, b in zip(found, exact_rows, strict=True)])
                )
            rows.append(row)
            served = "  <- served" if row["product_choice"] else ""
            print(f"  {size:>7} chunks {kind:<5} p50 {row['p50_ms']:.2f} ms p95 {row['p95_ms']:.2f} ms "
                  f"(built in {build_s:.1f} s){served}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--answers", type=int, default=120, help="leaflet questions answered by the text engine")
    parser.add_argument(
        "--top-k", default="1,2,4", help="passages put into an answer's prompt: each of these, one run apiece"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=RESULTS / "rag.json")
    args = parser.parse_args()
    import torch

    from bench.text_engines import engine_fields, load_engine
    from edge.config.text import QAModelConfig
    from engines.text.text_build import build_text_engine

    torch.set_num_threads(args.threads)
    data = rag_data.build(args.questions)
    hard, hard_absent = hard_data.build()
    embedder = Embedder.load(locate(build_embedder(args.engine_dir).parent), threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = DocStore(Path(tmp) / "state")
        ingest_s = ingest(store, "eval", data.documents, embedder, Path(tmp) / "docs")
        ingest(store, "hard", hard.documents, embedder, Path(tmp) / "hard")
        print(f"ingested {len(data.documents)} + {len(hard.documents)} documents", flush=True)
        figures, found = retrieval(store, "eval", embedder, data.facts)
        hard_figures, hard_found = retrieval(store, "hard", embedder, hard.facts)
        absent_found = unanswerable(store, "eval", embedder, rag_data.absent())
        hard_absent_found = unanswerable(store, "hard", embedder, hard_absent)
        off_topic = [rag_data.Fact("", "", q, "") for q in rag_data.OFF_TOPIC]
        off_scores = scores(unanswerable(store, "eval", embedder, off_topic))
        hard_off_scores = scores(unanswerable(store, "hard", embedder, off_topic))
        collection = store.load("eval")
        vectors = index.VectorIndex.read(store.version_dir("eval", collection.version)).vectors(
            list(range(len(collection.chunks)))
        )
    print(f"retrieval: recall@1 {figures['recall_at_1']:.3f}, recall@5 {figures['recall_at_5']:.3f} "
          f"over {figures['questions']} questions, {figures['chunks']} chunks; near-duplicate set recall@1 "
          f"{hard_figures['recall_at_1']:.3f}", flush=True)  # fmt: skip
    queries = embedder.embed([f.question for f in data.facts])
    print(f"search latency on {args.threads} threads:", flush=True)
    rows = latency(vectors, queries, args.threads)
    served = {r["chunks"]: r for r in rows if r["product_choice"]}

    shipped = QAModelConfig()  # the profile's defaults: the headline figures are theirs
    policy = GroundingPolicy.of(shipped)
    path = build_text_engine(args.engine_dir, "clinic", "awq-int4", progress=False)
    engine = load_engine(path, "cpu", max_context_tokens=1024, max_new_tokens=48)
    sweep = []
    for k in (int(x) for x in args.top_k.split(",")):
        print(f"answers by the clinic text engine ({args.answers} questions, top {k} passages):", flush=True)
        sweep.append(answer_set(engine, found[: args.answers], k, policy))
        _say(sweep[-1])
    answered = next(a for a in sweep if a["top_k"] == shipped.top_k)
    print(f"near-duplicate set ({len(hard_found)} questions, top {shipped.top_k}):", flush=True)
    hard_answers = answer_set(engine, hard_found, shipped.top_k, policy)
    _say(hard_answers)
    absent = answer_set(engine, absent_found, shipped.top_k, policy)
    hard_absent_answers = answer_set(engine, hard_absent_found, shipped.top_k, policy)
    keys = ("answered_accuracy", "wrong_grounded_rate", "abstain_rate", "supported_precision", "supported_recall",
            "right_rate", "raw_accuracy")  # fmt: skip
    result = {
        "set": f"engines/retrieval/rag_data.py (seed {rag_data.SEED})",
        "encoder": embedder.model,
        "index_library": "faiss-cpu",
        "exact_max": index.EXACT_MAX,
        "threads": args.threads,
        "machine": platform.machine(),
        "ingest_s": ingest_s,
        **figures,
        "grounding": policy.mode,
        **{k: answered[k] for k in keys},
        "citation_precision": answered["supported_precision"],
        "answers": answered,
        "answers_by_top_k": sweep,
        "absent": _absent(absent),
        "hard": {
            "set": f"engines/retrieval/hard_data.py (seed {hard_data.SEED}; held out)",
            **{k: hard_answers[k] for k in keys},
            "retrieval": hard_figures,
            "answers": hard_answers,
            "absent": _absent(hard_absent_answers),
            "threshold": threshold_figures(policy, scores(hard_found), scores(hard_absent_found), hard_off_scores),
        },
        "threshold": threshold_figures(policy, scores(found), scores(absent_found), off_scores),
        "default_top_k": shipped.top_k,
        "engine": engine_fields(engine),
        "search_p50_ms_10k": served[10_000]["p50_ms"],
        "search_p95_ms_10k": served[10_000]["p95_ms"],
        "search_p50_ms_100k": served[100_000]["p50_ms"],
        "search_p95_ms_100k": served[100_000]["p95_ms"],
        "search": rows,
        "goals": {
            "recall_at_5": 0.9, "search_p95_ms_100k": 5.0, "answered_accuracy": 0.95, "wrong_grounded_rate": 0.01,
            "supported_precision": 0.99, "supported_recall": 0.9, "hard_answered_accuracy": 0.9,
            "hard_wrong_grounded_rate": 0.01, "hard_right_rate": 0.6,
        },
    }  # fmt: skip
    write_json(args.out, result)
    print()
    print("| figure | leaflets | near-duplicates | goal |")
    print("|---|---:|---:|---|")
    for key in keys:
        print(f"| {key} | {_f(result[key])} | {_f(result['hard'][key])} | |")
    print(f"| recall@5 | {result['recall_at_5']:.3f} | {hard_figures['recall_at_5']:.3f} | >= 0.9 |")
    print(f"| search p95 at 100k ms | {result['search_p95_ms_100k']:.2f} | | <= 5 |")
    print(f"wrote {args.out}")


def _absent(figures: dict[str, Any]) -> dict[str, Any]:
    """Questions no document answers: every grounded answer to one is wrong."""
    keep = ("questions", "abstain_rate", "wrong_grounded_rate", "abstain_reasons", "examples")
    return {k: figures[k] for k in keep}


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _say(figures: dict[str, Any]) -> None:
    print(f"  answered accuracy {_f(figures['answered_accuracy'])}, "
          f"wrong grounded {figures['wrong_grounded_rate']:.3f}, "
          f"abstained {figures['abstain_rate']:.3f}, right {figures['right_rate']:.3f} (raw "
          f"{figures['raw_accuracy']:.3f}), supported precision {_f(figures['supported_precision'])}, "
          f"recall {_f(figures['supported_recall'])}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
