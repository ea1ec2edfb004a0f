#!/usr/bin/env python3
"""The INT4 GEMV's configuration space on the 8B model's matrices, timed inside CUDA graphs.

For each matrix kind of a Llama-3-8B decode step (qkv, o, gate_up, down, lm_head), COPIES
distinct random weights of that shape (more bytes than the L2 holds, as a step streams
them) are multiplied by one activation row in a captured graph, once with the tuner's own
choice and once with every configuration of a wider space (tile rows, words per tile,
split-K, warps, pipeline stages). Every configuration's result is checked against the
dequantized float product first. It shows whether the tuner's space, and not the kernel,
limits the bandwidth a GEMV reaches.

    python -m bench.sweep_gemv [--budget-s 200]

Writes bench/results/gemv_sweep_cuda.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, write_json
from bench.text import cuda_time
from edge.text.ops.triton.triton_int4 import counter_size, int4_dequant, int4_gemv, max_split
from engines.text.random_llama import LLAMA3_8B, random_quantized

GROUP = 128


def shapes() -> dict[str, tuple[int, int]]:
    c = LLAMA3_8B
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def graph_seconds(fn: Any, repeat: int = 20) -> float:
    """Median seconds of one replay of `fn` captured as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, repeat=repeat, warmup=3)


def space(n: int) -> list[dict[str, int]]:
    splits = [s for s in (1, 2, 4, 8) if s <= max_split(n)]
    return [
        {"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": sk, "num_warps": w, "num_stages": st}
        for bn, bw, sk, w, st in itertools.product((8, 16, 32, 64), (32, 64, 128), splits, (4, 8), (1, 3))
    ]


def merge(paths: list[Path], out: Path) -> None:
    """One result from several sweeps (runs that each swept some kinds within a budget):
    a kind's entry is taken from the last file whose sweep of it timed configurations."""
    merged: dict[str, Any] = {"shapes": {}, "merged_from": []}
    for path in paths:
        part = json.loads(path.read_text())
        merged["device"], merged["copies"] = part["device"], part["copies"]
        merged["merged_from"].append({"file": path.name, "seconds": part.get("seconds")})
        for kind, entry in part["shapes"].items():
            if entry.get("best") is not None or kind not in merged["shapes"]:
                merged["shapes"][kind] = entry
    merged["shapes"] = {kind: merged["shapes"][kind] for kind in shapes() if kind in merged["shapes"]}
    write_json(out, merged, indent=1)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="distinct weights per matrix kind")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping after this long")
    parser.add_argument("--kinds", nargs="+", choices=list(shapes()), help="only these matrix kinds")
    parser.add_argument(
        "--merge", nargs="+", type=Path, help="combine earlier sweeps' results (each kind from the last that swept it)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "gemv_sweep_cuda.json")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    started = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copies": args.copies, "shapes": {}}
    for kind, (n, k) in shapes().items():
        if args.kinds and kind not in args.kinds:
            continue
        copies = 1 if kind == "lm_head" else args.copies  # one lm_head alone is 0.27 GB, past the L2
        weights = [random_quantized(n, k, GROUP, torch.device("cuda"), gen) for _ in range(copies)]
        nbytes = sum(w.nbytes for w in weights)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w0 = weights[0]
        ref = (x.float() @ int4_dequant(w0.qweight, w0.scales, w0.zeros, GROUP, torch.float32).T)[0]

        # Kept between calls, as serving keeps them: no zeroing kernel per product.
        counters = torch.zeros(counter_size(8, n), device="cuda", dtype=torch.int32)

        def run(
            config: dict[str, int] | None, ws: list[Any] = weights, x: torch.Tensor = x, c: torch.Tensor = counters
        ) -> Any:
            return lambda: [int4_gemv(x, w.qweight, w.scales, w.zeros, GROUP, config, c) for w in ws]

        tuned = graph_seconds(run(None))
        entry: dict[str, Any] = {"n": n, "k": k, "bytes_each": nbytes // copies, "copies": copies}
        entry["tuned"] = {"us": tuned / copies * 1e6, "gb_s": nbytes / tuned / 1e9}
        tried: list[dict[str, Any]] = []
        for config in space(n):
            if time.perf_counter() - started > args.budget_s:
                entry["cut_short"] = True
                break
            try:
                got = int4_gemv(x, w0.qweight, w0.scales, w0.zeros, GROUP, config, counters)[0]
                err = float((got - ref).norm() / ref.norm())
                if not err < 1e-3:
                    tried.append({**config, "error": f"relative error {err:.2e}"})
                    continue
                seconds = graph_seconds(run(config), repeat=10)
            except Exception as exc:  # resources a configuration cannot have (shared memory, registers)
                tried.append({**config, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            tried.append({**config, "us": seconds / copies * 1e6, "gb_s": nbytes / seconds / 1e9})
        timed = [t for t in tried if "us" in t]
        entry["best"] = min(timed, key=lambda t: float(t["us"])) if timed else None
        entry["configs"] = tried
        result["shapes"][kind] = entry
        best = entry["best"]
        print(
            f"{kind:<8} N={n:<6} K={k:<6} tuned {entry['tuned']['us']:7.1f} us {entry['tuned']['gb_s']:6.0f} GB/s"
            + (f" | best {best['us']:7.1f} us {best['gb_s']:6.0f} GB/s {best}" if best else "")
            + f" ({len(timed)}/{len(tried)} configs)",
            flush=True,
        )
        del weights
        torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - started
    write_json(args.out, result, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
