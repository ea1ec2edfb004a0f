#!/usr/bin/env python3
"""Write the documentation's benchmark tables from bench/results/*.json (never by hand).

Each table sits between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` on any page
(README.md, docs/**/*.md: bench/pages.py); a name may be rendered on several pages.
`--check` exits 1 if a page differs from what the results say (the tests run it).
It also draws the plots under docs/plots (bench/plots.py), and `--check` fails
where one was drawn from other results than today's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import pages, plots
from bench.common import CUDA_TEXT_TARGETS, REPO, RESULTS


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _provenance(*records: dict[str, Any]) -> list[str]:
    """A line under a table whose records (some or all) do not say what engine they ran:
    measured before the benchmarks built their text engines from the profile."""
    missing = [r for r in records if "engine_config" not in r]
    if not missing:
        return []
    what = "no engine configuration recorded"
    if len(missing) < len(records):
        names = "; ".join(str(r.get("variant") or r.get("name")) for r in missing)
        return ["", f"*Rows measured before the benchmarks built their text engines from the profile ({what}), "
                f"to be measured again: {names}.*"]  # fmt: skip
    return ["", f"*Measured before the benchmarks built their text engines from the profile ({what}): an engine "
            "assembled by hand, to be measured again.*"]  # fmt: skip


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _maybe(value: float | None, fmt: str) -> str:
    """A figure, or "not measured" where a row has none."""
    return "not measured" if value is None else format(value, fmt)


def text_quality(d: dict[str, Any]) -> str:
    lines = [
        f"Held-out text: {d['eval_tokens']} tokens of {d['eval_text']}; greedy agreement over "
        f"{d['greedy_prompts']} prompts x {d['greedy_new_tokens']} tokens (`bench/results/text_quality.json`).",
        "",
        "| variant | weights MiB | perplexity | token agreement | exact match | mean common prefix |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['variant']} | {r['weight_bytes'] / 2**20:.1f} | {r['perplexity']:.3f} | "
            f"{r['token_agreement']:.3f} | {r['exact_match']:.2f} | {r['mean_common_prefix']:.1f} |"
        )
    lines += _provenance(*d["rows"])
    if d.get("adapter"):
        lines += [
            "",
            "Clinic adapter on held-out prompts (share of answers that show the trained behaviour):",
            "",
            "| build | cites the document | plain context, no made-up citation | declines to diagnose "
            "| retrieved passages: cites the one that answers, or says none does | all |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in d["adapter"]:
            retrieve = f"{r['retrieve']:.2f}" if "retrieve" in r else "not measured"
            lines.append(
                f"| {r['variant']} | {r['cite']:.2f} | {r['plain']:.2f} | {r['refuse']:.2f} | {retrieve} "
                f"| {r['all']:.2f} |"
            )
    if d.get("token_tables"):
        lines += [
            "",
            "Compact token tables (`models.qa.embedding`) on the served AWQ INT4 g32 build, against its float table:",
            "",
            "| token table | MiB (16-bit table) | perplexity (float table) | token agreement | exact match |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in d["token_tables"]:
            lines.append(
                f"| {r['variant']} | {r['table_bytes'] / 2**20:.1f} ({r['float_table_bytes'] / 2**20:.1f}) | "
                f"{r['perplexity']:.3f} ({r['reference_perplexity']:.3f}) | {r['token_agreement']:.3f} | "
                f"{r['exact_match']:.2f} |"
            )
    return "\n".join(lines)


def text_cpu(d: dict[str, Any]) -> str:
    how = f"one run, the median of {d['repeats']} measurements of each row" if "repeats" in d else "one run"
    lines = [
        f"{d['model']}, {d['threads']} threads, {d['prompt_tokens']}-token prompt, {d['new_tokens']} new tokens, "
        f"{how} (`bench/results/text_cpu.json`).",
        "",
        "| decoder | tok/s | vs llama.cpp | exact agreement | engine |",
        "|---|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | |")
            continue
        vs = f"{r['vs_llamacpp']:.2f}x" if "vs_llamacpp" in r else "-"
        exact = f"{r['exact_agreement']:.2f}" if "exact_agreement" in r else "-"
        cfg = r.get("engine_config")
        engine = "-" if cfg is None else ("**served**: " if r.get("served") else "") + engine_summary(cfg)
        lines.append(f"| {r['name']} | {r['decode_tok_s']:.1f} | {vs} | {exact} | {engine} |")
    if "agreement" in d:
        agreement = d["agreement"].removeprefix("exact_agreement: ")
        lines += ["", f"Exact agreement: {agreement} (`bench/results/text_cpu.json`)."]
    if d.get("served_over_fastest") is not None:
        lines += ["", f"The served row decodes at {d['served_over_fastest']:.2f}x the fastest edge row."]
    edge_rows = [r for r in d["rows"] if "error" not in r and not r["name"].startswith("llama.cpp")]
    lines += _provenance(*edge_rows)
    kernels = sorted({str(r["int4_kernel"]) for r in edge_rows if r.get("int4_kernel")})
    if kernels and not any(r.get("served") for r in edge_rows):
        from bench.text_engines import served_cpu_kernel  # torch's import, only here

        lines += [
            "",
            f"*Its INT4 rows ran the `{', '.join(kernels)}` kernel, not the one the CPU profile serves "
            f"(`{served_cpu_kernel()}`): the served CPU engine is not in this table.*",
        ]
    prof = d.get("awq_step_profile", {})
    if "in_c_step_ms" in prof:
        lines += [
            "",
            f"Where the served decode step's {prof['step_ms']:.1f} ms go (torch profiler): "
            f"{prof['in_c_step_ms']:.1f} ms in the C step (every layer in one call), "
            + (
                f"{prof['in_c_products_ms']:.1f} ms in the head's INT4 product (our C kernel), "
                f"{prof['in_torch_ops_ms']:.1f} ms inside {prof['ops_per_step']:.0f} torch operator calls "
                "(embedding, final norm), "
                if "in_c_products_ms" in prof
                else f"{prof['in_torch_ops_ms']:.1f} ms inside {prof['ops_per_step']:.0f} torch operator calls "
                "(embedding, final norm, head), "
            )
            + f"{prof['python_share'] * 100:.0f}% in the Python around them; the same model's "
            f"step op by op: {prof['per_op_step_ms']:.1f} ms.",
        ]
    elif "step_ms" in prof:
        lines += [
            "",
            f"Where an AWQ INT4 decode step's {prof['step_ms']:.1f} ms go (torch profiler): "
            f"{prof['in_torch_ops_ms']:.1f} ms inside {prof['ops_per_step']:.0f} torch operator calls, "
            f"{prof['python_share'] * 100:.0f}% in the Python around them.",
        ]
    return "\n".join(lines)


def _num(r: dict[str, Any], key: str, fmt: str = ".1f", scale: float = 1.0) -> str:
    v = r.get(key)
    return "-" if v is None or v != v else f"{v * scale:{fmt}}"  # v != v: NaN, not measured


def _kernel_name(name: str) -> str:
    """A kernel's name as the profiler gives it, without its parameter list and
    namespace boilerplate: `gemv_kernel<__nv_bfloat16, 128, 4, 8>`."""
    short = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
    return short if len(short) <= 48 else short[:45] + "..."


def _cuda_rows(rows: list[dict[str, Any]], long: int, prompt: int) -> list[str]:
    lines = [
        f"| variant | decode tok/s | at {long} tokens | of roofline | TTFT ms ({prompt} tokens) | peak GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error'][:80]} | | | | |")
            continue
        name = f"**served**: {r['name']}" if r.get("served") else r["name"]
        lines.append(
            f"| {name} | {_num(r, 'decode_tok_s')} | {_num(r, 'decode_tok_s_4k')} | "
            f"{_num(r, 'roofline_fraction', '.0%')} | {_num(r, 'ttft_ms')} | {_num(r, 'peak_gib', '.2f')} |"
        )
    return lines


def _cuda_targets(d: dict[str, Any], vs: dict[str, Any]) -> str:
    """The served row against CUDA_TEXT_TARGETS, each said met or not."""
    t = CUDA_TEXT_TARGETS
    served = next(r for r in d["rows"] if r.get("name") == vs["row"])

    def said(ok: bool) -> str:
        return "met" if ok else "**not met**"

    return (
        f"Targets for the served row: decode {t['decode_vs_llamacpp']:.2f}x llama.cpp's "
        f"({said(vs['decode_512'] >= t['decode_vs_llamacpp'])}: {vs['decode_512']:.2f}x); "
        f"{t['roofline_fraction']:.0%} of the roofline "
        f"({said(served['roofline_fraction'] >= t['roofline_fraction'])}: {served['roofline_fraction']:.0%}); "
        f"time to first token at most {t['ttft_ms']:.0f} ms "
        f"({said(served['ttft_ms'] <= t['ttft_ms'])}: {served['ttft_ms']:.1f} ms); "
        f"peak memory at most {t['peak_vs_llamacpp']:.2f}x llama.cpp's "
        f"({said(vs['peak_memory'] <= t['peak_vs_llamacpp'])}: {vs['peak_memory']:.2f}x)."
    )


def text_cuda(d: dict[str, Any]) -> str:
    long = d.get("long_context_tokens", 4096)
    lines = [
        f"{d['device']}, {d['shape']}, batch 1, {d['prompt_tokens']}-token prompt, {d['new_tokens']} new tokens; "
        f"measured copy bandwidth {d['copy_bandwidth_gb_s']:.0f} GB/s; our rows capped at {d['memory_cap_gib']:g} GiB "
        f"(`bench/results/text_cuda.json`). Peak memory is what each holds for the model and its cache, GPU "
        "and host together (a Jetson's are the same DRAM): torch's allocator peak for ours, llama.cpp's own "
        "buffers (from its log) for it.",
        "",
        *_cuda_rows(d["rows"], long, d["prompt_tokens"]),
        *_provenance(*[r for r in d["rows"] if r.get("name", "").startswith("edge")]),
    ]
    peer = d.get("llamacpp")
    vs = (peer or {}).get("vs") or {}
    if vs:
        assert peer is not None
        lines += [
            "",
            f"llama.cpp ran in the same run on the same GPU: `{peer['command']}` (built from the source in "
            f"{peer['source']}, on a random Q4_0 GGUF of the same shape; its decode rows start from an empty "
            f"cache, ours after the {d['prompt_tokens']}-token prompt). {vs['row']} against it: decode "
            f"**{vs['decode_512']:.2f}x** at the short context and **{vs['decode_4096']:.2f}x** at {long} tokens, "
            f"time to first token {vs['ttft_512']:.2f}x as fast, peak memory {vs['peak_memory']:.2f}x its own.",
        ]
        lines += ["", _cuda_targets(d, vs)]
    for r in d["rows"]:
        vs_triton = r.get("vs_triton")
        if vs_triton:
            lines += [
                "",
                f"The `{r['variant']}` row is a Jetson's text path on this GPU (`bench/jetson_proxy.py`): Triton "
                f"hidden from the process, our CUDA kernels built as {r.get('cuda_arch')} (the Jetson profile's "
                f"engine otherwise), against the Triton path on the same checkpoint in the same run: decode "
                f"**{vs_triton['decode_512']:.2f}x** at the short context and **{vs_triton['decode_4096']:.2f}x** at "
                f"{long} tokens, time to first token {vs_triton['ttft']:.2f}x as long (targets: at least 0.95x, at "
                f"most 1.1x; decode {_met(min(vs_triton['decode_512'], vs_triton['decode_4096']) >= 0.95)}, time to "
                f"first token {_met(vs_triton['ttft'] <= 1.1)}).",
            ]
            agree = r.get("real_model_agreement")
            if agree:
                lines[-1] += (
                    f" Greedy answers on {agree['model']}, through both paths: {agree['exact_match']:.0%} of "
                    f"{agree['prompts']} held-out prompts answered the same (up to {agree['tokens']} tokens each), "
                    f"{agree['token_agreement']:.1%} of tokens (target: at least 95% of prompts; "
                    f"{_met(agree['exact_match'] >= 0.95)})"
                    + (
                        ", measured in an earlier run than the speeds above, with the kernels as they were then."
                        if agree.get("earlier_run")
                        else "."
                    )
                )
    for r in d["rows"]:
        batched = r.get("batched")
        if batched:
            lines += [
                "",
                f"{r['name']}, continuous batching (the serving batcher, graphs replayed per step): "
                + ", ".join(
                    f"{b['sequences']} sequence{'s' if b['sequences'] != 1 else ''} "
                    f"{b['aggregate_tok_s']:.0f} tok/s together "
                    f"({b['decode_aggregate_tok_s']:.0f} tok/s in decode steps)"
                    for b in batched
                )
                + ".",
            ]
        phases = r.get("memory_phases")
        if phases and batched:
            lines += [
                "",
                f"{r['name']}, memory by phase (the allocator's peak in each, GiB; held: allocated before the first): "
                + ", ".join(
                    f"{name.replace('_', ' ')} {p['peak_gib' if 'peak_gib' in p else 'allocated_gib']:.2f}"
                    for name, p in phases.items()
                )
                + ".",
            ]
        prof = r.get("graph_profile")
        if prof and "step_span_ms" in prof:
            matrices = ", ".join(
                f"{name} {g['us']:.1f} us ({g['gb_s']:.0f} GB/s)" for name, g in prof["gemv_by_matrix"].items()
            )
            top = list(prof["kernels"].items())[:6]
            lines += [
                "",
                f"{r['name']}, inside the captured step (the GPU's own kernel records over {prof['steps']} replays): "
                f"a step spans "
                f"{prof['step_span_ms']:.2f} ms, {prof['kernels_per_step']} kernels, "
                f"busy {prof['kernel_busy_ms']:.2f} ms "
                f"and idle {prof['gaps_ms']:.2f} ms between kernels. The INT4 matrix-vector products take "
                f"{prof['gemv_ms']:.2f} ms, streaming at {_num(prof, 'gemv_bandwidth_fraction', '.0%')} of the copy "
                f"bandwidth: {matrices}. Per step by kernel: "
                + ", ".join(f"`{_kernel_name(name)}` {k['us_per_step']:.0f} us" for name, k in top)
                + ".",
            ]
    k = d.get("kernels", {}).get("per_token_linear_ms")
    if k:
        lines += [
            "",
            "Each INT4 kernel launched alone outside a graph on each of the model's matrix shapes (launch and "
            "zeroing included), summed per token: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in k.items()) + ".",
        ]
    return "\n".join(lines)


def gemv_sweep_cuda(d: dict[str, Any]) -> str:
    lines = [
        f"{d['device']}, `bench/sweep_gemv.py`: each INT4 matrix kind of the 8B step, {d['copies']} distinct "
        "weights of it in one CUDA graph (the lm_head alone), the tuner's choice against every configuration "
        "of a wider space, each checked against the float product first (`bench/results/gemv_sweep_cuda.json`).",
        "",
        "| matrix | tuned us | tuned GB/s | best us | best GB/s | best (rows, words, split, warps, stages) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for kind, e in d["shapes"].items():
        best = e.get("best")
        tuned = e["tuned"]
        if best is None:
            lines.append(f"| {kind} | {tuned['us']:.1f} | {tuned['gb_s']:.0f} | not swept | | |")
            continue
        config = ", ".join(str(best[k]) for k in ("BLOCK_N", "BLOCK_W", "SPLIT_K", "num_warps", "num_stages"))
        lines.append(
            f"| {kind} | {tuned['us']:.1f} | {tuned['gb_s']:.0f} | {best['us']:.1f} | {best['gb_s']:.0f} | {config} |"
        )
    return "\n".join(lines)


def _where(device: str) -> str:
    return {"cpu": "the CPU", "cuda": "a GPU"}.get(device, device)


def vision_cpu(d: dict[str, Any]) -> str:
    acc = d["accuracy"]
    lines = [
        f"Held-out test split: {acc['test_images']} generated images, 5 classes (`bench/results/vision_cpu.json`).",
        "",
        "| model | test accuracy | parameters | training images | training time |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in acc["rows"]:
        params = f"{r['parameters'] / 1e6:.2f}M" if "parameters" in r else "-"
        train = f"{r['train_seconds'] / 60:.1f} min on {_where(r['trained_on'])}" if "train_seconds" in r else "-"
        lines.append(f"| {r['model']} | {r['test_accuracy'] * 100:.1f}% | {params} | {r['train_images']:,} | {train} |")
    for name in acc.get("not_built", []):
        lines.append(f"| {name} | not built | | | |")
    speed = d["speed"]
    batches = list(speed["images_per_s"]["student"])
    lines += [
        "",
        f"onnxruntime on {d['threads']} CPU threads, images/s (same run):",
        "",
        "| model | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    for name, rates in speed["images_per_s"].items():
        lines.append(f"| {name} | " + " | ".join(f"{rates[b]:.1f}" for b in batches) + " |")
    ratio = speed["student_vs_teacher"]
    lines.append("| student / teacher | " + " | ".join(f"{ratio[b]:.1f}x" for b in batches) + " |")
    ocr = d["ocr"]
    lines += [
        "",
        f"OCR (detection, angle, recognition) on the sample labels: {ocr['lines_per_s']:.1f} lines/s "
        f"({ocr['images_per_s']:.1f} label images/s).",
    ]
    return "\n".join(lines)


def vision_cuda(d: dict[str, Any]) -> str:
    rates = d["images_per_s"]
    batches = list(next(iter(rates.values())))
    lines = [
        f"{d['device']}, torch {d['torch']}, the student (same weights in both rows; class probabilities "
        f"differ by at most {d['class_prob_max_abs_diff']:.1e}) (`bench/results/vision_cuda.json`).",
        "",
        "| path | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    for name, row in rates.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[b]:.0f}" for b in batches) + " |")
    ratio = d["optimised_vs_eager"]
    lines.append("| optimised / eager | " + " | ".join(f"{ratio[b]:.1f}x" for b in batches) + " |")
    return "\n".join(lines)


VISION_DATA_COLUMNS = {
    "distilled": "distilled",
    "distilled_stream_head": "distilled, stream-trained head",
    "features": "features only (no soft labels)",
    "plain": "no distillation",
}


def vision_data(d: dict[str, Any]) -> str:
    variants = [v for v in VISION_DATA_COLUMNS if any(r["variant"] == v for r in d["rows"])]
    heads = d["teacher_heads"]
    lines = [
        f"{d['device']}, torch {d['torch']}, batch {d['batch']}; every student at a length trained on the same "
        "images (`bench/results/vision_data.json`). Test accuracy on "
        + " and on ".join(f"{n:,} held-out images" for n in d["test_images"].values())
        + " (`a / b`). Teacher linear probe: "
        + "; ".join(
            f"{'stored' if name == 'stored' else 'stream-trained'} head ({h['train_images']:,} training images) "
            + " / ".join(f"{h[f'{t}_accuracy'] * 100:.1f}%" for t in d["test_images"])
            for name, h in heads.items()
        )
        + ".",
        "",
        "| training images | " + " | ".join(VISION_DATA_COLUMNS[v] for v in variants) + " | distilled - none |",
        "|---:|" + "---:|" * (len(variants) + 1),
    ]
    for images in sorted({r["images"] for r in d["rows"]}):
        by = {r["variant"]: r for r in d["rows"] if r["images"] == images}
        cells = [" / ".join(f"{by[v][f'{t}_accuracy'] * 100:.1f}%" for t in d["test_images"]) for v in variants]
        gain = " / ".join(
            f"{(by['distilled'][f'{t}_accuracy'] - by['plain'][f'{t}_accuracy']) * 100:+.1f}" for t in d["test_images"]
        )
        lines.append(f"| {images:,} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(lines)


def scheduler(d: dict[str, Any], source: str) -> str:
    load = d["load"]
    gib = 2**30
    lines = [
        f"{d['device']}, torch {d['torch']}; {load['cameras']} cameras, bursts of {load['burst']} inspect jobs "
        f"every ~{load['period_s']:g} s each, deadline {load['deadline_ms']} ms; Q&A stream: one question every "
        f"{load['qa_every_s']:g} s, {load['qa_new_tokens']} new tokens; {load['seconds']:g} s per run"
        + (f"; vision: {d['student']}" if "student" in d else "")
        + f" (`{source}`).",
        "",
        "| run | task | jobs | p50 ms | p99 ms | deadline misses | jobs/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run, label in (("alone", "cameras alone"), ("with_qa", "cameras + Q&A")):
        for task, t in d[run]["tasks"].items():
            lines.append(
                f"| {label} | {task} | {t['jobs']} | {t['p50_ms']:.0f} | {t['p99_ms']:.0f} | {t['missed']} | "
                f"{t['per_s']:.1f} |"
            )
    ips = d["vision_images_per_s"]
    by_batch = ", ".join(f"batch {b} {v:.0f}" for b, v in ips.items())
    lines += [
        "",
        f"- inspect p99 with the Q&A stream / alone: **{d['inspect_p99_ratio']:.2f}x** (target: at most 2x)",
        f"- vision images/s (decode-free, preprocessing included): {by_batch}; best / batch 1: "
        f"**{d['vision_best_over_batch1']:.1f}x** (target: at least 3x)",
        f"- memory: ledger peak {d['ledger_peak_bytes'] / gib:.2f} GiB, process peak "
        f"{d['process_peak_bytes'] / gib:.2f} GiB, budget {d['budget_bytes'] / gib:.0f} GiB; both branches "
        f"resident ({', '.join(f'{k} {v / gib:.2f} GiB' for k, v in d['resident_models'].items())}), KV pool "
        f"{d['kv_pool_tokens']} tokens ({d['kv_pool_bytes'] / gib:.2f} GiB); evictions {d['evictions']}; "
        f"text sequences paused {d['with_qa']['paused']}",
        *_provenance(d),
    ]
    return "\n".join(lines)


def engine_summary(cfg: dict[str, Any]) -> str:
    """A text engine's resolved configuration in a line (TextEngine.config), or a peer's
    (its `engine` named: llama.cpp, transformers)."""
    if "engine" in cfg:
        return f"{cfg['engine']}: " + ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "engine")
    parts = [
        f"{cfg['device']}, {cfg['dtype']}, {cfg['kernel']} INT4 kernel, group {cfg['group_size']}",
        f"{cfg['embedding']} token table, {cfg['kv_dtype']} KV",
        "fused step" if cfg["fused_step"] else "per-op step",
        "norms folded" if cfg["fold_norms"] else "norms kept",
        "CUDA graphs" if cfg["cuda_graphs"] else "no CUDA graphs",
    ]
    if cfg.get("threads"):
        parts.append(f"{cfg['threads']} thread{'s' if cfg['threads'] > 1 else ''}")
    origin = cfg.get("origin") or {}
    changed = ", ".join(f"{k}" for k in (origin.get("changed") or {}))
    where = f"profile {origin.get('profile')}" + (f", changed: {changed}" if changed else "") if origin else ""
    return "; ".join(parts) + (f" ({where})" if where else "")


def _mixed_runs(d: dict[str, Any]) -> str:
    runs = d.get("with_qa_runs")
    if not runs:
        return ""
    each = ", ".join(f"{ms:.0f}" for ms in runs)
    return f"; the median of {len(runs)} runs of the mixed load, whose inspect p99s were {each} ms"


def daemon(d: dict[str, Any], source: str) -> str:
    load = d["load"]
    gib = 2**30
    lines = [
        f"{d['device']}; {d['models']}; `edgectl serve` as a process, a real Mosquitto, an outside MQTT v5 client. "
        f"{load['cameras']} cameras, bursts of {load['burst']} inspect jobs every ~{load['period_s']:g} s each, "
        f"deadline {load['deadline_ms']} ms; Q&A stream: one question every {load['qa_every_s']:g} s, "
        f"{load['qa_new_tokens']} new tokens; {load['seconds']:g} s per run; latency as the requester sees it, "
        f"publish to result (`{source}`).",
        "",
        "| run | task | jobs | p50 ms | p99 ms | daemon p99 ms | deadline misses | jobs/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, label in (("alone", "cameras alone"), ("with_qa", "cameras + Q&A")):
        for task, t in d[run]["tasks"].items():
            lines.append(
                f"| {label} | {task} | {t['jobs']} | {t['p50_ms']:.0f} | {t['p99_ms']:.0f} | {t['daemon_p99_ms']:.0f} "
                f"| {t['missed']} | {t['per_s']:.1f} |"
            )
    solo = d["solo"]
    models = ", ".join(
        f"{m['name']} {m['memory_bytes'] / gib:.2f} GiB counted ({m['device_bytes'] / gib:.2f} GiB device, "
        f"{m['host_bytes'] / gib:.2f} GiB host)"
        for m in d["models_in_status"]
    )
    lines += [
        "",
        f"- Q&A decode through the daemon (questions one at a time, {solo['prompt_tokens']}-token prompts, "
        f"{solo['completion_tokens']:.0f} new tokens): {d['decode_tok_s_daemon']:.1f} tok/s; the bare decode loop "
        f"on the same checkpoint in the same run ({d['kernel_loop']}): {d['decode_tok_s_kernel']:.1f} tok/s: "
        f"**{d['decode_daemon_over_kernel']:.2f}x** (target: at least {0.95 if 'engine_config' in d else 0.9}x)",
        f"- inspect p99 with the Q&A stream / alone: **{d['camera_p99_ratio']:.2f}x** (target: at most 2x)"
        + _mixed_runs(d),
        f"- memory ({d['memory_scope']}): process peak {d['process_peak_bytes'] / gib:.2f} GiB, ledger peak "
        f"{d['ledger_peak_bytes'] / gib:.2f} GiB (**{d['ledger_over_process_peak']:.2f}** of the measured peak), "
        f"budget {d['budget_bytes'] / gib:.0f} GiB; at ready: {models}; KV pool {d['kv']['capacity_tokens']} "
        f"tokens ({d['kv']['capacity_bytes'] / gib:.2f} GiB)",
        f"- start to ready: {d['daemon_start_s']:.0f} s",
    ]
    if "engine_config" in d:
        served = "the served configuration" if d["served"] else "**not** the served configuration"
        same = "the same" if d["same_engine"] else "**not** the same"
        lines.append(
            f"- text engine ({served}; the loop's {same}): {engine_summary(d['engine_config'])}; the run's "
            f"changes to the shipped profile: {', '.join(d['profile']['changed'])}"
        )
    else:
        lines.append("- text engine: assembled by the benchmark, before the engine recorded its configuration")
    return "\n".join(lines)


def first_start(d: dict[str, Any]) -> str:
    met = "met" if d["first_start_s"] <= d["target_s"] else "**not met**"
    lines = [
        f"`{d['profile']}` with an empty engine directory, {d['cpus']} CPUs ({d['machine']}), a real Mosquitto, "
        "the first answers from an outside client (`bench/results/first_start.json`).",
        "",
        "| stage | seconds |",
        "|---|---:|",
        *[f"| {name} | {s:.0f} |" for name, s in d["stages_s"].items()],
        f"| start to ready | {d['first_start_s']:.0f} |",
        *[f"| first {task} answer | {s:.0f} |" for task, s in d["first_answer_s"].items()],
        "",
        f"- first start to ready: **{d['first_start_s'] / 60:.1f} min** (target: at most "
        f"{d['target_s'] / 60:.0f} min, {met})",
    ]
    return "\n".join(lines)


def build_memory(d: dict[str, Any]) -> str:
    params = d["parameters"] / 1e9
    threads = sorted({r["threads"] for r in d["rows"]})
    lines = [
        f"`edgectl build` of a {d['shape_name']}-shape model with random weights ({params:.1f}B parameters), "
        f"{d['quantization']}, adapter {d['adapter']}, each source built in a child process on {d['cpus']} CPUs "
        f"({d['machine']}, {'/'.join(map(str, threads))} threads, torch {d['torch']}): its peak resident memory "
        "(the kernel's high-water mark, file-backed pages included) and its wall time, hashing the source "
        "included (`bench/results/build_memory.json`).",
        "",
        "| source | on disk GiB | peak RSS GiB | limit GiB | within | minutes | per layer s |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    missing = [s for s in ("safetensors", "gguf") if s not in {r["source"] for r in d["rows"]}]
    if missing:
        lines[1:1] = [
            "",
            f"**Not measured at this shape yet:** the {' and '.join(missing)} source "
            f"(`python -m bench.build_memory --sources {','.join(missing)}` adds its row to these).",
        ]
    if d["shape_name"] != "llama3-8b":
        lines[1:1] = [
            "",
            f"**Not the whole 8B build:** the `{d['shape_name']}` shape has the 8B model's layers, token table "
            "and head but fewer layers, so its peak is the 8B build's per layer, not over all of them; the 8B "
            "target (at most 12 GiB for the whole build) is not shown met until `python -m bench.build_memory` "
            "runs the full shape.",
        ]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| {r['source_format']} | {r['source_bytes'] / 2**30:.1f} | failed (exit {r['exit_code']}) "
                         "| | | | |")  # fmt: skip
            continue
        per_layer = r.get("layer_seconds", {}).get("mean")
        lines.append(
            f"| {r['source_format']} | {r['source_bytes'] / 2**30:.1f} | {r['peak_rss_bytes'] / 2**30:.2f} "
            f"| {d['limit_bytes'] / 2**30:.0f} | {'yes' if r['within_limit'] else '**no**'} "
            f"| {r['seconds'] / 60:.1f} | {_maybe(per_layer, '.1f')} |"
        )
    return "\n".join(lines)


def verify(d: dict[str, Any], source: str) -> str:
    where = d["gpu"] or f"CPU only ({d['machine']})"
    models = sorted({c["model"] for c in d["checks"]} | {s["model"] for s in d["skipped"]})
    profile = f" with profile `{d['profile']}`" if d.get("profile") else ""
    lines = [
        f"`edgectl verify` on {where}, torch {d['torch']}{profile} (`{source}`): each model the profile "
        f"serves ({', '.join(models)}) through each backend here, on the same inputs, against its reference.",
        "",
        "| model | backend | reference | max abs diff | cosine | top-1 agreement | within tolerance |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for c in d["checks"]:
        lines.append(
            f"| {c['model']} | {c['backend']} | {c['reference']} | {c['max_abs_diff']:.2e} | {c['cosine']:.6f} | "
            f"{c['agreement']:.3f} | {'yes' if c['ok'] else '**no**'} |"
        )
    if d["skipped"]:
        skipped = sorted({f"{s['backend']} ({s['why']})" for s in d["skipped"]})
        lines += ["", "Not run there: " + "; ".join(skipped) + "."]
    return "\n".join(lines)


def kv(d: dict[str, Any]) -> str:
    pool = d["pool"]
    lines = [
        f"{d['what']}; {d['eval_tokens']} held-out tokens ({d['eval_text']}) read in chunks of {d['chunk']} "
        f"within windows of {d['context']}, {d['greedy_prompts']} greedy continuations of "
        f"{d['greedy_new_tokens']} tokens; {d['machine']}, torch {d['torch']} (`bench/results/kv.json`). "
        f"{d['serving'][0].upper()}{d['serving'][1:]}. Capacity: the tokens the {pool['profile']} profile's KV "
        f"pool ({pool['rows']} rows of {pool['row_tokens']} float16 tokens, {pool['bytes'] / 2**20:.0f} MiB) "
        "holds in each format, its rows as long as fit, and the same for one 4096-token row, counted from the "
        "caches as allocated (codes, scales, zero points, the float window and first tokens). Decode: tok/s "
        "at 4K context in the serving batcher on CUDA, where measured.",
        "",
        "| KV format | served | perplexity | Δ vs float | greedy agreement | bytes per token | capacity "
        "| capacity, 4K row | decode tok/s at 4K |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        speed = f"{r['decode_tok_s_4k']:.1f} ({r['decode_ratio_4k']:.2f}x)" if "decode_tok_s_4k" in r else ""
        lines.append(
            f"| {r['name']} | {'`' + r['kv_dtype'] + '`' if r.get('shipped') else 'compared'} "
            f"| {r['perplexity']:.4f} | {r['ppl_delta_pct']:+.3f}% | {_maybe(r['greedy_agreement'], '.3f')} "
            f"| {r['bytes_per_token']:.0f} | {r['capacity_ratio']:.2f}x | {r['capacity_ratio_4k']:.2f}x | {speed} |"
        )
    lines += _provenance(*[r for r in d["rows"] if r.get("shipped")])
    shipped = {r["kv_dtype"]: r for r in d["rows"] if r.get("shipped")}
    int8, int4 = shipped.get("int8"), shipped.get("int4")
    speed8 = int8 is not None and int8.get("decode_ratio_4k", 0.0) >= 1.0
    quality8 = int8 is not None and int8["ppl_delta_pct"] <= 0.1
    met4 = int4 is not None and int4["ppl_delta_pct"] <= 0.5 and int4["capacity_ratio"] >= 3.5

    def said(ok: bool) -> str:
        return "met" if ok else "**not met**"

    measured8 = "not measured" if int8 is None or "decode_tok_s_4k" not in int8 else said(speed8)
    lines += [
        "",
        f"Against the goals: int8 at Δppl ≤ 0.1%: {said(quality8)}; int8 no slower than float16 KV at 4K: "
        f"{measured8}; int4 at ≥ 3.5x capacity and Δppl ≤ 0.5%: {said(met4)}.",
    ]
    cuda = d.get("cuda_decode")
    if cuda:
        lines += [
            "",
            f"Decode on CUDA: {cuda['model']}, {cuda['kernel']} GEMV, one sequence after {cuda['context']} prompt "
            f"tokens, {cuda['new_tokens']} tokens a run, the median of five timed rounds, the formats taking "
            f"turns, each KV format in the same run on {cuda['gpu']} (torch {cuda['torch']}).",
        ]
    proxy = d.get("jetson_proxy")
    if proxy:
        by_dtype = {r["kv_dtype"]: r for r in proxy["rows"]}
        lines += [
            "",
            f"A Jetson's KV formats on {proxy['device']} (`bench/jetson_proxy.py --kv-out`): Triton hidden from the "
            f"process, our CUDA kernels built as {proxy['cuda_arch']} (edge/text/ops/cuda/kv_ops.cu for int8 and "
            f"int4), the Jetson profile's engine, the same 8B shape, at {proxy['context']} tokens of context: "
            + ", ".join(
                f"{dtype} {by_dtype[dtype]['decode_tok_s_4k']:.0f} tok/s ({by_dtype[dtype]['vs_float16_kv']:.2f}x)"
                for dtype in ("float16", "int8", "int4")
                if dtype in by_dtype
            )
            + f" (target: int8 at least 0.98x float16 KV: {_met(proxy['int8_over_float16'] >= 0.98)}).",
        ]
    attention = d.get("cuda_attention")
    if attention:
        rope = attention["rope_write_us"]
        lines += [
            "",
            f"Decode attention alone on {attention['gpu']}: one layer of the 8B shape, one sequence, split "
            "kernel and merge in CUDA graphs, the fastest of three rounds with the formats taking turns (random "
            "codes: speed only). The rotary-and-write kernel before it: "
            f"{rope['rope float16']:.2f} us float16, {rope['rope int8']:.2f} us int8, and "
            f"{rope['rope int8, block coded']:.2f} us int8 on the step in 64 that codes a key block.",
            "",
            "| context | float16 us | int8 us (speed vs float16) | int4 us (speed vs float16) |",
            "|---:|---:|---:|---:|",
        ]
        for r in attention["rows"]:
            lines.append(
                f"| {r['context']} | {r['float16_us']:.2f} | {r['int8_us']:.2f} ({r['int8_speed_ratio']:.2f}x) "
                f"| {r['int4_us']:.2f} ({r['int4_speed_ratio']:.2f}x) |"
            )
    lines += [
        "",
        f"Lossless coding of the float16 cache of {d['codec_tokens']} tokens of the same text "
        f"({d['kv_bytes'] / 2**20:.1f} MiB, token-major rows as an offloaded sequence is written), each checked "
        "to give back every byte:",
        "",
        "| codec | ratio | compress MB/s | decompress MB/s |",
        "|---|---:|---:|---:|",
        f"| {d['seed_claim']['codec']}, as claimed (not measured) | {d['seed_claim']['ratio']:.1f}x | | |",
    ]
    for c in d["codecs"]:
        lines.append(f"| {c['name']} | {c['ratio']:.3f}x | {c['compress_mb_s']:.0f} | {c['decompress_mb_s']:.0f} |")
    offloads = (
        ("CPU, SmolLM2 (real weights)", d.get("offload")),
        ("CUDA, 8B shape (random weights: the lz4 ratio is not real KV's)", (cuda or {}).get("offload")),
    )
    for where, offload in offloads:
        rows = offload["rows"] if isinstance(offload, dict) else offload
        if not rows:
            continue
        lines += [
            "",
            f"Offload of a paused sequence's row ({where}; `models.qa.kv_offload`): saved to host memory or to a "
            "file (lz4 where it pays; the file read back from the page cache), restored, against prefilling it "
            "again; the daemon restores or recomputes by the rates it measures:",
            "",
            "| KV | tokens | row MiB | lz4 ratio | save ms (memory / file) | restore ms (memory / file) "
            "| prefill again ms | faster from memory / from a file |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            memory = "restore" if r["restore_memory_ms"] < r["recompute_ms"] else "recompute"
            disk = "restore" if r["restore_disk_ms"] < r["recompute_ms"] else "recompute"
            lines.append(
                f"| {r['kv_dtype']} | {r['tokens']} | {r['bytes'] / 2**20:.2f} | {r['lz4_ratio']:.2f}x "
                f"| {r['save_memory_ms']:.1f} / {r['save_disk_ms']:.1f} "
                f"| {r['restore_memory_ms']:.1f} / {r['restore_disk_ms']:.1f} | {r['recompute_ms']:.1f} "
                f"| {memory} / {disk} |"
            )
    found = [("CPU, SmolLM2", d.get("prefix_cache")), ("CUDA, 8B shape", (cuda or {}).get("prefix_cache"))]
    prefixes: list[tuple[str, dict[str, Any]]] = [(w, p) for w, p in found if p]
    if prefixes:
        lines += [
            "",
            "Prefix cache (`models.qa.prefix_cache_mib`): time to first token of prompts sharing a reference "
            "document, median of three rounds; the first prefills and keeps it (cold), the later ones prefill "
            "their question only (warm). The batcher keeps splitting prompts only while a hit measures at most "
            "half a whole prefill (and now and then splits a declined prompt all the same, to measure a hit again)"
            + "".join(
                f"; {where}, a hit measured dearer than that (the batcher's fitted costs below), so it stopped "
                "splitting after the first round and a warm prompt was prefilled whole"
                + (
                    ""
                    if p_.get("warmed")
                    else " (measured before the benchmark warmed its batchers up as the daemon does: the one chunk "
                    "after cached tokens it timed was the first that model ran)"
                )
                for where, p_ in prefixes
                if not p_.get("split", True)
            )
            + ":",
            "",
            "| where | document tokens | TTFT cold ms | TTFT warm ms | cold / warm | no prefix cache ms "
            "| hit ms (fixed + a token) / whole ms a token | still split |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for where, p_ in prefixes:
            rates = ""
            if p_.get("hit_ms_per_token") is not None:
                hit = f"{p_['hit_ms_per_token']:.3f}"
                if p_.get("hit_fixed_ms") is not None:  # the batcher's fitted cost: fixed + a token
                    hit = f"{p_['hit_fixed_ms']:.1f} + {hit}"
                rates = f"{hit} / {p_['whole_ms_per_token']:.3f}"
            lines.append(
                f"| {where} | {p_['document_tokens']} | {p_['ttft_cold_ms']:.1f} | {p_['ttft_warm_ms']:.1f} "
                f"| {p_['speedup']:.1f}x | {p_['ttft_uncached_ms']:.1f} | {rates} "
                f"| {'yes' if p_.get('split', True) else 'no'} |"
            )
    found = [("CPU, SmolLM2", d.get("chunked_prefill")), ("CUDA, 8B shape", (cuda or {}).get("chunked_prefill"))]
    chunked = [(w, c) for w, c in found if c]
    if chunked:
        first = chunked[0][1]
        lines += [
            "",
            f"Chunked prefill (`models.qa.prefill_chunk`, the serving batcher): {first['running']} sequences "
            f"decoding when a {first['prompt_tokens']}-token prompt joins them; the time between their tokens "
            "from its arrival to its first token, and how long it waited for that first token"
            + "".join(
                f" ({where}: measured before the benchmark warmed its batchers up as the daemon does)"
                for where, c in chunked
                if not c.get("warmed")
            )
            + ":",
            "",
            "| where | prefill | between tokens before, ms | p50 ms | p99 ms | longest ms "
            "| its first token after, ms |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for where, c in chunked:
            for r in c["rows"]:
                how = f"{r['prefill_chunk']} tokens a step" if r["prefill_chunk"] else "whole prompt at once"
                lines.append(
                    f"| {where} | {how} | {r['gap_before_ms']:.1f} | {r['gap_p50_ms']:.1f} | {r['gap_p99_ms']:.1f} "
                    f"| {r['gap_max_ms']:.1f} | {r['ttft_ms']:.1f} |"
                )
    return "\n".join(lines)


def rag(d: dict[str, Any]) -> str:
    a = d["answers"]
    h = d["hard"]
    goals = d["goals"]

    def met(value: float | None, goal: float, at_most: bool = False) -> str:
        if value is None:
            return "**not measured**"
        return "met" if (value <= goal if at_most else value >= goal) else "**not met**"

    def f(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    def row(name: str, key: str, goal: str = "", hard_goal: str = "") -> str:
        both = " / ".join(g for g in (goal, hard_goal) if g)
        return f"| {name} | {f(d[key])} | {f(h[key])} | {both} |"

    def goal(key: str, at_most: bool = False, prefix: str = "") -> str:
        value = d[key] if not prefix else h[key]
        target = goals[f"{prefix}{key}"]
        return f"{'≤' if at_most else '≥'} {target}: {met(value, target, at_most)}"

    hr = h["retrieval"]
    lines = [
        f"Two sets made for this project. The leaflets ({d['set']}): {d['documents']} documents, {d['chunks']} "
        f"chunks (clinic leaflets, device manuals, ward guides and procedure sheets, beside the Python manual's "
        f"topics), {d['questions']} questions worded apart from the passages. The near-duplicates ({h['set']}): "
        f"{hr['documents']} documents that differ only in their entity (ward codes one character apart, pump "
        f"models one digit apart) and its values, {hr['questions']} questions; held out from training and "
        f"tuning. Encoder {d['encoder']} on onnxruntime, index {d['index_library']} (exact up to {d['exact_max']} "
        f"chunks, HNSW beyond), {d['threads']} threads, {d['machine']} (`bench/results/rag.json`, "
        f"`bench/eval_rag.py`). Answers: the clinic text engine, greedy, {a['questions']} leaflet questions and "
        f"every near-duplicate question, each with its top {a['top_k']} passages (the profile's default "
        f"`models.qa.top_k`) as a `qa` job with a collection gets them, under the profile's default grounding "
        f"policy (`{d['grounding']}`): an answer is passed on only when its citations check out, and counts as "
        "abstained otherwise.",
        "",
        "| figure | leaflets | near-duplicates | goal (leaflets / near-duplicates) |",
        "|---|---:|---:|---|",
        f"| retrieval recall@1 | {d['recall_at_1']:.3f} | {hr['recall_at_1']:.3f} | |",
        f"| retrieval recall@5 | {d['recall_at_5']:.3f} | {hr['recall_at_5']:.3f} | {goal('recall_at_5')} |",
        row("answered accuracy (right among answered)", "answered_accuracy", goal("answered_accuracy"),
            goal("answered_accuracy", prefix="hard_")),
        row("wrong answers marked grounded (over all questions)", "wrong_grounded_rate",
            goal("wrong_grounded_rate", True), goal("wrong_grounded_rate", True, "hard_")),
        row("abstained", "abstain_rate"),
        row("right answers (over all questions)", "right_rate", "", goal("right_rate", prefix="hard_")),
        row("the model's answers right, before the check", "raw_accuracy"),
        f"| answers given as the passage's own sentence (`answer_source: passage`), over answered "
        f"| {f(a['from_passage'] / a['answered'] if a['answered'] else None)} "
        f"| {f(h['answers']['from_passage'] / h['answers']['answered'] if h['answers']['answered'] else None)} | |",
        row("supported precision (supported citations that are right)", "supported_precision",
            goal("supported_precision")),
        row("supported recall (right citations marked supported)", "supported_recall", goal("supported_recall")),
        f"| questions no document answers: abstained | {f(d['absent']['abstain_rate'])} "
        f"| {f(h['absent']['abstain_rate'])} | |",
        f"| search p50 / p95 at 10k chunks, ms | {d['search_p50_ms_10k']:.2f} / {d['search_p95_ms_10k']:.2f} | | |",
        f"| search p50 / p95 at 100k chunks, ms | {d['search_p50_ms_100k']:.2f} / {d['search_p95_ms_100k']:.2f} "
        f"| | p95 ≤ {goals['search_p95_ms_100k']:.0f}: "
        f"{met(d['search_p95_ms_100k'], goals['search_p95_ms_100k'], at_most=True)} |",
    ]  # fmt: skip
    t, ht = d["threshold"], h["threshold"]
    lines += [
        "",
        f"The abstention threshold (`models.qa.abstain_below` {t['abstain_below']}) against the best passage's "
        f"score: answerable questions under it {f(t['answerable_under'])} (leaflets) and "
        f"{f(ht['answerable_under'])} (near-duplicates), lowest {t['answerable_min']:.3f} and "
        f"{ht['answerable_min']:.3f}; questions about nothing clinical under it {f(t['off_topic_under'])} and "
        f"{f(ht['off_topic_under'])}, highest {t['off_topic_max']:.3f} and {ht['off_topic_max']:.3f}; questions "
        f"no document answers under it {f(t['absent_under'])} and "
        f"{f(ht['absent_under'])} (their median best score {f(t['absent_p50'])} and {f(ht['absent_p50'])}: "
        "they are near a passage about a similar entity, and the citation check, not the score, catches them).",
    ]
    if d.get("answers_by_top_k"):
        lines += [
            "",
            f"Leaflet answers by how many passages go into the prompt (the same questions; the profile's default "
            f"is top_k {d.get('default_top_k', a['top_k'])}):",
            "",
            "| top_k | answered accuracy | wrong grounded | abstained | right | right before the check |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["answers_by_top_k"]:
            lines.append(
                f"| {r['top_k']} | {f(r['answered_accuracy'])} | {r['wrong_grounded_rate']:.3f} "
                f"| {r['abstain_rate']:.3f} | {r['right_rate']:.3f} | {r['raw_accuracy']:.3f} |"
            )
    lines += [
        "",
        "Search per question at each size, both index kinds (the set's vectors and perturbed copies of them; "
        "recall of HNSW's top 5 against the exact scan's):",
        "",
        "| chunks | index | served at this size | p50 ms | p95 ms | built in s | recall@5 vs exact |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in d["search"]:
        recall = f"{r['recall_at_5_vs_exact']:.3f}" if "recall_at_5_vs_exact" in r else ""
        lines.append(
            f"| {r['chunks']} | {r['kind']} | {'yes' if r['product_choice'] else ''} | {r['p50_ms']:.2f} "
            f"| {r['p95_ms']:.2f} | {r['build_s']:.1f} | {recall} |"
        )
    return "\n".join(lines)


def aarch64(d: dict[str, Any]) -> str:
    host, arm = d["host"], d["arm64"]
    lines = [
        f"`edgectl docs add` of samples/leaflets and retrieval, by an {arm['machine']} Python under qemu-user "
        f"(Debian {d['debian']}, Python {arm['python']}, {arm['libc']}) beside the same run here ({host['machine']}, "
        f"Python {host['python']}) (`bench/results/aarch64.json`, `bench/check_aarch64.py`; emulated, so no "
        "speed is claimed):",
        "",
        f"| | {host['machine']} | {arm['machine']} (emulated) |",
        "|---|---|---|",
    ]
    for name, version in arm["versions"].items():
        lines.append(f"| {name} | {host['versions'][name]} | {version} |")
    h = d["hnsw"]
    lines += [
        f"| HNSW recall@10, {h['vectors']} seeded random unit vectors (a hard case; the set's are above) "
        f"| {d['hnsw_recall_at_10_host']:.3f} | {d['hnsw_recall_at_10_arm64']:.3f} |",
        "",
        f"The same chunk ids ({d['chunks']} chunks): {'yes' if d['chunk_ids_equal'] else '**no**'}; the same "
        f"passages first for each question: {'yes' if d['passages_equal'] else '**no**'}; embeddings within "
        f"{d['embedding_max_diff']:.1e}, scores within {d['score_max_diff']:.1e}. qemu-user shows a program the "
        "host's /proc/cpuinfo, which onnxruntime's CPU probe cannot parse on arm64 (it crashes on import), so the "
        "arm64 side sees an arm64 kernel's, of the AGX Orin's Cortex-A78AE cores.",
    ]
    return "\n".join(lines)


def headline(rag_result: dict[str, Any]) -> str:
    """The README's figures: GPU and CPU decode beside llama.cpp, the daemon's memory
    within its budget, grounded answers. Each says where it was measured and, where its engine
    was assembled by hand, that it is to be measured again."""
    lines: list[str] = []
    cuda = _load("text_cuda.json")
    if cuda:
        ours = next((r for r in cuda["rows"] if r.get("kernel") and "decode_tok_s" in r), None)
        peer = next((r for r in cuda["rows"] if r["name"].startswith("llama.cpp")), None)
        if ours and peer:
            stale = "" if "engine_config" in ours else (
                " Measured on an engine assembled by hand, before the benchmarks built the served configuration: "
                "to be measured again."
            )  # fmt: skip
            lines.append(
                f"- **Decode on a GPU**: {ours['decode_tok_s']:.0f} tok/s at batch 1 on the {cuda['device']}, "
                f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x llama.cpp Q4_0 in the same run, with "
                f"{ours['peak_gib']:.2f} GiB against its {peer['peak_gib']:.2f} GiB "
                f"(an 8B-shape INT4 model, random weights; `bench/results/text_cuda.json`).{stale}"
            )
    text_cpu = _load("text_cpu.json")
    if text_cpu:
        served = next((r for r in text_cpu["rows"] if r.get("served") and "decode_tok_s" in r), None)
        if served and "vs_llamacpp" in served:
            lines.append(
                f"- **Decode on a CPU**: {served['decode_tok_s']:.0f} tok/s on {text_cpu['threads']} "
                f"{text_cpu['machine']} threads, {served['vs_llamacpp']:.2f}x llama.cpp on the model's own GGUF "
                f"in the same run, greedy tokens {served.get('exact_agreement', float('nan')):.0%} those of the "
                f"exact quantized model "
                f"(SmolLM2-135M with the clinic adapter, AWQ INT4, as served; `bench/results/text_cpu.json`)."
            )
    cpu = _load("daemon_cpu.json")
    if cpu:
        lines.append(
            f"- **Within its budget**: the daemon on a CPU box ({cpu['device']}), both branches serving camera bursts "
            f"and questions through MQTT, peaked at {cpu['process_peak_bytes'] / 2**20:.0f} MiB of its "
            f"{cpu['budget_bytes'] / 2**30:.0f} GiB budget; its Q&A decodes at "
            f"{cpu['decode_daemon_over_kernel']:.2f}x the bare engine's rate (`bench/results/daemon_cpu.json`)."
        )
    d = rag_result
    lines.append(
        f"- **Grounded answers**: over {d['questions']} questions on the sample leaflets, "
        f"{d['abstain_rate']:.1%} abstain, {d['answered_accuracy']:.1%} of the others are right, and "
        f"{d['wrong_grounded_rate']:.1%} of all are wrong yet marked grounded (`bench/results/rag.json`)."
    )
    return "\n".join(lines)


def speculative(d: dict[str, Any]) -> str:
    """Speculative decoding against plain decoding of the same engine, in the same run."""
    lines = [
        f"Speculative decoding, measured on the {d['machine']} CPU with {d['threads']} threads: "
        "the engine the shipped profile builds"
        + (
            ""
            if d.get("served")
            else " with speculation on (the shipped profile leaves it off: not the served configuration)"
        )
        + " "
        f"({engine_summary(d['engine_config'])}) answering {d['questions']} retrieval questions of the leaflet set, "
        f"greedy, {d['new_tokens']} new tokens, with and without speculation in the same run "
        "(`bench/results/speculative.json`).",
        "",
        "| device | method | drafts taken | tokens a step | tok/s | without | speedup | same answers |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        taken = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        same = "yes" if r["identical_greedy"] else "**no**"
        lines.append(
            f"| {r['device']} | {r['method']} | {taken} | {r['tokens_per_step']:.2f} | {r['effective_tok_s']:.1f} "
            f"| {r['baseline_tok_s']:.1f} | {r['speedup']:.2f}x | {same} |"
        )
    cost = d.get("verify_cost")
    if cost:
        lines += [
            "",
            f"What verifying k drafts costs on the {cost['device']} ({cost['model']}; "
            f"{engine_summary(cost['engine_config'])}; after a {cost['context']}-token prompt): the batcher's "
            "verification call against one decode step as served. The last two columns are a **projection**, "
            "not a measurement: the tokens a verification would yield if each draft were taken at the CPU "
            "row's rate"
            + (f" ({cost['acceptance_rate']:.0%})" if cost.get("acceptance_rate") is not None else "")
            + ", and the decode speedup that would give there (`bench/results/speculative.json`, `verify_cost`).",
            "",
            "| k | verification ms | decode step ms | cost in steps | projected tokens | projected speedup |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in cost["rows"]:
            projected = (
                f"{r['projected_tokens_per_step']:.2f} | {r['projected_speedup']:.2f}x"
                if "projected_speedup" in r
                else "- | -"
            )
            lines.append(f"| {r['k']} | {r['verify_ms']:.2f} | {r['decode_ms']:.2f} | {r['ratio']:.2f} | {projected} |")
    return "\n".join(lines)


def structured(d: dict[str, Any]) -> str:
    """Constrained decoding per device beside unconstrained decoding of the same prompts in
    the same run, and the grammar engines compared on the model's tokenizer."""
    loads = [
        f"{r['device']}: the machine's load average was {r['load_average_1m']:.1f} on {r['cpus']} CPUs as the run ended"
        for r in d["rows"]
        if "load_average_1m" in r
    ]
    lines = [
        "Structured output: answers constrained to JSON schemas, each prompt answered greedily with its schema "
        "enforced and then unconstrained for as many tokens, on the same engine in the same run, "
        + ", ".join(f"{r['device']} {r.get('repeats', 1)} times" for r in d["rows"])
        + " in alternating order, the fastest of each counting; valid: answers that parse and validate against "
        "their schema; masking: the host's time computing and applying the masks "
        "(`bench/results/structured.json`)." + (" " + "; ".join(loads) + "." if loads else ""),
        "",
        "| device | engine | grammar engine | schemas / prompts | valid | ms a token | unconstrained | "
        "of it masking | largest compile |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        served = "" if r.get("served") else " (not the served configuration)"
        lines.append(
            f"| {r['device']} | {engine_summary(r['engine_config'])}{served} | {r['grammar_engine']} "
            f"| {r['schemas']} / {r['prompts']} | {r['valid_rate']:.0%} | {r['cost_per_token_ms']:.2f} ms "
            f"| {r['unconstrained_cost_per_token_ms']:.2f} ms | {r['mask_ms_per_token']:.3f} ms "
            f"| {r['compile_ms']:.1f} ms |"
        )
    if d.get("engines"):
        lines += [
            "",
            f"The grammar engines on the same schemas, SmolLM2's tokenizer, one valid instance's tokens each, on the "
            f"{d.get('engines_machine', '')} CPU: compile is one schema's first compile for the tokenizer, mask "
            "one next-token mask; correct: every valid token allowed and taken, and nothing after the object closed.",
            "",
            "| grammar engine | compile, largest | compile, mean | mask, mean | mask, p99 | correct |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for e in d["engines"]:
            lines.append(
                f"| {e['engine']} {e['version']} | {e['compile_ms_max']:.1f} ms | {e['compile_ms_mean']:.1f} ms "
                f"| {e['mask_ms_mean']:.3f} ms | {e['mask_ms_p99']:.3f} ms | {'yes' if e['correct'] else '**no**'} |"
            )
    return "\n".join(lines)


def models(d: dict[str, Any]) -> str:
    """The families against transformers in float, and the real model's INT4 against float."""
    real = [r for r in d["rows"] if r["weights"] != "random"]
    lines = [
        f"Our float import against transformers with the same weights, on the {d['machine']} CPU: the largest "
        "logit difference as a share of transformers' largest logit, over the first positions of a text prefilled in "
        "two chunks and decoded a token at a time as serving does, and the share of greedy tokens that are the same "
        "(`bench/results/models.json`).",
        "",
        "| family | source | weights | float logit error | positions | greedy tokens the same |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in d["rows"]:
        weights = "random" if r["weights"] == "random" else "Gemma 3 270M (real)"
        same = f"{r['greedy_agreement']:.3f} of {r['greedy_tokens'] * r.get('greedy_prompts', 1)}"
        lines.append(
            f"| {r['family']} | {r['source']} | {weights} | {r['float_logit_error']:.1e} | {r['positions']} | {same} |"
        )
    for r in real:
        lines += [
            "",
            f"{r['weights'].removeprefix('real: ')}: its {r['int4']} build (as `edgectl build` quantizes) against "
            "its float import, on "
            f"{r['eval_tokens']} held-out tokens ({r['eval_text']}), windows of {r['window']}, through the engine "
            f"the CPU profile builds ({engine_summary(r['engine_config'])}; `bench/results/models.json`).",
            "",
            "| build | perplexity | greedy tokens the same as float |",
            "|---|---:|---:|",
            f"| float (dequantized Q4_K_M) | {r['float_perplexity']:.3f} | 1.000 |",
            f"| {r['int4']} | {r['int4_perplexity']:.3f} | {r['int4_greedy_agreement']:.3f} |",
        ]
        if "kv_bytes" in r:
            lines += [
                "",
                f"Its float KV cache as that engine allocates it, {r['kv_rows']} rows of {r['kv_row_tokens']} tokens: "
                f"{r['kv_bytes'] / 2**20:.1f} MiB with the sliding layers' buffers of {r['kv_sliding_slots']} "
                f"positions, against {r['kv_bytes_every_position'] / 2**20:.1f} MiB with every position of every "
                f"layer held ({r['kv_bytes'] / r['kv_bytes_every_position']:.2f}x).",
            ]
        for dtype, q in r.get("kv_quantized", {}).items():
            lines += [
                "",
                f"Its {dtype} KV cache as that engine allocates it with `kv_dtype: {dtype}`, {q['kv_rows']} rows of "
                f"{q['kv_row_tokens']} tokens: {q['kv_bytes'] / 2**20:.1f} MiB with the sliding layers' codes in "
                f"circles of {q['kv_sliding_slots']} slots, against {q['kv_bytes_every_position'] / 2**20:.1f} MiB "
                f"with every position of every layer coded ({q['kv_bytes'] / q['kv_bytes_every_position']:.2f}x).",
            ]
    return "\n".join(lines)


def http(d: dict[str, Any]) -> str:
    """Short chats through the HTTP API beside the same jobs through MQTT, one daemon, one run."""
    lines = [
        f"Short chats on the {d['device']} CPU, the shipped CPU profile's engine "
        f"({engine_summary(d['engine_config'])}): "
        f"bursts of {d['burst']} requests ({d['question']!r}, greedy, {d['new_tokens']} new tokens) through each "
        f"path, {d['rounds']} rounds alternating, one daemon and broker"
        + (
            f"; the machine's load average {d['load_average'][0]:.1f} then {d['load_average'][1]:.1f} on "
            f"{d['cpus']} cores"
            if "load_average" in d
            else ""
        )
        + " (`bench/results/http.json`).",
        "",
        "| path | requests | requests/s | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for path, name in (("http", "HTTP (OpenAI API)"), ("mqtt", "MQTT v5")):
        r = d[path]
        lines.append(
            f"| {name} | {r['requests']} | {r['requests_per_s']:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
        )
    return "\n".join(lines)


def http_stack(d: dict[str, Any]) -> str:
    """The server libraries measured for the HTTP API."""
    lines = [
        f"A minimal server in each library answering JSON and an event stream, Python {d['python']} on "
        f"{d['machine']} (`bench/results/http_stack.json`).",
        "",
        "| library | versions | import ms | start to listening ms | RSS serving MiB |",
        "|---|---|---:|---:|---:|",
    ]
    for name, r in d["stacks"].items():
        versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
        lines.append(
            f"| {name} | {versions} | {r['import_ms']:.0f} | {r['start_to_listening_ms']:.0f} "
            f"| {r['serving_rss_mib']:.1f} |"
        )
    return "\n".join(lines)


def attention_kernels(d: dict[str, Any]) -> str:
    shape = d["shape"]
    lines = [
        f"Decode attention alone on the {d['device']} (our kernels built for `{d['cuda_arch']}`), one sequence, "
        f"{shape['heads']} query heads over {shape['kv_heads']} KV heads of {shape['head_dim']} channels, "
        f"{shape['layers']} layers' caches, each call in a CUDA graph (`bench/results/attention_kernels.json`): "
        "microseconds a layer, and Triton's time over ours (above 1: ours faster).",
        "",
        "| cache | context | ours (CUDA C) | Triton | Triton / ours | our splits x chunk | our kernel |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    theirs = {(r["kv_dtype"], r["context"]): r for r in d["rows"] if r["kernels"] == "triton"}
    tried = [r for r in d["rows"] if r["kernels"] == "cuda" and "spread" in r]
    for r in (r for r in d["rows"] if r["kernels"] == "cuda" and "spread" not in r):
        t = theirs.get((r["kv_dtype"], r["context"]))
        triton = f"{t['us_per_layer']:.2f}" if t else "-"
        ratio = f"{t['us_per_layer'] / r['us_per_layer']:.2f}x" if t else "-"
        lines.append(
            f"| {r['kv_dtype']} | {r['context']} | {r['us_per_layer']:.2f} | {triton} | {ratio} "
            f"| {r['splits']} x {r['chunk']} | {r.get('kernel', 'not recorded')} |"
        )
    if tried:
        lines += [
            "",
            "Our attention split for other numbers of blocks an SM (`--spreads`; the served rule's marked):",
            "",
            "| cache | context | blocks an SM | splits x chunk | microseconds a layer |",
            "|---|---:|---:|---|---:|",
        ]
        for r in tried:
            mark = " (served)" if r.get("served") else ""
            lines.append(
                f"| {r['kv_dtype']} | {r['context']} | {r['spread']}{mark} | {r['splits']} x {r['chunk']} "
                f"| {r['us_per_layer']:.2f} |"
            )
    return "\n".join(lines)


def sparse_attention(d: dict[str, Any]) -> str:
    """Top-k block attention against dense attention on one engine and one cache."""
    rows = d["rows"]
    block = rows[0]["block_tokens"] if rows else "-"
    kv = any("kv_dtype" in r for r in rows)
    lines = [
        f"Top-k block attention (`models.qa.sparse_attention`) against dense attention, on the {d['machine']} CPU "
        f"with {d['threads']} thread{'s' if d['threads'] > 1 else ''}: the engine the shipped profile builds with "
        "sparse attention on"
        + ("" if d.get("served") else " (the shipped profile leaves it off: not the served configuration)")
        + f" ({engine_summary(d['engine_config'])}), blocks of {block} tokens, selecting from position 0; "
        f"after each context {d['score_tokens']} held-out tokens ({d['eval_text']}) scored one decode step "
        f"each; passkey: a number hidden at {len(d['passkey_depths'])} depths of a prompt of the context's "
        f"length, {d['passkey_answer_tokens']} greedy tokens; attention: every layer's for one token, the step's "
        f"own code timed alone, the median of {d['attention_repeats']}; decode: the median step. Each method "
        "decodes in a cache of its own and the methods take turns step by step, so other work on the box slows "
        f"them alike (`bench/results/sparse_attention.json`). "
        f"The machine's load average was {d['load_average'][0]:.1f} as the run began and "
        f"{d['load_average'][1]:.1f} as it ended, on {d['cpus']} CPUs."
        + (" **A --quick smoke run, not a measurement.**" if d.get("quick") else ""),
        "",
        # A KV column where the rows name their cache (float16 and int8 measured alike).
        "| context |" + (" KV |" if kv else "") + " k | attends at most | attention µs | dense | decode tok/s "
        "| dense | speedup | perplexity Δ | passkey | dense passkey |",
        "|---:|" + ("---|" if kv else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context_tokens']} |"
            + (f" {r.get('kv_dtype', 'float16')} |" if kv else "")
            + f" {r['top_k_blocks']} | {r['attended_tokens']} | {r['attention_us']:.0f} "
            f"| {r['dense_attention_us']:.0f} | {r['decode_tok_s']:.1f} | {r['dense_decode_tok_s']:.1f} "
            f"| {r['decode_tok_s'] / r['dense_decode_tok_s']:.2f}x | {r['ppl_delta_pct']:+.2f}% "
            f"| {r['passkey_accuracy']:.0%} | {r['dense_passkey_accuracy']:.0%} |"
        )
    lines += _provenance(d)
    return "\n".join(lines)


def sparsity(d: dict[str, Any]) -> str:
    """Dense INT4, 2:4 one-shot and 2:4 with QAT of the served model, in one run; the 8B
    shape's speed rows where they were measured."""
    lines: list[str] = []
    for key, section in d.items():
        if key.startswith("smollm2_"):
            qat = section["qat"]
            rule = section["rules"][0]
            quant = "AWQ" if section["quantization"].startswith("awq") else "round-to-nearest"
            lines += [
                f"SmolLM2-135M-Instruct with the clinic adapter, on the {section['machine']} "
                f"{section['device'].upper()} with {section['threads']} threads (`bench/results/sparsity.json`): "
                f"every decoder projection pruned 2:4 by {rule['pruning']} (`{rule['match']}`), then {quant} INT4; "
                f"the QAT row trained {qat['steps']} steps of {qat['batch']} x {qat['seq_len']} tokens at lr "
                f"{qat['lr']:g} before the rounding. Perplexity on {section['eval_tokens']} held-out tokens "
                f"(float model {section['float_perplexity']:.2f}"
                + (
                    f"; the base model without the adapter {section['base_float_perplexity']:.2f}: the adapter "
                    "raises general text's perplexity and INT4 rounding keeps only part of its update, so the "
                    "rows are compared with each other"
                    if "base_float_perplexity" in section
                    else ""
                )
                + ") and greedy agreement with the float model "
                f"({section['greedy_prompts']} prompts x {section['greedy_new_tokens']} tokens) on the exact kernel; "
                f"adapter behaviours and retrieval answered accuracy ({section['rag_questions']} questions) and "
                "decode speed on the served engine"
                + (f" ({engine_summary(section['rows'][0]['engine_config'])})." if section["rows"] else "."),
                "",
                "| build | perplexity | token agreement | adapter | RAG answered | weight bytes | decode tok/s |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for r in section["rows"]:
                rag = "-" if r["rag_answered_accuracy"] is None else f"{r['rag_answered_accuracy']:.3f}"
                lines.append(
                    f"| {r['variant']} | {r['perplexity']:.2f} | {r['token_agreement']:.3f} | {r['adapter_all']:.3f} "
                    f"| {rag} | {r['weight_bytes'] / 1e6:.1f} MB | {r['decode_tok_s']:.1f} |"
                )
            recovered = section.get("qat_recovered")
            if recovered is not None:
                lines += ["", f"QAT won back {recovered:.0%} of the perplexity the one-shot pruning lost."]
            peaks = section.get("training_peaks") or {}
            if peaks:
                lines += [
                    "",
                    f"The training's peak memory ({peaks['recompute']['measured']}, {section['memory_steps']} steps "
                    "in a process of its own): "
                    + ", ".join(
                        f"{k.replace('_', ' ')} {v['peak_bytes'] / 2**30:.2f} GiB (after loading and pruning "
                        f"{v['peak_bytes_before_training'] / 2**30:.2f} GiB; {v['step_seconds']:.1f} s a step)"
                        for k, v in peaks.items()
                    )
                    + ".",
                ]
            if section.get("remaining"):
                lines += ["", "Not measured yet in this run: " + ", ".join(section["remaining"]) + "."]
        elif key.startswith("shape_"):
            lines += [
                "",
                f"{section['what']}, on {section['device'].upper()}:",
                "",
                "| build | weight bytes | decode tok/s |",
                "|---|---:|---:|",
            ]
            for r in section["rows"]:
                lines.append(f"| {r['variant']} | {r['weight_bytes'] / 1e9:.2f} GB | {r['decode_tok_s']:.1f} |")
    return "\n".join(lines).strip()


TABLES: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "http": ("http.json", http),
    "http_stack": ("http_stack.json", http_stack),
    "headline": ("rag.json", headline),
    "first_start": ("first_start.json", first_start),
    "build_memory": ("build_memory.json", build_memory),
    "daemon_cpu": ("daemon_cpu.json", lambda d: daemon(d, "bench/results/daemon_cpu.json")),
    "daemon_cuda": ("daemon_cuda.json", lambda d: daemon(d, "bench/results/daemon_cuda.json")),
    "scheduler_cpu": ("scheduler_cpu.json", lambda d: scheduler(d, "bench/results/scheduler_cpu.json")),
    "scheduler_cuda": ("scheduler_cuda.json", lambda d: scheduler(d, "bench/results/scheduler_cuda.json")),
    "text_quality": ("text_quality.json", text_quality),
    "text_cpu": ("text_cpu.json", text_cpu),
    "text_cuda": ("text_cuda.json", text_cuda),
    "kv": ("kv.json", kv),
    "attention_kernels": ("attention_kernels.json", attention_kernels),
    "speculative": ("speculative.json", speculative),
    "sparse_attention": ("sparse_attention.json", sparse_attention),
    "sparsity": ("sparsity.json", sparsity),
    "structured": ("structured.json", structured),
    "models": ("models.json", models),
    "rag": ("rag.json", rag),
    "aarch64": ("aarch64.json", aarch64),
    "gemv_sweep_cuda": ("gemv_sweep_cuda.json", gemv_sweep_cuda),
    "vision_cpu": ("vision_cpu.json", vision_cpu),
    "vision_cuda": ("vision_cuda.json", vision_cuda),
    "vision_data": ("vision_data.json", vision_data),
    "verify_cpu": ("verify_cpu.json", lambda d: verify(d, "bench/results/verify_cpu.json")),
    "verify_cuda": ("verify_cuda.json", lambda d: verify(d, "bench/results/verify_cuda.json")),
}


def profile_cuda(d: dict[str, Any] | None, images: list[str]) -> str:
    """The profile of the 8B-shape Q&A engine under load on a GPU: its heat maps (drawn from
    the document by bench/plots.py, `images` their paths from the page), what ran, and the
    rows that moved the most bytes. Without the document, says it is not measured."""
    from bench import profile_8b

    if d is None:
        return (
            "*Not measured yet*: `bash bench/on_device.sh profile8b` on a GPU machine writes the profile "
            "(`bench/profile_8b.py`); `python -m bench.profile_8b adopt PROFILE_JSON` keeps it as "
            "`bench/results/profile_cuda.json`, and `python -m bench.render` draws its heat maps here."
        )
    try:
        profile_8b.check_measured(d)
    except profile_8b.NotAdoptable as err:
        return f"**`bench/results/profile_cuda.json` is not the measured run**: {err}."
    w, device, window = d["workload"], d["device"], d["window"]
    bandwidth = device["copy_bandwidth_bytes_per_s"]
    lines = [
        f"`edgectl profile --workload qa --jobs {w['jobs']}` on the {device['name']}: the GPU profile "
        f"(`profiles/gpu-dev.yaml`) with its Q&A model alone, a random-weight Llama-3-8B-shape GGUF whose matrices are "
        f"all Q4_0, built by `edgectl build` (its Q4_0 weights kept as stored; `bench/profile_8b.py`). "
        f"{len(d['jobs'])} jobs through the continuous batcher, at most {profile_8b.concurrency(d['jobs'])} at once, "
        f"in a window of {window['seconds']:.1f} s, {window['columns']} columns; a cell is the share of the "
        f"{bandwidth / 1e9:.0f} GB/s copy bandwidth (measured first) a row's bytes took in that column "
        "(`bench/results/profile_cuda.json`). Random weights: speed and bandwidth, never quality.",
        "",
        f"![Share of the copy bandwidth each row took over time, 8B-shape Q&A under load]({images[0]})",
        "",
        f"Each row's share of each column busy, with the GPU's load, memory controller and the CPUs "
        f"sampled under it: [activity]({images[1]}).",
    ]
    known = sorted((r for r in d["rows"] if r["bytes"]), key=lambda r: -r["bytes"])[:6]
    if known:
        lines += [
            "",
            "| row | calls | seconds | GB moved | GB/s over its time | share of the copy bandwidth |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in known:
            name = f"`{_kernel_name(r['name'])}`" if r["kind"] == "kernel" else r["name"]
            rate = "-" if r["bytes_per_s"] is None else f"{r['bytes_per_s'] / 1e9:.0f}"
            share = "-" if r["bandwidth_share"] is None else f"{r['bandwidth_share']:.0%}"
            moved = f"{r['bytes'] / 1e9:.2f}"
            lines.append(f"| {r['kind']}: {name} | {r['calls']} | {r['seconds']:.3f} | {moved} | {rate} | {share} |")
    if d["available"]["notes"]:
        lines += ["", "Not available on that machine: " + "; ".join(d["available"]["notes"]) + "."]
    return "\n".join(lines)


# Blocks with heat maps: drawn from a profile document (bench/plots.py), their images linked
# from the page; rendered also where the document is missing, to say it is.
MAPS: dict[str, tuple[plots.HeatMaps, Callable[[dict[str, Any] | None, list[str]], str]]] = {
    "profile_cuda": (plots.PROFILE_MAPS[0], profile_cuda),
}


def render(readme: str, page: Path = REPO / "docs" / "benchmarks.md") -> str:
    """`readme` (the text of `page`, whose folder the image links start from) with every
    block rendered from the results."""
    for name, (source, fn) in TABLES.items():
        data = _load(source)
        if data is None:
            continue
        pattern = re.compile(rf"(<!-- bench:{name} -->).*?(<!-- /bench:{name} -->)", re.S)
        readme = pattern.sub(lambda m, d=data, f=fn: f"{m.group(1)}\n{f(d)}\n{m.group(2)}", readme)  # type: ignore[misc]
    for name, (maps, draw) in MAPS.items():
        doc = _load(maps.source)
        images = [Path(os.path.relpath(path, page.parent)).as_posix() for path in maps.paths()]
        block = draw(doc, images)
        pattern = re.compile(rf"(<!-- bench:{name} -->).*?(<!-- /bench:{name} -->)", re.S)
        readme = pattern.sub(lambda m, b=block: f"{m.group(1)}\n{b}\n{m.group(2)}", readme)  # type: ignore[misc]
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = parser.parse_args()
    unknown = [
        f"{page.relative_to(REPO)}: {name}" for page in pages.pages() for name in pages.blocks(page.read_text())
        if name not in TABLES and name not in MAPS
    ]  # fmt: skip
    if unknown:
        print("rendered blocks no table writes:", ", ".join(unknown))
        return 1
    stale_pages = []
    for page in pages.pages():
        current = page.read_text()
        wanted = render(current, page)
        if wanted == current:
            continue
        stale_pages.append(str(page.relative_to(REPO)))
        if not args.check:
            page.write_text(wanted)
    if args.check:
        stale = plots.stale() + plots.stale_maps()
        if stale_pages:
            print(
                "benchmark tables differ from bench/results in", ", ".join(stale_pages), "; run python -m bench.render"
            )
        if stale:
            print(
                "plots drawn from other results (or left without theirs):",
                ", ".join(stale),
                "; run python -m bench.render",
            )
        return 1 if stale_pages or stale else 0
    print("tables written from bench/results:", ", ".join(stale_pages) or "every page was up to date")
    for written in plots.write():
        print("drew", written)
    for done in plots.write_maps():
        print(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
