"""Decode attention alone, on the 8B shape: our CUDA C kernels against the Triton ones, in one run.

The whole-step figures (bench.jetson_proxy) say how far the path without Triton is from
the Triton path; this says how much of it is the attention, and for which cache format.
For each context and each cache (float16, and the int8 and int4 formats the engine
serves), 32 layers' caches are filled with random tokens and one step's attention, a call
per layer (one sequence, 32 query heads over 8 KV heads of 128 channels), is captured in
a CUDA graph and replayed; each row is the time of one call, with the splits the kernel
chose (Triton's quantized kernels choose theirs inside and are not recorded) and, for
ours, which kernel ran (the tensor-core one or the scalar one, and why). These are
the kernels alone, not an engine: the served step's figures are bench.text's and
bench.jetson_proxy's. Our kernels are built for the architecture EDGE_CUDA_ARCH names
(compute_80: the Jetson proxy's Ampere PTX) or this GPU's.

    python -m bench.attention_kernels [--contexts 512 4096] [--spreads 1 2 4 8]
        [--out bench/results/attention_kernels.json]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import text
from bench.common import RESULTS, write_json
from edge.text.architecture import LlamaConfig
from edge.text.kv.kv_quant import FORMATS, KVDtype
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.ops.attention_splits import attn_splits
from edge.text.ops.cuda import cuda_build, decode_ops, kv_ops
from edge.text.runtime import cuda_graphs

# The 8B shape's attention (Llama 3 8B): 32 query heads over 8 KV heads of 128 channels.
SHAPE = LlamaConfig(
    vocab_size=256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=256
)
REPLAYS = 50

Call = Callable[[int], torch.Tensor]  # one layer's attention


def _time_step(call: Call, layers: int) -> float:
    """Microseconds a call: one step's calls (a call per layer) captured as the engine
    captures its step (cuda_graphs.capture: warm-up and capture on one side stream, where
    the split counters are made) and replayed, the median of REPLAYS."""

    def step() -> torch.Tensor:
        for layer in range(layers - 1):
            call(layer)
        return call(layers - 1)

    graph, _ = cuda_graphs.capture(step, None)
    return text.cuda_time(graph.replay, repeat=REPLAYS) * 1e6 / layers


def float_rows(context: int, device: torch.device, sms: int, spreads: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """float16 caches: our attention and Triton's over the same tensors; ours also split
    for each of `spreads` blocks an SM (rows with `spread`: the split rule's choice timed)."""
    cfg, layers = SHAPE, SHAPE.num_layers
    shape = (1, cfg.num_kv_heads, context + 64, cfg.head_dim)
    caches = [
        (torch.randn(shape, device=device, dtype=torch.float16), torch.randn(shape, device=device, dtype=torch.float16))
        for _ in range(layers)
    ]
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=device, dtype=torch.float16) * cfg.head_dim**-0.5
    pos = torch.tensor([context - 1], device=device)
    rows = []
    splits, chunk = decode_ops.attention_splits(context, cfg.num_kv_heads, sms)
    ours: Call = lambda i: decode_ops.decode_attention(q, *caches[i], pos, context, sms)  # noqa: E731
    kernel = decode_ops.attention_kernel(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    rows.append(_row("cuda", "float16", context, _time_step(ours, layers), splits, chunk, kernel))
    for spread in spreads:
        splits, chunk = decode_ops.attention_splits(context, cfg.num_kv_heads, sms, spread)

        def tried(i: int, s: int = spread) -> torch.Tensor:
            return decode_ops.decode_attention(q, *caches[i], pos, context, sms, spread=s)

        row = _row("cuda", "float16", context, _time_step(tried, layers), splits, chunk, kernel)
        rows.append({**row, "spread": spread, "served": spread == decode_ops.ATTN_SPREAD})
    try:
        from edge.text.ops.triton import decode_ops as triton_ops
    except ImportError:
        return rows
    splits, chunk = attn_splits(context, cfg.num_kv_heads, sms)
    theirs: Call = lambda i: triton_ops.decode_attention(q, *caches[i], pos, context, sms)  # noqa: E731
    rows.append(_row("triton", "float16", context, _time_step(theirs, layers), splits, chunk))
    return rows


def quant_rows(
    context: int, kv_dtype: KVDtype, device: torch.device, sms: int, spreads: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """A quantized cache (the served format of `kv_dtype`), filled by its prefill store:
    our attention and Triton's over the same layers."""
    cfg, fmt = SHAPE, FORMATS[kv_dtype]
    cache = QuantKVCache(cfg, 1, context + 64, fmt, torch.float16, device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
    for i in range(cfg.num_layers):
        k = torch.randn(shape, device=device, dtype=torch.float16, generator=gen)
        v = torch.randn(shape, device=device, dtype=torch.float16, generator=gen)
        cache.layer(i).store(k, v, 0)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=device, dtype=torch.float16)
    pos = torch.tensor([context - 1], device=device)
    scale = cfg.head_dim**-0.5
    rows = []
    splits, chunk = kv_ops.attention_splits(context, cfg.num_kv_heads, sms)
    ours: Call = lambda i: kv_ops.attention(cache.layer(i), q, pos, context, scale)  # noqa: E731
    kernel = kv_ops.attention_kernel(fmt, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
    rows.append(_row("cuda", kv_dtype, context, _time_step(ours, cfg.num_layers), splits, chunk, kernel))
    for spread in spreads:
        splits, chunk = kv_ops.attention_splits(context, cfg.num_kv_heads, sms, spread)

        def tried(i: int, s: int = spread) -> torch.Tensor:
            return kv_ops.attention(cache.layer(i), q, pos, context, scale, spread=s)

        row = _row("cuda", kv_dtype, context, _time_step(tried, cfg.num_layers), splits, chunk, kernel)
        rows.append({**row, "spread": spread, "served": spread == kv_ops.KV_SPREAD})
    try:
        from edge.text.ops.triton import triton_kv
    except ImportError:
        return rows
    theirs: Call = lambda i: triton_kv.attention(cache.layer(i), q, pos, context, scale)  # noqa: E731
    rows.append(_row("triton", kv_dtype, context, _time_step(theirs, cfg.num_layers), None, None))
    return rows


def _row(
    kernels: str,
    kv_dtype: str,
    context: int,
    us: float,
    splits: int | None,
    chunk: int | None,
    kernel: str | None = None,
) -> dict[str, Any]:
    """A row; `kernel`: which of our attention kernels ran (decode_ops/kv_ops.attention_kernel)."""
    row = {"kernels": kernels, "kv_dtype": kv_dtype, "context": context, "us_per_layer": us}
    if splits is not None:
        row.update(splits=splits, chunk=chunk)
    if kernel is not None:
        row["kernel"] = kernel
    print(f"  {kernels:6} {kv_dtype:7} {context:6} tokens: {us:7.2f} us a layer", flush=True)
    return row


def measure(contexts: list[int], formats: list[KVDtype], spreads: tuple[int, ...] = ()) -> dict[str, Any]:
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    rows: list[dict[str, Any]] = []
    for context in contexts:
        if "float16" in formats:
            rows += float_rows(context, device, props.multi_processor_count, spreads)
        for kv_dtype in (f for f in formats if f != "float16"):
            rows += quant_rows(context, kv_dtype, device, props.multi_processor_count, spreads)
    triton = {(r["kv_dtype"], r["context"]): r for r in rows if r["kernels"] == "triton"}
    ratios = {
        f"{r['kv_dtype']}_{r['context']}": triton[r["kv_dtype"], r["context"]]["us_per_layer"] / r["us_per_layer"]
        for r in rows
        if r["kernels"] == "cuda" and "spread" not in r and (r["kv_dtype"], r["context"]) in triton
    }
    return {
        "device": props.name,
        "cuda_arch": os.environ.get("EDGE_CUDA_ARCH") or cuda_build.device_arch(device),
        "shape": {
            "heads": SHAPE.num_heads,
            "kv_heads": SHAPE.num_kv_heads,
            "head_dim": SHAPE.head_dim,
            "layers": SHAPE.num_layers,
        },
        "batch": 1,
        "rows": rows,
        "triton_over_cuda": ratios,  # above 1: ours faster
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument(
        "--spreads",
        type=int,
        nargs="*",
        default=[],
        help="also time our attention split for each of these blocks an SM (decode_ops.ATTN_SPREAD's and "
        "kv_ops.KV_SPREAD's choices)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_kernels.json")
    args = parser.parse_args()
    if any(s < 1 for s in args.spreads):
        parser.error("--spreads: each at least 1")
    result = measure(args.contexts, args.formats, tuple(args.spreads))
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
