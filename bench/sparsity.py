#!/usr/bin/env python3
"""2:4 sparse INT4 with and without quantization-aware training, against dense INT4, in one run.

Three builds of the served model (SmolLM2-135M-Instruct with the clinic adapter merged),
each as `edgectl build` makes it from a profile (engines/text/text_build.py):

- `dense-int4`: the served AWQ INT4 build (or, with `--quantization rtn-int4`, every row
  rounded to nearest instead of by AWQ: what a busy CPU builds in minutes);
- `2:4-int4 one-shot`: every decoder projection pruned to 2:4 by Wanda on the
  calibration text (models.qa.layers: one rule, `sparsity: "2:4"`), then AWQ INT4 in the
  packed 2:4 format;
- `2:4-int4 qat`: the same pruning, then quantization-aware training (models.qa.qat at
  its defaults: engines/text/qat.py), then AWQ and the same packing.

Per row: `perplexity` on the evaluation text (disjoint from the calibration text the
training reads) and `token_agreement` of greedy continuations with the float model (the
merged clinic model, unquantized), both on the exact CPU kernel as bench/eval_text_quality.py
measures them (the section records that float model's perplexity and, for scale, the base
model's without the adapter: `float_perplexity`, `base_float_perplexity`); `adapter_all`,
the held-out clinic prompts' share that shows the adapter's behaviour
(engines/text/clinic_data.follows), and `rag_answered_accuracy`, the retrieval
evaluation's answered accuracy (bench/eval_rag.py's answer_set at the profile's top_k, on
the first --answers questions), both by the engine the shipped profile serves;
`weight_bytes` from the build's manifest; `decode_tok_s`, greedy decode after a
128-token prompt on that engine. The QAT row adds the training's `peak_bytes` with and
without gradient checkpointing (`recompute`): each a child process training a few steps
of the same model, its peak resident set (ru_maxrss) on the CPU, or the CUDA allocator's
peak on a GPU; and `peak_bytes_before_training`, the peak after loading and pruning, so
the training's own share shows.

`--device cuda`: the engines on the GPU and the training peaks measured there; with
`--shape llama3-8b` the speed rows of the 8B shape instead (random weights, written as a
Hugging Face directory by bench/build_memory.py: its quality figures are null, a random
model's being meaningless; round-to-nearest and magnitude pruning, the builds needing no
calibration Hessians; no QAT row, whose training of an 8B model whole does not fit one GPU's
memory with its optimizer state).

Writes bench/results/sparsity.json (or --out) and prints a table.

    python -m bench.sparsity [--engine-dir .edge/engines] [--threads 2] [--answers 40]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, agreement, perplexity, write_json
from bench.text_engines import engine_fields, load_engine
from edge.config.text import QAModelConfig, QATConfig
from edge.text.engine import TextEngine, kv_format
from edge.text.runtime.generate import SamplingParams
from engines.text.corpus import corpus_fingerprint, evaluation_text

WINDOW = 512  # perplexity window, as bench/eval_text_quality.py
EXACT = "exact"  # quality on the exact kernel: the build's cost alone (bench/eval_text_quality.py)
# Every decoder projection pruned: the sparse model the issue asks for (lm_head stays dense).
# By Wanda: SparseGPT's column-by-column update took 30 to 60 s a layer of SmolLM2 on the
# shared two-core box these rows were measured on, and the one-shot and QAT builds each prune.
RULES: list[dict[str, Any]] = [{"match": "layers.*", "format": "int4", "sparsity": "2:4", "pruning": "wanda"}]
# The 8B shape's speed rows: magnitude pruning needs no calibration Hessian (hours on a CPU).
SPEED_RULES: list[dict[str, Any]] = [{"match": "layers.*", "format": "int4", "sparsity": "2:4", "pruning": "magnitude"}]
PROMPT_TOKENS = 128
DECODE_TOKENS = 64


def qat_settings() -> dict[str, Any]:
    """The profile's QAT defaults, as `edgectl build` passes them (models.qa.qat)."""
    return QATConfig(enabled=True).model_dump(exclude={"enabled"})


def decode_rate(engine: TextEngine, vocab: int, repeat: int = 3) -> float:
    """Median decode tok/s of greedy runs after a PROMPT_TOKENS prompt: tokens after the
    first over the time between the first and the last."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
    rates = []
    for _ in range(repeat):
        times = engine.generate(prompt, SamplingParams(max_new_tokens=DECODE_TOKENS, ignore_eos=True)).token_times
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return float(statistics.median(rates))


def adapter_all(engine: TextEngine) -> float:
    """The held-out clinic prompts' share whose answer shows the adapter's behaviour."""
    from edge.protocol.jobs import QAJob
    from edge.tasks.qa import answer
    from engines.text.clinic_data import examples, follows

    held = examples("heldout")
    hits = [
        follows(ex, answer(engine, QAJob(id="h", question=ex.question, context=ex.context))["answer"]) for ex in held
    ]
    return sum(hits) / len(hits)


def rag_found(engine_dir: Path, questions: int, threads: int) -> Any:
    """The retrieval evaluation's questions with their retrieved passages (bench/eval_rag.py)."""
    from bench.eval_rag import ingest, retrieval
    from edge.docs.embed import Embedder, locate
    from edge.docs.store import DocStore
    from engines.retrieval import rag_data
    from engines.retrieval.embed_build import build_embedder

    data = rag_data.build(questions)
    embedder = Embedder.load(locate(build_embedder(engine_dir).parent), threads=threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = DocStore(Path(tmp) / "state")
        ingest(store, "eval", data.documents, embedder, Path(tmp) / "docs")
        _figures, found = retrieval(store, "eval", embedder, data.facts)
    return found


def rag_accuracy(engine: TextEngine, found: Any) -> float | None:
    from bench.eval_rag import answer_set
    from edge.tasks.grounding import GroundingPolicy

    shipped = QAModelConfig()
    result: float | None = answer_set(engine, found, shipped.top_k, GroundingPolicy.of(shipped))["answered_accuracy"]
    return result


def train_peak(
    source: Path, recompute: bool, steps: int, device: str, threads: int, adapter_data: bool
) -> dict[str, Any]:
    """The QAT step's peak memory training `steps` steps of the float checkpoint `source`
    (pruned by magnitude: the same shapes and masks' count as SparseGPT's), in a child
    process of its own so that its peak is the training's."""
    cmd = [sys.executable, "-m", "bench.sparsity", "--train-child", str(source), "--steps", str(steps),
           "--device", device, "--threads", str(threads), *(["--recompute"] if recompute else []),
           *(["--adapter-data"] if adapter_data else [])]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def train_child(args: argparse.Namespace) -> None:
    """--train-child: load, prune, train; print the peaks as one JSON line."""
    from dataclasses import replace

    from tokenizers import Tokenizer

    from engines.text.float_source import CheckpointSource
    from engines.text.prune import prune_magnitude
    from engines.text.qat import QATRecipe, adapter_sequences, batches, general_windows, load_model, train
    from engines.text.quantize import linear_names
    from engines.text.text_build import layer_recipe

    torch.set_num_threads(args.threads)
    source = CheckpointSource(args.train_child)
    model = load_model(source)
    quant = layer_recipe("awq", RULES)
    with torch.no_grad():
        for name in linear_names(model):
            if quant.sparsity_for(name) is not None:
                linear = model.get_submodule(name)
                assert isinstance(linear, torch.nn.Linear)
                linear.weight.copy_(prune_magnitude(linear.weight))
    tokenizer = Tokenizer.from_file(str(args.train_child / "tokenizer.json"))
    recipe = replace(QATRecipe(**{k: v for k, v in qat_settings().items() if k != "recompute"}),
                     steps=args.steps, recompute=args.recompute)  # fmt: skip
    adapter = adapter_sequences(tokenizer) if args.adapter_data else []
    data = batches(
        general_windows(tokenizer, recipe.seq_len), adapter, recipe, tokenizer.token_to_id("<|im_end|>") or 0
    )
    cuda = args.device == "cuda"
    if cuda:
        model.cuda()
        data = [(ids.cuda(), labels.cuda()) for ids, labels in data]
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    stats = train(model, data, quant, recipe)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "peak_bytes": peak, "peak_bytes_before_training": before, "steps": args.steps,
        "step_seconds": round(stats["train_seconds"] / args.steps, 2), "recompute": args.recompute,
        "measured": "CUDA allocator peak" if cuda else "peak resident set (ru_maxrss)",
    }))  # fmt: skip


def quality(
    path: Path, ids: list[int], prompts: list[list[int]], ref_conts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Perplexity and greedy agreement with the float model, on the exact kernel."""
    changes: dict[str, Any] = {"cpu_kernel": EXACT} if args.device == "cpu" else {}
    engine = load_engine(path, args.device, **changes)
    ppl = perplexity(engine.model, ids, WINDOW, kv_format=kv_format(engine.cfg))
    conts = [list(engine.generate(p, SamplingParams(max_new_tokens=args.new_tokens)).tokens) for p in prompts]
    return {
        "perplexity": round(ppl, 4),
        "token_agreement": round(agreement(ref_conts, conts)["token_agreement"], 4),
        "quality_engine_config": engine.config(),
    }


def smollm2_rows(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The three rows; `save` is handed the section as it grows (after each row and the
    training's peaks), so a run stopped part way leaves what it measured, `remaining`
    naming the rest."""
    from engines.text.import_gguf import import_smollm2
    from engines.text.peft_adapter import merge_checkpoint
    from engines.text.qlora import CLINIC_ADAPTER
    from engines.text.text_build import build_text_engine

    qat = qat_settings()
    merged = merge_checkpoint(import_smollm2(args.engine_dir), CLINIC_ADAPTER)  # the float model, as served's source
    reference = load_engine(merged, args.device)
    ids = reference.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids[: args.max_tokens]
    stride = len(ids) // args.prompts
    prompts = [ids[i * stride : i * stride + 48] for i in range(args.prompts)]
    ref_conts = [list(reference.generate(p, SamplingParams(max_new_tokens=args.new_tokens)).tokens) for p in prompts]
    float_ppl = perplexity(reference.model, ids, WINDOW, kv_format=kv_format(reference.cfg))
    del reference
    # The base model without the adapter, for scale: the clinic adapter (trained to a loss
    # near zero on a few hundred clinic answers) raises the perplexity of general text, and
    # INT4 rounding of the merged weights keeps only part of its update, so the merged float
    # model's perplexity can sit above its INT4 builds'. The rows are compared with each other.
    base = load_engine(import_smollm2(args.engine_dir), args.device)
    base_ppl = perplexity(base.model, ids, WINDOW, kv_format=kv_format(base.cfg))
    del base
    found = rag_found(args.engine_dir, args.questions, args.threads)[: args.answers]
    rows: list[dict[str, Any]] = []
    plan = [("dense-int4", None, None), ("2:4-int4 one-shot", RULES, None), ("2:4-int4 qat", RULES, qat)]
    section: dict[str, Any] = {
        "what": f"SmolLM2-135M-Instruct + clinic adapter: dense {args.quantization}, 2:4 one-shot, 2:4 with QAT",
        "device": args.device,
        "quantization": args.quantization,
        "rules": RULES,
        "qat": qat,
        "eval_text": f"pydoc_data topics, eval split (disjoint from calibration), corpus {corpus_fingerprint()}",
        "eval_tokens": len(ids),
        "window": WINDOW,
        "float_perplexity": round(float_ppl, 4),
        "base_float_perplexity": round(base_ppl, 4),
        "greedy_prompts": args.prompts,
        "greedy_new_tokens": args.new_tokens,
        "rag_questions": len(found),
        "decode": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": DECODE_TOKENS},
        "memory_steps": args.memory_steps,
        "training_peaks": {},
        "qat_recovered": None,
        "threads": args.threads,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
        "remaining": [name for name, _l, _q in plan] + ["training_peaks"],
    }
    for name, layers, trained in plan:
        if trained is not None:
            # The training's peaks first, each in a child of its own (the build below may
            # be cached, and the peak of this process is the evaluations').
            section["training_peaks"] = {
                ("recompute" if on else "no_recompute"): train_peak(
                    merged, on, args.memory_steps, args.device, args.threads, adapter_data=True
                )
                for on in (True, False)
            }
            section["remaining"].remove("training_peaks")
            save(section)
        t0 = time.monotonic()
        # Each build evaluated as soon as it is there: a build another process is making
        # (the lock of engines/cache.py) is waited for, not made twice.
        path = build_text_engine(args.engine_dir, "clinic", args.quantization, False, layers=layers, qat=trained)
        row: dict[str, Any] = {
            "variant": name,
            "checkpoint": path.name,
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        t0 = time.monotonic()
        row.update(quality(path, ids, prompts, ref_conts, args))
        served = load_engine(path, args.device, max_context_tokens=1024, max_new_tokens=48)
        manifest = json.loads((path / "manifest.json").read_text())
        row.update(
            {
                "adapter_all": round(adapter_all(served), 3),
                "rag_answered_accuracy": rag_accuracy(served, found),
                "weight_bytes": manifest["weight_bytes"],
                "decode_tok_s": round(decode_rate(served, served.model.config.vocab_size), 2),
                "int4_kernel": served.int4_kernel,
                **engine_fields(served),
            }
        )
        if trained is not None:
            row["training"] = manifest["qat"]
            peaks = section["training_peaks"]
            row["peak_bytes"] = {k: v["peak_bytes"] for k, v in peaks.items()}
            row["peak_bytes_before_training"] = {k: v["peak_bytes_before_training"] for k, v in peaks.items()}
            row["train_step_seconds"] = {k: v["step_seconds"] for k, v in peaks.items()}
        row["eval_seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        section["remaining"].remove(name)
        print({k: v for k, v in row.items() if "config" not in k}, flush=True)
        save(section)
    dense, one_shot = rows[0]["perplexity"], rows[1]["perplexity"]
    lost = one_shot - dense
    # The share of the one-shot row's perplexity loss that QAT won back (1: all of it).
    section["qat_recovered"] = round((one_shot - rows[2]["perplexity"]) / lost, 4) if lost > 0 else None
    return section


def shape_rows(args: argparse.Namespace) -> dict[str, Any]:
    """Speed and weight bytes of the 8B shape (random weights): dense and 2:4 INT4."""
    from bench.build_memory import SHAPES, write_hf
    from engines.text.text_build import build_text_engine

    config = SHAPES[args.shape]
    source = args.engine_dir / "sources" / f"random-{args.shape}"
    if not (source / "config.json").exists():
        write_hf(config, source)
    rows = []
    for name, layers in (("dense-int4", None), ("2:4-int4 one-shot", SPEED_RULES)):
        path = build_text_engine(args.engine_dir, "none", "rtn-int4", False, str(source), layers)
        engine = load_engine(path, args.device, max_context_tokens=1024, max_sequences=1)
        manifest = json.loads((path / "manifest.json").read_text())
        rows.append(
            {
                "variant": name,
                "checkpoint": path.name,
                "perplexity": None,
                "token_agreement": None,
                "adapter_all": None,
                "rag_answered_accuracy": None,
                "weight_bytes": manifest["weight_bytes"],
                "decode_tok_s": round(decode_rate(engine, config.vocab_size), 2),
                "int4_kernel": engine.int4_kernel,
                **engine_fields(engine),
            }
        )
        print({k: v for k, v in rows[-1].items() if "config" not in k}, flush=True)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return {"what": f"{args.shape} shape, random weights: speed and bytes", "device": args.device, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--quantization",
        choices=("awq-int4", "rtn-int4"),
        default="awq-int4",
        help="all three rows': AWQ as served, or round-to-nearest (no AWQ searches: minutes on a busy CPU)",
    )
    parser.add_argument("--shape", default="", help="a bench/build_memory.py shape (llama3-8b): its speed rows")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens for perplexity")
    parser.add_argument("--prompts", type=int, default=16, help="greedy continuation prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=400, help="the retrieval set's size (bench/eval_rag.py)")
    parser.add_argument("--answers", type=int, default=40, help="of its questions, those answered per row")
    parser.add_argument("--memory-steps", type=int, default=3, help="training steps of each peak measurement")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--train-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-data", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_child is not None:
        train_child(args)
        return
    torch.set_num_threads(args.threads)
    key = "shape" if args.shape else "smollm2"
    out = args.out or RESULTS / "sparsity.json"
    result = json.loads(out.read_text()) if out.exists() else {}

    def save(section: dict[str, Any]) -> None:
        result[f"{key}_{args.device}"] = section
        write_json(out, result)

    save(shape_rows(args) if args.shape else smollm2_rows(args, save))
    section = result[f"{key}_{args.device}"]
    print("| variant | perplexity | token agreement | adapter all | RAG answered | weight bytes | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in section["rows"]:
        print(f"| {row['variant']} | {row['perplexity']} | {row['token_agreement']} | {row['adapter_all']} | "
              f"{row['rag_answered_accuracy']} | {row['weight_bytes']} | {row['decode_tok_s']} |")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
