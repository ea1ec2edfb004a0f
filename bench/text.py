#!/usr/bin/env python3
"""Text-branch speed and memory, against baselines measured in the same run.

    python -m bench.text cuda   # Llama-3-8B shape, random INT4 weights, 8 GiB cap
    python -m bench.text cpu    # SmolLM2-135M (real weights), 2 threads

cuda: HBM copy bandwidth; decode tok/s at batch 1 and its fraction of the bandwidth
roofline (weight bytes streamed per token / copy bandwidth); time to first token for a
512-token prompt; peak GPU memory with a 4,096-token KV cache, the process capped at
8 GiB. Baseline: Hugging Face transformers FP16 `generate` on the same shape, uncapped.
cpu: our decoder (float and AWQ INT4) against transformers FP32 and llama.cpp on the
same GGUF, same prompt, same machine, same run.

Writes bench/results/text_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, agreement, write_json
from bench.text_engines import engine_fields, fixed, load_engine
from edge.profiling.bandwidth import copy_bandwidth as measured_copy_bandwidth
from edge.profiling.records import PRODUCT_KERNELS
from edge.profiling.shapes import products
from edge.text.architecture import LlamaConfig
from edge.text.engine import TextEngine
from edge.text.model.embedding import QuantizedEmbedding
from edge.text.runtime.generate import SamplingParams
from engines.text.corpus import evaluation_text
from engines.text.random_llama import LLAMA3_8B, int4_weight_bytes
from engines.text.text_build import serving_group

GIB = 1 << 30
# llama-bench's second depth; ours decodes after a prompt of this many tokens too.
LONG_CONTEXT = 4096


# ----------------------------------------------------------------------------- CUDA


def copy_bandwidth(nbytes: int = 4 * GIB) -> float:
    """Device-to-device copy, bytes read plus written per second (median of 20): the
    measure `edgectl profile` holds kernels to (edge/profiling/bandwidth.py), at 4 GiB."""
    return measured_copy_bandwidth(nbytes, "cuda")


def spin_up(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks have ramped up, so autotuning and the first
    variant are not measured at idle clocks."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _release() -> None:
    """Return what the last variant held to the driver before the next one is measured."""
    import gc

    gc.collect()
    # cuBLAS holds a workspace for each stream it ran on; those of the checks' and the
    # last variant's streams are not the next one's memory (its own come back on use).
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def cuda_time(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """Median seconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return float(statistics.median(times))


def hf_baseline(config: LlamaConfig, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf_cfg = HFConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rope_theta=config.rope_theta,  # type: ignore[call-arg]
        max_position_embeddings=config.max_position,
        tie_word_embeddings=False,
    )
    torch.cuda.reset_peak_memory_stats()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), device="cuda")
    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.inference_mode():
        ttft = cuda_time(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs), repeat=3)
        total = cuda_time(
            lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs),
            repeat=3,
            warmup=1,
        )
    peak = torch.cuda.max_memory_allocated()
    return {
        "name": "transformers FP16 generate (uncapped)",
        "decode_tok_s": (new_tokens - 1) / (total - ttft),
        "ttft_ms": ttft * 1000,
        "peak_gib": peak / GIB,
    }


def _rate(seq: Any) -> float:
    """Decode tok/s of a finished sequence: its tokens after the first over the time
    between the first and the last, as each came back to the host."""
    times = seq.token_times
    return float((len(times) - 1) / (times[-1] - times[0]))


def _attempt(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A secondary measurement; its failure is reported in its place, not raised."""
    try:
        return measure()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


# The CUDA rows: the engine the shipped GPU profile serves, then the same with one
# profile field changed (what each default was chosen against), on a checkpoint
# quantized at the group size `edgectl build` gives the 8B shape (text_build.serving_group),
# and on one at group 32 (what small models are built at).
SERVED_GROUP = serving_group(LLAMA3_8B.parameter_count())
CUDA_VARIANTS: dict[str, tuple[int, dict[str, Any]]] = {
    "served": (SERVED_GROUP, {}),
    "bfloat16": (SERVED_GROUP, {"dtype": "bfloat16"}),
    "triton": (SERVED_GROUP, {"cuda_kernel": "triton"}),
    "torch-int4": (SERVED_GROUP, {"cuda_kernel": "torch"}),
    "float-table": (SERVED_GROUP, {"embedding": "float"}),
    "int4-table": (SERVED_GROUP, {"embedding": "int4"}),
    "no-graphs": (SERVED_GROUP, {"cuda_graphs": False}),
    "g32": (32, {}),
    "g32-bfloat16": (32, {"dtype": "bfloat16"}),
}


def _describe(engine: TextEngine) -> str:
    c = engine.config()
    step = "fused step" if c["fused_step"] else "per-op step"
    folded = ", norms folded" if c["fold_norms"] else ""
    graphs = "CUDA graphs" if c["cuda_graphs"] else "no graphs"
    return (
        f"edge INT4 g{c['group_size']}, {c['kernel']} GEMV, {c['dtype']}, {step}{folded}, {graphs}, "
        f"{c['embedding']} token table"
    )


def ours_cuda(
    checkpoint: Path,
    changes: dict[str, Any],
    prompt_len: int,
    new_tokens: int,
    long_context: int,
    bandwidth: float,
    batch_sizes: tuple[int, ...] = (),
    profile: bool = False,
) -> dict[str, Any]:
    """One engine the daemon would build from the shipped GPU profile with `changes`:
    TTFT of a `prompt_len` prompt, decode after it and after `long_context` tokens, peak
    memory with a KV row of `long_context + prompt_len` tokens (llama-bench's largest
    context for the same test), then the in-graph profile and continuous batching at
    `batch_sizes` (a second engine of the same section with that many rows)."""
    _release()
    torch.cuda.reset_peak_memory_stats()
    cache_len = long_context + prompt_len
    engine = load_engine(checkpoint, "cuda", max_sequences=1, max_context_tokens=cache_len, **changes)
    load_peak = torch.cuda.max_memory_allocated()
    row = {
        "name": _describe(engine),
        "changed": changes,
        **single_sequence(engine, prompt_len, new_tokens, long_context, bandwidth, profile),
        "load_peak_gib": load_peak / GIB,
        **engine_fields(engine),
    }
    del engine
    _release()
    if batch_sizes:
        try:
            row["batched"] = batched(checkpoint, changes, prompt_len, new_tokens, batch_sizes)
        except Exception as err:  # the batch-1 row stands
            row["batched_error"] = f"{type(err).__name__}: {err}"
    return row


def single_sequence(
    engine: TextEngine, prompt_len: int, new_tokens: int, long_context: int, bandwidth: float, profile: bool
) -> dict[str, Any]:
    """ours_cuda's batch-1 figures, every one through the engine's batcher as a job runs."""
    model = engine.model
    config: LlamaConfig = model.config
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist()
    long_prompt = torch.randint(0, config.vocab_size, (long_context,), generator=gen).tolist()
    ids = torch.tensor([prompt], device="cuda")

    def eager_prefill() -> None:
        model(ids, engine.batcher.cache.rows(0, 1), 0)

    # From here: what serving holds once loaded and warmed up.
    torch.cuda.reset_peak_memory_stats()
    phases: dict[str, dict[str, float]] = {"held": {"allocated_gib": torch.cuda.memory_allocated() / GIB}}

    def phase(name: str) -> None:
        # Each phase's own peak (then reset): where the row's peak is reached, and by what.
        torch.cuda.synchronize()
        phases[name] = {
            "peak_gib": torch.cuda.max_memory_allocated() / GIB,
            "allocated_gib": torch.cuda.memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        torch.cuda.reset_peak_memory_stats()

    # The op-by-op prefill of the same prompt, for comparison (what serves a prompt
    # longer than the largest captured prefill bucket).
    ttft_eager = cuda_time(eager_prefill, repeat=10, warmup=3)
    phase("eager_prefill")
    # TTFT as a job sees it: a row granted, the prompt prefilled (its bucket's captured
    # graph where the model allows it), the first token chosen and back on the host.
    ttft = cuda_time(lambda: engine.generate(prompt, fixed(1)), repeat=10, warmup=3)
    phase("prefill")
    tok_s = statistics.median(_rate(engine.generate(prompt, fixed(new_tokens))) for _ in range(3))
    phase("decode")
    # The long context: its prompt prefilled as one, then decode.
    tok_s_4k = statistics.median(_rate(engine.generate(long_prompt, fixed(new_tokens))) for _ in range(3))
    phase("decode_4k")
    peak = max(p.get("peak_gib", 0.0) for p in phases.values()) * GIB
    reserved = max(p.get("peak_reserved_gib", 0.0) for p in phases.values()) * GIB
    # What the profiles capture is not serving's memory: measured after the peak.
    steps_profile = _attempt(lambda: graph_profile(engine, prompt, bandwidth)) if profile else None
    gemv_in_graphs = _attempt(lambda: gemv_graphs(model, bandwidth)) if profile and model.fused_decode else None
    weights = int4_weight_bytes(model) + 2 * config.hidden_size * (2 * config.num_layers + 1)
    kv_token = config.kv_bytes_per_token(engine.dtype)

    def per_token(context: int) -> int:
        return weights + kv_token * (context + new_tokens // 2) + config.hidden_size * 2

    row: dict[str, Any] = {
        "kernel": engine.int4_kernel,
        "fused_decode": bool(model.fused_decode),
        "decode_tok_s": tok_s,
        "decode_tok_s_4k": tok_s_4k,
        "bytes_per_token": per_token(prompt_len),
        "bytes_per_token_4k": per_token(long_context),
        "roofline_tok_s": bandwidth / per_token(prompt_len),
        "roofline_fraction": tok_s / (bandwidth / per_token(prompt_len)),
        "roofline_fraction_4k": tok_s_4k / (bandwidth / per_token(long_context)),
        "ttft_ms": ttft * 1000,
        "ttft_eager_ms": ttft_eager * 1000,
        "prefill_graphs": engine.batcher.prefill_graphs is not None,
        "peak_gib": peak / GIB,
        "peak_reserved_gib": reserved / GIB,
        "memory_phases": phases,
        "kv_cache_tokens": engine.batcher.slot_len,
    }
    if steps_profile is not None:
        row["graph_profile"] = steps_profile
    if gemv_in_graphs is not None:
        row["gemv_graphs"] = gemv_in_graphs
    return row


def batched(
    checkpoint: Path, changes: dict[str, Any], prompt_len: int, new_tokens: int, sizes: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Aggregate tok/s of n sequences decoded together by the engine's batcher
    (continuous batching, steps replayed as CUDA graphs, tokens chosen on the GPU), each
    sequence prefilled alone when it joins: the same section with max(sizes) rows."""
    engine = load_engine(
        checkpoint, "cuda", max_sequences=max(sizes), max_context_tokens=prompt_len + new_tokens + 1, **changes
    )
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in sizes:
        prompts = [
            torch.randint(0, engine.model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n)
        ]
        seqs = [engine.sequence(p, fixed(new_tokens), i) for i, p in enumerate(prompts)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.batcher.run_all(seqs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        tokens = sum(len(s.tokens) for s in seqs)
        prefill_s = sum(s.prefill_ms for s in seqs) / 1000
        out.append(
            {
                "sequences": n,
                "tokens": tokens,
                "aggregate_tok_s": tokens / wall,
                "decode_aggregate_tok_s": tokens / max(wall - prefill_s, 1e-9),
                "seconds": wall,
            }
        )
    del engine
    _release()
    return out


def gemv_graphs(model: Any, bandwidth: float, repeat: int = 20) -> dict[str, Any]:
    """Each kind of INT4 product of the step (every layer's qkv, then every layer's o, ...)
    captured in a CUDA graph of its own and replayed: its time inside a graph, as the
    step runs it, without a profiler (the figure stands where CUPTI cannot trace)."""
    from edge.text.runtime.fused_step import _gemv

    layers = list(model.layers)
    kinds = {
        "qkv": [layer.self_attn.qkv_proj for layer in layers],
        "o": [layer.self_attn.o_proj for layer in layers],
        "gate_up": [layer.mlp.gate_up_proj for layer in layers],
        "down": [layer.mlp.down_proj for layer in layers],
        "lm_head": [model.lm_head],
    }
    out: dict[str, Any] = {}
    for kind, linears in kinds.items():
        x = torch.randn(1, linears[0].in_features, device="cuda").to(model.dtype)

        def run(linears: list[Any] = linears, x: torch.Tensor = x) -> None:
            for linear in linears:
                _gemv(linear, x)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        seconds = cuda_time(graph.replay, repeat=repeat)
        nbytes = sum(linear.weight_bytes for linear in linears)
        out[kind] = {
            "us": seconds / len(linears) * 1e6,
            "per_step": len(linears),
            "gb_s": nbytes / seconds / 1e9,
            "bandwidth_fraction": nbytes / seconds / bandwidth,
        }
        del graph
    out["per_step_ms"] = sum(v["us"] * v["per_step"] for v in out.values()) / 1000
    return out


def graph_profile(engine: TextEngine, prompt: list[int], bandwidth: float, steps: int = 8) -> dict[str, Any]:
    """Where a served decode step's time goes, from the GPU's own kernel records (CUPTI,
    through torch.profiler) of `steps` steps of the engine's batcher decoding one
    sequence: the step's span, the time kernels run, the gaps between them, time per
    kernel, and each INT4 GEMV's time and achieved bandwidth by matrix (the GEMVs come in
    layer order: qkv, o, gate_up, down, ..., lm_head)."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, batcher = engine.model, engine.batcher
    seq = engine.sequence(prompt, fixed(steps + 4), "profile")
    slot = batcher.kv.allocate_slots("profile", len(prompt) + steps + 4)
    assert slot is not None
    try:
        batcher.admit(seq, slot)
        for _ in range(2):
            batcher.step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                batcher.step()
            torch.cuda.synchronize()
        while seq.finish is None:
            batcher.step()
    finally:
        batcher.kv.free(slot)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: float(e["ts"]),
    )
    per_step = len(events) // steps
    if not events or per_step * steps != len(events):
        return {"error": f"{len(events)} GPU events for {steps} steps"}
    # The model's INT4 products in the order a forward calls them, each with its weight's
    # bytes: what `edgectl profile` matches kernel records to (edge/profiling/shapes.py).
    order = products(model) or []
    spans: list[float] = []
    busy: list[float] = []
    by_name: dict[str, list[float]] = {}
    gemv_us: dict[str, list[tuple[float, int]]] = {}
    for s in range(steps):
        step = events[s * per_step : (s + 1) * per_step]
        spans.append(float(step[-1]["ts"]) + float(step[-1]["dur"]) - float(step[0]["ts"]))
        busy.append(sum(float(e["dur"]) for e in step))
        gemvs = [e for e in step if PRODUCT_KERNELS.search(e["name"])]
        for e in step:
            by_name.setdefault(e["name"], []).append(float(e["dur"]))
        if order and len(gemvs) == len(order):
            for product, e in zip(order, gemvs, strict=True):
                gemv_us.setdefault(product.label, []).append((float(e["dur"]), product.nbytes))
    kernels = {
        name: {"us_per_step": sum(d) / steps, "count_per_step": len(d) / steps}
        for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    }
    shapes: dict[str, dict[str, float]] = {}
    for label, vals in gemv_us.items():
        us = statistics.median(v[0] for v in vals)
        size = vals[0][1]
        shapes[label] = {"us": us, "bytes": size, "gb_s": size / (us * 1e-6) / 1e9, "per_step": len(vals) // steps}
    gemv_ms = sum(v["us"] * v["per_step"] for v in shapes.values()) / 1000
    gemv_bytes = sum(v["bytes"] * v["per_step"] for v in shapes.values())
    return {
        "steps": steps,
        "kernels_per_step": per_step,
        "step_span_ms": statistics.median(spans) / 1000,
        "kernel_busy_ms": statistics.median(busy) / 1000,
        "gaps_ms": (statistics.median(spans) - statistics.median(busy)) / 1000,
        "gemv_ms": gemv_ms,
        "gemv_bandwidth_fraction": gemv_bytes / bandwidth / (gemv_ms / 1000) if gemv_ms else None,
        "gemv_by_matrix": shapes,
        "kernels": kernels,
    }


CHECK_SHAPE = LlamaConfig(
    vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
)


def _served_logits(engine: TextEngine, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """The next-token logits a sequence gets as the engine's batcher serves it: after its
    prefill, then after each decode step (CUDA graphs, tokens chosen on the GPU), with
    the tokens chosen."""
    batcher = engine.batcher
    seq = engine.sequence(prompt, fixed(steps), "check")
    slot = batcher.kv.allocate_slots("check", len(prompt) + steps)
    assert slot is not None
    got: list[torch.Tensor] = []
    try:
        batcher.admit(seq, slot)
        while seq.finish is None:
            assert seq.logits is not None
            got.append(seq.logits.float().cpu().clone())
            batcher.step()
    finally:
        batcher.kv.free(slot)
    return got, seq.tokens


def check_cuda(names: list[str]) -> dict[str, float]:
    """Relative error of each variant's logits against the exact float32 CPU engine of the
    same checkpoint (a small random one, at the variant's group size): the op-by-op
    prefill, the first token's logits as served, and the worst decode step as served."""
    import tempfile

    from engines.text.random_llama import write_random_checkpoint

    errors: dict[str, float] = {}
    # A fixed prompt: the figure is the same from run to run for the same kernels.
    prompt = torch.randint(0, CHECK_SHAPE.vocab_size, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        paths: dict[int, Path] = {}
        for name in names:
            group, changes = CUDA_VARIANTS[name]
            if group not in paths:
                paths[group] = write_random_checkpoint(Path(tmp) / f"g{group}", CHECK_SHAPE, group=group, seed=3)
            engine = load_engine(paths[group], "cuda", max_sequences=1, max_context_tokens=64, **changes)
            reference = load_engine(
                paths[group],
                "cpu",
                warm=False,
                max_sequences=1,
                max_context_tokens=64,
                dtype="float32",
                cpu_kernel="exact",
            )
            # The reference reads the checked engine's own token table (its compact codes,
            # or its float table) in float32: only the kernels differ, not the table's
            # rounding, which alone moves the logits by up to 3% on some prompts.
            table = engine.model.embed_tokens
            if isinstance(table, QuantizedEmbedding):
                reference.model.embed_tokens = table.with_dtype(torch.float32).to("cpu")
            else:
                reference.model.embed_tokens.weight.data.copy_(table.weight.detach().float().cpu())
            served, tokens = _served_logits(engine, prompt, 8)
            path = prompt + tokens[: len(served) - 1]
            ref_model = reference.model
            with torch.inference_mode():
                ref = ref_model(torch.tensor([path]), ref_model.new_cache(1, len(path)), 0, last_only=False)[0]
                eager = (
                    engine.model(
                        torch.tensor([prompt], device="cuda"), engine.batcher.cache.rows(0, 1), 0, last_only=False
                    )[0]
                    .float()
                    .cpu()
                )
            n = len(prompt)

            def rel(got: torch.Tensor, want: torch.Tensor) -> float:
                return float((got - want).norm() / want.norm())

            errors[f"{name}_prefill"] = rel(eager, ref[:n])
            errors[f"{name}_first_token"] = rel(served[0], ref[n - 1])
            errors[f"{name}_decode"] = max(rel(served[i], ref[n - 1 + i]) for i in range(1, len(served)))
            del engine, reference
            _release()
    return errors


GEMV_LABELS = ("cuda_mma", "triton_bits", "stock_int4")
FUSED_KERNELS = ("cuda-mma", "triton")
KERNEL_SHAPES = {  # (N, K) of the 8B model's INT4 matrices, and how many per token
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}


def _bench_shape(n: int, k: int, gen: torch.Generator) -> dict[str, Any]:
    from triton.testing import do_bench

    from edge.text.ops.cuda import cuda_int4
    from edge.text.ops.int4 import Int4Linear
    from edge.text.ops.triton.triton_int4 import int4_dequant, int4_gemv
    from engines.text.random_llama import random_quantized

    q = random_quantized(n, k, 128, torch.device("cuda"), gen)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    stock = Int4Linear(q, "cuda")
    tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, 128)
    config = cuda_int4.tuned_config(tiled, torch.bfloat16)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    fns: dict[str, Callable[[], Any]] = {
        "cuda_mma": lambda: cuda_int4.gemv(x, tiled, config),
        "triton_bits": lambda: int4_gemv(x, q.qweight, q.scales, q.zeros, 128),
        "stock_int4": lambda: stock(x),
        "bf16_cublas": lambda: x @ dense.T,
        "dequant_bf16": lambda: int4_dequant(q.qweight, q.scales, q.zeros, 128, torch.bfloat16),
        "dequant_cuda_bf16": lambda: cuda_int4.dequant(tiled, 0, tiled.tiles, torch.bfloat16),
    }
    entry: dict[str, Any] = {"n": n, "k": k, "int4_bytes": q.nbytes, "cuda_mma_config": list(config)}
    for label, fn in fns.items():
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        moved = n * k * 2 if label == "bf16_cublas" else q.nbytes
        entry[label] = {"us": ms * 1000, "gb_s": moved / (ms / 1000) / 1e9}
    return entry


def bench_kernels() -> dict[str, Any]:
    """Each INT4 matrix at batch 1 through each kernel: time and achieved bandwidth."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: dict[str, Any] = {}
    for name, (n, k, count) in KERNEL_SHAPES.items():
        rows[name] = {**_bench_shape(n, k, gen), "per_token": count}
        _release()
    rows["per_token_linear_ms"] = {
        label: sum(rows[name][label]["us"] * rows[name]["per_token"] for name in KERNEL_SHAPES) / 1000
        for label in GEMV_LABELS
    }
    return rows


class PeerBuild(threading.Thread):
    """llama.cpp's build, started first and run beside our measurements at the lowest
    CPU priority on all but two cores (our timings are GPU-side, inside CUDA graphs, or
    on the one Python thread); llama-bench itself runs after ours, alone on the GPU."""

    def __init__(self, args: argparse.Namespace, arch: str) -> None:
        super().__init__(daemon=True)
        self.args, self.arch = args, arch
        self.result: tuple[Path, float] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from bench import llamacpp_peer as peer

        try:
            self.args.llamacpp_work.mkdir(parents=True, exist_ok=True)
            jobs = max(1, min(self.args.llamacpp_jobs, (os.cpu_count() or 4) - 2))
            self.result = peer.build(self.args.llamacpp_src, self.args.llamacpp_work, self.arch, jobs, nice=True)
        except BaseException as err:  # said in the llama.cpp row
            self.error = err

    def binary(self) -> tuple[Path, float]:
        self.join()
        if self.error is not None:
            raise RuntimeError(f"the llama.cpp build failed: {self.error}") from self.error
        assert self.result is not None
        return self.result


def run_cuda(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from engines.text.random_llama import write_random_checkpoint

    config = LLAMA3_8B
    props = torch.cuda.get_device_properties(0)
    builder = None
    if args.llamacpp_src is not None:
        builder = PeerBuild(args, f"{props.major}{props.minor}")
        builder.start()
    checks = check_cuda(args.variants)
    print("kernel checks (relative error vs the exact float32 CPU engine):", json.dumps(checks))
    if any(not (e < 2e-2) for e in checks.values()):
        raise SystemExit("a variant disagrees with the reference; not timing it")
    spin_up()
    bandwidth = copy_bandwidth()
    kernels = {} if args.skip_kernels else bench_kernels()
    _release()
    for name in KERNEL_SHAPES if kernels else ():
        e = kernels[name]
        print(
            f"  {name:<8} N={e['n']:<6} K={e['k']:<6} "
            + " ".join(f"{lab}={e[lab]['us']:.1f}us/{e[lab]['gb_s']:.0f}GB/s" for lab in e if isinstance(e[lab], dict))
        )
    rows: list[dict[str, Any]] = []
    partial = args.out_path.with_suffix(".partial.json")

    def keep(row: dict[str, Any]) -> None:
        # Each row on disk as soon as it is measured: a run cut short keeps what it had.
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict | list)}))
        write_json(partial, {"rows": rows, "copy_bandwidth_gb_s": bandwidth / 1e9}, indent=1)

    if not args.skip_baseline:
        keep(hf_baseline(config, args.prompt, args.new_tokens))
        _release()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        checkpoints: dict[int, Path] = {}
        for name in args.variants:
            group = CUDA_VARIANTS[name][0]
            if group not in checkpoints:
                checkpoints[group] = write_random_checkpoint(
                    Path(tmp) / f"llama3-8b-int4-g{group}", config, device="cuda", group=group, seed=3
                )
                _release()
        # Capped as the daemon is: the budget the shipped profile gives the process.
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / props.total_memory)
        for name in args.variants:
            group, changes = CUDA_VARIANTS[name]
            spin_up(1.0)
            detail = name == "served"
            try:
                row = ours_cuda(
                    checkpoints[group],
                    changes,
                    args.prompt,
                    args.new_tokens,
                    LONG_CONTEXT,
                    bandwidth,
                    batch_sizes=tuple(args.batch) if detail else (),
                    profile=detail,
                )
                keep({"variant": name, **row})
            except Exception as err:  # report a failing variant, keep measuring the others
                keep(
                    {
                        "variant": name,
                        "name": f"edge ({name})",
                        "changed": changes,
                        "error": f"{type(err).__name__}: {err}",
                    }
                )
            _release()
        torch.cuda.set_per_process_memory_fraction(1.0)
    peer = None
    if args.llamacpp_src is not None:
        try:
            assert builder is not None
            peer = llamacpp_peer(args, config, builder)
            keep(peer_row(peer, config, args.prompt, args.new_tokens, bandwidth))
        except Exception as err:  # our rows stand; the failure is said in the table
            keep({"name": "llama.cpp", "error": f"{type(err).__name__}: {err}"})
        served = [r for r in rows if r.get("served") and "decode_tok_s" in r]
        if served and peer is not None and "decode_tok_s" in rows[-1]:
            ours, theirs = served[0], rows[-1]
            peer["vs"] = {
                "row": ours["name"],
                "decode_512": ours["decode_tok_s"] / theirs["decode_tok_s"],
                "decode_4096": ours["decode_tok_s_4k"] / theirs["decode_tok_s_4k"],
                "ttft_512": theirs["ttft_ms"] / ours["ttft_ms"],
                "peak_memory": ours["peak_gib"] / theirs["peak_gib"],
            }
    measured = [r for r in rows if r.get("name", "").startswith("edge") and "decode_tok_s" in r]
    served_rows = [r for r in measured if r.get("served")]
    return {
        "device": props.name,
        "torch": torch.__version__,
        "command": "python -m bench.text " + " ".join(sys.argv[1:]),
        "llamacpp": peer,
        "kernel_checks": checks,
        "kernels": kernels,
        "shape": "Llama-3-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256), random weights",
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "memory_cap_gib": args.cap_gib,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "long_context_tokens": LONG_CONTEXT,
        # The served row's decode over the fastest edge row's: whether the shipped
        # default is the fast one.
        "served_over_fastest": (
            served_rows[0]["decode_tok_s"] / max(r["decode_tok_s"] for r in measured) if served_rows else None
        ),
        "rows": rows,
    }


def llamacpp_peer(args: argparse.Namespace, config: LlamaConfig, builder: PeerBuild) -> dict[str, Any]:
    """llama.cpp's llama-bench on the same GPU in the same run (bench/llamacpp_peer.py):
    built from the pinned source here, on a random Q4_0 GGUF of the same shape."""
    from bench import llamacpp_peer as peer
    from bench.random_gguf import write_q4_0_gguf

    work = args.llamacpp_work
    binary, build_s = builder.binary()
    model = work / "llama3-8b-q4_0-random.gguf"
    if not model.exists():
        write_q4_0_gguf(model, config)
    out = peer.run_bench(binary, model, args.prompt, args.new_tokens, (0, LONG_CONTEXT))
    out.update({"source": peer.LLAMACPP_VERSION, "build_seconds": build_s, "format": "Q4_0, random weights"})
    out["built_beside_our_rows"] = True
    print("llama.cpp:", json.dumps({k: out[k] for k in ("prefill_tok_s", "decode_tok_s")}))
    return out


def peer_row(
    peer: dict[str, Any], config: LlamaConfig, prompt: int, new_tokens: int, bandwidth: float
) -> dict[str, Any]:
    """llama.cpp's figures as a row of the table: decode at depth 0 and at LONG_CONTEXT,
    the prompt's prefill as its time to first token, its buffers (GPU and host, where its
    Q4_0 token table stays) as its peak, and its roofline over what it streams per token
    (every Q4_0 matrix but the host-side table, and its float16 KV cache)."""
    from bench.random_gguf import q4_0_bytes

    decode, prefill = peer["decode_tok_s"], peer["prefill_tok_s"]
    weights = q4_0_bytes(config, embedding=False)
    kv_token = config.kv_bytes_per_token(torch.float16)
    per_token = weights + kv_token * (new_tokens // 2)
    per_token_4k = weights + kv_token * (LONG_CONTEXT + new_tokens // 2)
    mib = peer["buffers_mib"] or {"total": float("nan"), "gpu": float("nan"), "host": float("nan")}
    return {
        "name": f"llama.cpp ({peer['source']}, {peer['format']}, flash attention)",
        "decode_tok_s": decode["0"],
        "decode_tok_s_4k": decode[str(LONG_CONTEXT)],
        "ttft_ms": prompt / prefill["0"] * 1000,
        "peak_gib": mib["total"] / 1024,
        "peak_gpu_gib": mib["gpu"] / 1024,
        "peak_host_gib": mib["host"] / 1024,
        "bytes_per_token": per_token,
        "roofline_fraction": decode["0"] / (bandwidth / per_token),
        "roofline_fraction_4k": decode[str(LONG_CONTEXT)] / (bandwidth / per_token_4k),
        "command": peer["command"],
        # What the peer ran, in the terms our rows' configurations use where they apply.
        "engine_config": {
            "engine": "llama.cpp",
            "source": peer["source"],
            "device": "cuda",
            "weights": peer["format"],
            "kv_dtype": "float16",
            "flash_attention": True,
            "gpu_layers": "all",
        },
        "served": False,
    }


def print_cuda(result: dict[str, Any]) -> None:
    bandwidth = result["copy_bandwidth_gb_s"]
    print(f"{result['device']}, copy bandwidth {bandwidth:.0f} GB/s, cap {result['memory_cap_gib']} GiB")
    print(f"{'variant':<72} {'tok/s':>7} {'4K tok/s':>8} {'roofline':>8} {'TTFT ms':>8} {'peak GiB':>8}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['name']:<72} ERROR {r['error']}")
            continue
        frac = f"{r['roofline_fraction'] * 100:.0f}%" if "roofline_fraction" in r else "-"
        long = f"{r['decode_tok_s_4k']:.1f}" if "decode_tok_s_4k" in r else "-"
        print(
            f"{r['name']:<72} {r['decode_tok_s']:>7.1f} {long:>8} {frac:>8} {r['ttft_ms']:>8.1f} {r['peak_gib']:>8.2f}"
        )
        for b in r.get("batched", []):
            print(f"    {b['sequences']} sequences: {b['aggregate_tok_s']:.0f} tok/s together")
        prof = r.get("graph_profile")
        if prof and "step_span_ms" in prof:
            print(
                f"    in the graph: step {prof['step_span_ms']:.2f} ms, kernels busy {prof['kernel_busy_ms']:.2f} ms, "
                f"INT4 GEMVs {prof['gemv_ms']:.2f} ms"
            )
            for name, g in prof["gemv_by_matrix"].items():
                print(f"      {name:<8} {g['us']:.1f} us, {g['gb_s']:.0f} GB/s")
    peer = result.get("llamacpp")
    if peer and peer.get("vs"):
        print("edge / llama.cpp:", json.dumps(peer["vs"]))


# ----------------------------------------------------------------------------- CPU


CPU_PROMPT = "Explain in a few sentences why hand hygiene matters in a hospital ward."


# A CPU row: one decode-rate measurement a call, and what the row records beside it.
Measure = tuple[Callable[[], float], dict[str, Any]]


def _ours_cpu(path: Path, prompt_ids: list[int], new_tokens: int, threads: int, **changes: Any) -> Measure:
    """The CPU engine the daemon builds from the shipped cpu-dev profile with `changes`,
    serving `path`: one sequence through its batcher, the decode rate as the daemon
    reports it."""
    engine = load_engine(path, "cpu", threads=threads, max_context_tokens=len(prompt_ids) + new_tokens + 1, **changes)
    info: dict[str, Any] = {"int4_kernel": engine.int4_kernel, **engine_fields(engine)}
    made: list[int] = []

    def once() -> float:
        # Exactly new_tokens, as llama.cpp's row is run (ignore_eos): rates over the same
        # lengths, whichever row's answer would end first.
        seq = engine.generate(prompt_ids, fixed(new_tokens))
        made.append(len(seq.tokens))
        info["generated_tokens"] = statistics.median(made)
        return seq.tokens_per_s

    return once, info


def _python_share(path: Path, prompt_ids: list[int], threads: int, steps: int = 32) -> dict[str, float]:
    """Where the served CPU decode step's time goes: inside our C kernel (every layer in
    one call, where it serves), inside torch operators (the embedding, the final norm and
    the head), and the Python around them, measured with torch's profiler on the served
    engine's model; beside it, the same model's step op by op."""
    from torch.profiler import ProfilerActivity, profile

    from bench.text_engines import load_engine
    from edge.text.ops.cpu import cpu_int4, cpu_step
    from edge.text.runtime import fused_step

    model = load_engine(path, "cpu", warm=False, threads=threads).model
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids])
    token = torch.tensor([[prompt_ids[-1]]])

    def run(fused: bool | None) -> tuple[float, Any, float, float]:
        model.fused_decode = fused
        cache = model.new_cache(1, n + steps + 1)
        model(ids, cache, 0)
        spent = {"step": 0.0, "linear": 0.0}
        step, linear = cpu_step.decode_layers, cpu_int4.linear

        def timed(name: str, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def call(*args: Any, **kwargs: Any) -> torch.Tensor:
                t0 = time.perf_counter()
                out = inner(*args, **kwargs)
                spent[name] += time.perf_counter() - t0
                return out

            return call

        cpu_step.decode_layers = timed("step", step)
        cpu_int4.linear = timed("linear", linear)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for i in range(steps):
                    cache.make_room_for_step([n + i])  # a sliding model's buffers, as the batcher does
                    fused_step.decode_step(model, token, cache, torch.tensor([n + i]), n + i + 1)
                wall = time.perf_counter() - t0
        finally:
            cpu_step.decode_layers, cpu_int4.linear = step, linear
        return wall, prof, spent["step"], spent["linear"]

    per_op, _, _, _ = run(False)
    wall, prof, in_c, in_linear = run(None)
    # Top-level operator calls: self times of every aten op, summed, is time spent in torch.
    in_ops = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6
    return {
        "step_ms": wall / steps * 1000,
        "c_step": bool(model.fused_decode),
        "in_c_step_ms": in_c / steps * 1000,
        # The head (and any product outside the C step): our INT4 kernel, called through ctypes.
        "in_c_products_ms": in_linear / steps * 1000,
        "in_torch_ops_ms": in_ops / steps * 1000,
        "python_share": max(0.0, 1 - (in_ops + in_c + in_linear) / wall),
        "ops_per_step": sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps,
        "per_op_step_ms": per_op / steps * 1000,
    }


def _hf_cpu(gguf: Path, prompt_ids: list[int], new_tokens: int) -> Measure:
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            t2 = time.perf_counter()
        return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))

    config: dict[str, Any] = {
        "engine": "transformers",
        "source": f"transformers {transformers.__version__}",
        "device": "cpu",
    }
    config |= {"dtype": "float32", "weights": f"{gguf.name}, dequantized", "threads": torch.get_num_threads()}
    return once, {"engine_config": config, "served": False}


LLAMACPP_CTX = 512


def _llamacpp_cpu(gguf: Path, prompt: str, new_tokens: int, threads: int, runs: int) -> Measure:
    """llama.cpp on the CPU, measured in a child process with nothing else in it. In this
    process its GNU OpenMP threads would join torch's (one runtime): with more OpenMP
    threads than cores, libgomp spins less before sleeping at each barrier, and after our
    rows' torch work llama.cpp decoded at 14-29 tok/s where alone it ran at 82 (SmolLM2,
    2 threads, x86)."""
    import xllamacpp as xlc

    # The child imports xllamacpp alone: not edge, whose import sets GOMP_SPINCOUNT for
    # our own threads (edge/__init__.py); llama.cpp runs with its runtime's defaults.
    code = f"""
import json, sys
import xllamacpp as xlc
gguf, prompt, new_tokens, threads, runs = json.loads(sys.argv[1])
params = xlc.CommonParams()
params.model.path = gguf
params.prompt = prompt
params.n_predict = new_tokens
params.n_ctx = {LLAMACPP_CTX}
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
params.sampling.temp = 0.0
server = xlc.Server(params)
body = {{"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True}}
rates = [float(server.handle_completions(body)["timings"]["predicted_per_second"]) for _ in range(runs)]
print(json.dumps(rates))
"""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    arg = json.dumps([str(gguf), prompt, new_tokens, threads, runs])
    done = subprocess.run(
        [sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=1800, check=False, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's child failed: {done.stderr.strip()[-1000:]}")
    rates = iter([float(r) for r in json.loads(done.stdout.strip().splitlines()[-1])])

    def once() -> float:
        return next(rates)

    return once, {
        # What the peer ran, in the terms our rows' configurations use where they apply.
        "engine_config": {
            "engine": "llama.cpp",
            "source": f"xllamacpp {xlc.__version__}" if hasattr(xlc, "__version__") else "xllamacpp",
            "device": "cpu",
            "weights": gguf.name,
            "threads": threads,
            "n_ctx": LLAMACPP_CTX,
            "process": "its own",
        },
        "served": False,
    }


AGREEMENT_PROMPTS = 24
AGREEMENT_TOKENS = 16


def _greedy(engine: TextEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [list(engine.generate(p, SamplingParams(max_new_tokens=AGREEMENT_TOKENS)).tokens) for p in prompts]


def held_out_prompts(tokenizer: Any) -> list[list[int]]:
    """AGREEMENT_PROMPTS prompts of 48 tokens, spread over held-out text (the evaluation
    corpus, which neither the adapter nor the quantizer saw)."""
    held = tokenizer.encode(evaluation_text(), add_special_tokens=False).ids
    stride = len(held) // AGREEMENT_PROMPTS
    return [held[i * stride : i * stride + 48] for i in range(AGREEMENT_PROMPTS)]


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from edge.text.prompt import chatml
    from engines.text.import_gguf import import_smollm2, smollm2_gguf_path
    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import build_text_engine, quantize_checkpoint

    torch.set_num_threads(args.threads)
    base = import_smollm2(args.engine_dir)
    # The served build (what `edgectl build` makes for cpu-dev: the clinic adapter merged,
    # AWQ INT4 at its group size) and, beside it, the base at group 128 and in float.
    served = build_text_engine(args.engine_dir, "clinic", "awq-int4", progress=False)
    awq128 = quantize_checkpoint(base, QuantRecipe(method="awq", group_size=128))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    prompt = chatml("You are a helpful assistant.", CPU_PROMPT)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    gguf = smollm2_gguf_path()
    rows: list[dict[str, Any]] = []
    t = args.threads
    variants: list[tuple[str, Callable[[], Measure]]] = [
        (
            "llama.cpp (xllamacpp, same GGUF)",
            lambda: _llamacpp_cpu(gguf, prompt, args.new_tokens, args.threads, args.rounds + 1),
        ),
        ("transformers FP32 generate", lambda: _hf_cpu(gguf, prompt_ids, args.new_tokens)),
        ("edge AWQ INT4 g32 + clinic adapter (served)", lambda: _ours_cpu(served, prompt_ids, args.new_tokens, t)),
        (
            "edge AWQ INT4 g32 + clinic adapter, our exact float32 kernel",
            lambda: _ours_cpu(served, prompt_ids, args.new_tokens, t, cpu_kernel="exact"),
        ),
        (
            "edge AWQ INT4 g32 + clinic adapter, torch's bfloat16 kernel",
            lambda: _ours_cpu(served, prompt_ids, args.new_tokens, t, cpu_kernel="bf16"),
        ),
        ("edge AWQ INT4 g128", lambda: _ours_cpu(awq128, prompt_ids, args.new_tokens, t)),
        ("edge float32", lambda: _ours_cpu(base, prompt_ids, args.new_tokens, t)),
    ]
    # One row at a time, each gone before the next loads: with every row's engine and
    # llama.cpp's server alive in the process at once, every row ran at about half its
    # speed (their idle threads compete). The first measurement of a row warms it up.
    for name, prepare in variants:
        try:
            once, info = prepare()
            rates = [once() for _ in range(args.rounds + 1)][1:]
            rows.append({"name": name, "decode_tok_s": statistics.median(rates), **info})
            del once, info
            gc.collect()
        except Exception as err:
            rows.append({"name": name, "error": f"{type(err).__name__}: {err}"})
    # Greedy agreement with the exact quantized model over held-out prompts, first 16
    # tokens: the reference is our float32 kernel on the served build (every weight exact
    # in float32), each row on that build against it.
    try:
        exact_rows: dict[str, dict[str, Any]] = {
            "edge AWQ INT4 g32 + clinic adapter (served)": {},
            "edge AWQ INT4 g32 + clinic adapter, our exact float32 kernel": {"cpu_kernel": "exact"},
            "edge AWQ INT4 g32 + clinic adapter, torch's bfloat16 kernel": {"cpu_kernel": "bf16"},
        }
        prompts = held_out_prompts(tokenizer)
        exact = load_engine(served, "cpu", threads=t, cpu_kernel="exact")
        exact.batcher.model.fused_decode = False  # op by op: not the C step the rows run
        reference = _greedy(exact, prompts)
        for r in rows:
            if r["name"] in exact_rows and "error" not in r:
                got = _greedy(load_engine(served, "cpu", threads=t, **exact_rows[r["name"]]), prompts)
                r["exact_agreement"] = agreement(reference, got)["token_agreement"]
    except Exception as err:
        rows.append({"name": "exact agreement", "error": f"{type(err).__name__}: {err}"})
    overhead: dict[str, Any]
    try:
        overhead = dict(_python_share(served, prompt_ids, args.threads))
    except Exception as err:
        overhead = {"error": f"{type(err).__name__}: {err}"}
    ref = next((r["decode_tok_s"] for r in rows if r["name"].startswith("llama.cpp") and "decode_tok_s" in r), None)
    for r in rows:
        if ref and "decode_tok_s" in r:
            r["vs_llamacpp"] = r["decode_tok_s"] / ref
    ours = [r for r in rows if "engine" not in r.get("engine_config", {"engine": None}) and "decode_tok_s" in r]
    served_rows = [r for r in ours if r.get("served")]
    return {
        "machine": platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (real weights)",
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "repeats": args.rounds,
        "agreement": f"exact_agreement: greedy tokens equal to the exact quantized model's (our float32 kernel on "
        f"the served build, its step op by op), first {AGREEMENT_TOKENS} of {AGREEMENT_PROMPTS} held-out prompts",
        "rows": rows,
        "awq_step_profile": overhead,
        # The served row's decode over the fastest edge row's: whether the shipped
        # default is the fast one.
        "served_over_fastest": (
            served_rows[0]["decode_tok_s"] / max(r["decode_tok_s"] for r in ours) if served_rows else None
        ),
    }


def print_cpu(result: dict[str, Any]) -> None:
    print(f"{result['model']}, {result['threads']} threads, {result['new_tokens']} new tokens")
    print(f"{'variant':<36} {'tok/s':>7} {'vs llama.cpp':>12}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['name']:<36} ERROR {r['error']}")
            continue
        vs = f"{r['vs_llamacpp']:.2f}x" if "vs_llamacpp" in r else "-"
        print(f"{r['name']:<36} {r['decode_tok_s']:>7.1f} {vs:>12}")
    prof = result.get("awq_step_profile", {})
    if "step_ms" in prof:
        print(
            f"served decode step: {prof['step_ms']:.1f} ms, {prof.get('in_c_step_ms', 0.0):.1f} ms in the C step, "
            f"{prof['in_torch_ops_ms']:.1f} ms inside {prof['ops_per_step']:.0f} torch operators, "
            f"{prof['python_share'] * 100:.0f}% in Python around them; op by op {prof.get('per_op_step_ms', 0):.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", choices=["cuda", "cpu"])
    parser.add_argument("--prompt", type=int, default=512, help="cuda: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", type=int, default=4096, help="cuda: KV cache tokens")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="cuda: per-process memory cap")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(CUDA_VARIANTS),
        choices=list(CUDA_VARIANTS),
        help="cuda: the served engine and the profile-field variants to measure (CUDA_VARIANTS)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="cuda: where the random checkpoints are written (a temporary folder)"
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true", help="cuda: no per-shape kernel timings outside graphs")
    parser.add_argument(
        "--llamacpp-src",
        type=Path,
        help="cuda: the trimmed llama.cpp source tarball (bench/llamacpp_peer.py trim): build and run llama-bench",
    )
    parser.add_argument("--llamacpp-work", type=Path, default=Path("/tmp/edge-llamacpp"), help="its build directory")
    parser.add_argument("--llamacpp-jobs", type=int, default=16)
    parser.add_argument(
        "--batch", nargs="*", type=int, default=[1, 2, 4, 8], help="cuda: sequences decoded together by the batcher"
    )
    parser.add_argument("--threads", type=int, default=2, help="cpu: threads for every variant")
    parser.add_argument("--rounds", type=int, default=3, help="cpu: measurements of each row (the median)")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.out_path = args.out or RESULTS / f"text_{args.device}.json"
    if args.device == "cuda":
        result = run_cuda(args)
    else:
        result = run_cpu(args)
    out = args.out_path
    write_json(out, result)
    (print_cuda if args.device == "cuda" else print_cpu)(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
