#!/usr/bin/env python3
"""Quality of the INT4 text checkpoints against the float reference, real model.

Perplexity on held-out text the quantizer never saw (Python reference topics disjoint
from the calibration ones), and agreement of greedy continuations with the float
model's. Every build is read by the engine the daemon builds from the shipped CPU
profile (bench/text_engines.py); each row records it. Writes
bench/results/text_quality.json and prints a table.

    python -m bench.eval_text_quality [--max-tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, agreement, perplexity, write_json
from bench.text_engines import engine_fields, load_engine
from edge.text.engine import TextEngine, kv_format
from edge.text.model.embedding import QuantizedEmbedding
from edge.text.runtime.generate import SamplingParams
from engines.text.corpus import corpus_fingerprint, evaluation_text
from engines.text.import_gguf import import_smollm2
from engines.text.quantize import QuantRecipe
from engines.text.text_build import quantize_checkpoint

WINDOW = 512


def continuations(engine: TextEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations, each prompt alone through the engine's batcher."""
    return [list(engine.generate(p, SamplingParams(max_new_tokens=new_tokens)).tokens) for p in prompts]


def engine_perplexity(engine: TextEngine, ids: list[int]) -> float:
    """Perplexity with the engine's model reading its KV cache in the engine's format."""
    return perplexity(engine.model, ids, WINDOW, kv_format=kv_format(engine.cfg))


# The perplexity and token-table rows measure a quantization's (or a table's) cost alone:
# on our exact CPU kernel, not the CPU profile's int8 activations, whose rounding would
# add its own. The adapter rows are answered by the engine the profile serves.
EXACT = "exact"


def adapter_behaviour(engine_dir: Path, only: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Held-out clinic prompts: how often each build cites its document / declines to
    diagnose / answers untagged context without a made-up citation. `only`: just these
    variants (all when empty)."""
    from edge.protocol.jobs import QAJob
    from edge.tasks.qa import answer
    from engines.text.clinic_data import examples, follows
    from engines.text.peft_adapter import merge_checkpoint
    from engines.text.qlora import CLINIC_ADAPTER

    base = import_smollm2(engine_dir)
    merged = merge_checkpoint(base, CLINIC_ADAPTER)  # the shipped adapter, as served
    variants: dict[str, Callable[[], Path]] = {
        "base, float": lambda: base,
        "clinic merged, float": lambda: merged,
        "clinic merged, AWQ INT4 g128": lambda: quantize_checkpoint(merged, QuantRecipe(method="awq", group_size=128)),
        "clinic merged, AWQ INT4 g64": lambda: quantize_checkpoint(merged, QuantRecipe(method="awq", group_size=64)),
        "clinic merged, AWQ INT4 g32 (served)": lambda: quantize_checkpoint(
            merged, QuantRecipe(method="awq", group_size=32)
        ),
        # What a TensorRT plan serves (models.qa.quantization: awq-int4-sym).
        "clinic merged, AWQ INT4 g32 symmetric": lambda: quantize_checkpoint(
            merged, QuantRecipe(method="awq", group_size=32, symmetric=True)
        ),
    }
    held = examples("heldout")
    rows = []
    for name, build in variants.items():
        if only and name not in only:
            continue
        path = build()
        # The served CPU engine with this build in it; each answer alone, greedy.
        engine = load_engine(path, "cpu", max_context_tokens=512, max_new_tokens=40)
        hits: dict[str, list[bool]] = {}
        for ex in held:
            said = answer(engine, QAJob(id="h", question=ex.question, context=ex.context))["answer"]
            hits.setdefault(ex.kind, []).append(follows(ex, said))
        rows.append(
            {
                "variant": name,
                **{kind: round(sum(v) / len(v), 3) for kind, v in hits.items()},
                "all": round(sum(sum(v) for v in hits.values()) / len(held), 3),
                **engine_fields(engine),
            }
        )
    return rows


def token_tables(served: Path, ids: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Compact token tables (models.qa.embedding) on the served build: perplexity and
    greedy agreement against the same engine with its float table, so only the table's
    rounding differs. (Its output projection is INT4, so the table is not tied to it and
    every format is one the engine serves.)"""
    stride = len(ids) // args.prompts
    prompts = [ids[i * stride : i * stride + 48] for i in range(args.prompts)]
    reference = load_engine(served, "cpu", embedding="float", cpu_kernel=EXACT)
    ref_conts = continuations(reference, prompts, args.new_tokens)
    ref_ppl = engine_perplexity(reference, ids)
    rows = []
    for fmt in ("int8", "int4"):
        engine = load_engine(served, "cpu", embedding=fmt, cpu_kernel=EXACT)
        table = engine.model.embed_tokens
        assert isinstance(table, QuantizedEmbedding), f"the {fmt} table was not compacted"
        t0 = time.perf_counter()
        ppl = engine_perplexity(engine, ids)
        conts = continuations(engine, prompts, args.new_tokens)
        rows.append(
            {
                "variant": f"AWQ INT4 g32 (served), {fmt} token table",
                "table_bytes": table.nbytes,
                "float_table_bytes": table.num_embeddings * table.embedding_dim * 2,  # 16-bit, as on a GPU
                "perplexity": round(ppl, 4),
                "reference_perplexity": round(ref_ppl, 4),
                **{k: round(v, 4) for k, v in agreement(ref_conts, conts).items()},
                "eval_seconds": round(time.perf_counter() - t0, 1),
                **engine_fields(engine),
            }
        )
    return rows


def print_tables(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"{r['variant']:<40} perplexity {r['perplexity']:.3f} (float table {r['reference_perplexity']:.3f}), "
            f"token agreement {r['token_agreement']:.3f}, {r['table_bytes'] / 2**20:.1f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens for perplexity")
    parser.add_argument("--prompts", type=int, default=24, help="greedy continuation prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "text_quality.json")
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="only the compact token table rows, merged into the existing results",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="only the clinic adapter's behaviour rows, merged into the existing results",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="VARIANT",
        help="measure only these variants (perplexity rows and adapter rows, by name) and merge them "
        "into the existing results, keeping the other rows",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    only = args.only

    base = import_smollm2(args.engine_dir)
    if args.adapter_only:
        result = json.loads(args.out.read_text())
        result["adapter"] = merged_rows(result["adapter"], adapter_behaviour(args.engine_dir, only), only)
        write_json(args.out, result)
        for row in result["adapter"]:
            print(row)
        print(f"wrote {args.out.relative_to(REPO)}")
        return
    if args.tables_only:
        reference = load_engine(base, "cpu")
        ids = reference.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids[: args.max_tokens]
        result = json.loads(args.out.read_text())
        served = quantize_checkpoint(base, QuantRecipe(method="awq", group_size=32))
        result["token_tables"] = token_tables(served, ids, args)
        write_json(args.out, result)
        print_tables(result["token_tables"])
        print(f"wrote {args.out.relative_to(REPO)}")
        return
    recipes = {
        "RTN INT4 g128": QuantRecipe(method="rtn"),
        "AWQ INT4 g128": QuantRecipe(method="awq"),
        "AWQ INT4 g64": QuantRecipe(method="awq", group_size=64),
        "RTN INT4 g32": QuantRecipe(method="rtn", group_size=32),
        "AWQ INT4 g32": QuantRecipe(method="awq", group_size=32),
        # Zero points fixed at 8: the only INT4 form TensorRT takes (awq-int4-sym).
        "RTN INT4 g32 symmetric": QuantRecipe(method="rtn", group_size=32, symmetric=True),
        "AWQ INT4 g32 symmetric": QuantRecipe(method="awq", group_size=32, symmetric=True),
        # Mixed precision (models.qa.layers): the FFN at g128, attention kept float or at g32.
        "AWQ g128 FFN, attention float": QuantRecipe(method="awq", groups=(("*.self_attn.*", 0),)),
        "AWQ g128 FFN, attention g32": QuantRecipe(method="awq", groups=(("*.self_attn.*", 32),)),
    }
    variants = {"fp32 reference": base}
    variants.update(
        {name: quantize_checkpoint(base, recipe) for name, recipe in recipes.items() if not only or name in only}
    )
    reference = load_engine(base, "cpu")
    ids = reference.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids[: args.max_tokens]
    stride = len(ids) // args.prompts
    prompts = [ids[i * stride : i * stride + 48] for i in range(args.prompts)]
    ref_conts = continuations(reference, prompts, args.new_tokens)

    rows: list[dict[str, Any]] = []
    for name, path in variants.items():
        if only and name not in only:
            continue
        engine = reference if path == base else load_engine(path, "cpu", cpu_kernel=EXACT)
        t0 = time.perf_counter()
        ppl = engine_perplexity(engine, ids)
        conts = ref_conts if engine is reference else continuations(engine, prompts, args.new_tokens)
        manifest = json.loads((path / "manifest.json").read_text())
        rows.append(
            {
                "variant": name,
                "checkpoint": path.name,
                "int4_kernel": engine.int4_kernel,
                "weight_bytes": manifest["weight_bytes"],
                "perplexity": round(ppl, 4),
                **{k: round(v, 4) for k, v in agreement(ref_conts, conts).items()},
                "eval_seconds": round(time.perf_counter() - t0, 1),
                **engine_fields(engine),
            }
        )
    adapter_rows = adapter_behaviour(args.engine_dir, only)
    if only:  # the other rows, tables and settings stay as they were measured
        result = json.loads(args.out.read_text())
        result["rows"] = rows = merged_rows(result["rows"], rows, only)
        result["adapter"] = adapter_rows = merged_rows(result["adapter"], adapter_rows, only)
        write_json(args.out, result)
        print_rows(rows, adapter_rows)
        print(f"wrote {args.out.relative_to(REPO)}")
        return
    tables = token_tables(variants["AWQ INT4 g32"], ids, args)
    result = {
        "what": "SmolLM2-135M-Instruct (real weights): INT4 quality vs float reference",
        "adapter": adapter_rows,
        "eval_text": f"pydoc_data topics, eval split (disjoint from calibration), corpus {corpus_fingerprint()}",
        "eval_tokens": len(ids),
        "window": WINDOW,
        "greedy_prompts": args.prompts,
        "greedy_new_tokens": args.new_tokens,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
        "token_tables": tables,
    }
    write_json(args.out, result)
    print_rows(rows, adapter_rows)
    print_tables(tables)
    print(f"wrote {args.out.relative_to(REPO)}")


def merged_rows(old: list[dict[str, Any]], new: list[dict[str, Any]], only: Sequence[str]) -> list[dict[str, Any]]:
    """`old` with the variants in `only` replaced by (or, when absent, followed by) their
    rows in `new`, in `new`'s order among themselves."""
    fresh = {r["variant"]: r for r in new}
    kept = [fresh.pop(r["variant"], r) for r in old if r["variant"] not in only or r["variant"] in fresh]
    return kept + list(fresh.values())


def print_rows(rows: list[dict[str, Any]], adapter_rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':<30} {'weights MiB':>11} {'perplexity':>10} {'tok agree':>9} {'exact':>6} {'prefix':>7}")
    for r in rows:
        print(
            f"{r['variant']:<30} {r['weight_bytes'] / 2**20:>11.1f} {r['perplexity']:>10.3f} "
            f"{r['token_agreement']:>9.3f} {r['exact_match']:>6.2f} {r['mean_common_prefix']:>7.1f}"
        )
    print()
    print(f"{'adapter behaviour on held-out prompts':<40} {'cites':>6} {'plain':>6} {'declines':>8} {'all':>6}")
    for r in adapter_rows:
        print(f"{r['variant']:<40} {r['cite']:>6.2f} {r['plain']:>6.2f} {r['refuse']:>8.2f} {r['all']:>6.2f}")


if __name__ == "__main__":
    main()
