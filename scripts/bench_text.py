#!/usr/bin/env python3
"""Text-branch speed and memory, against baselines measured in the same run.

    python scripts/bench_text.py cuda   # Llama-3-8B shape, random INT4 weights, 8 GiB cap
    python scripts/bench_text.py cpu    # SmolLM2-135M (real weights), 2 threads

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
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge.text.llama import KVCache, LlamaConfig  # noqa: E402
from engines.random_llama import LLAMA3_8B, int4_weight_bytes, random_int4_llama  # noqa: E402

GIB = 1 << 30


# ----------------------------------------------------------------------------- CUDA


def copy_bandwidth(nbytes: int = 4 * GIB) -> float:
    """Device-to-device copy, bytes read plus written per second (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return float(nbytes / statistics.median(times))


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


def ours_cuda(
    config: LlamaConfig, kernel: str, prompt_len: int, new_tokens: int, cache_len: int, bandwidth: float
) -> dict[str, Any]:
    from edge.text.cuda_graphs import GraphDecoder

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    variant = kernel
    per_op = kernel.endswith("+ops")
    kernel = kernel.removesuffix("+ops")
    model = random_int4_llama(config, "cuda", kernel)
    if per_op:
        model.fused_decode = False  # the torch per-op step around the same INT4 GEMVs
    cache = KVCache(config, 1, cache_len, torch.bfloat16, torch.device("cuda"))
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), device="cuda")

    def prefill() -> torch.Tensor:
        logits: torch.Tensor = model(ids, cache, 0)
        return logits[0, -1].argmax()

    ttft = cuda_time(prefill, repeat=10, warmup=3)
    decoder = GraphDecoder(model, cache)
    token = prefill().view(1)
    # Capture the buckets the timed run will use before timing it.
    for pos in range(prompt_len, prompt_len + new_tokens, decoder.bucket):
        decoder.step(token, pos)
    torch.cuda.synchronize()

    def decode() -> None:
        tok = token
        for pos in range(prompt_len, prompt_len + new_tokens):
            logits = decoder.step(tok, pos)
            tok = logits[0].argmax().view(1)
            int(tok)  # the host needs each token (EOS, stop strings, streaming)

    seconds = cuda_time(decode, repeat=3, warmup=1)
    tok_s = new_tokens / seconds
    weights = int4_weight_bytes(model) + 2 * config.hidden_size * (2 * config.num_layers + 1)
    kv_read = config.kv_bytes_per_token(torch.bfloat16) * (prompt_len + new_tokens // 2)
    bytes_per_token = weights + kv_read + config.hidden_size * 2
    roofline = bandwidth / bytes_per_token
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    return {
        "name": f"edge INT4 g128, {DECODE_NAMES[variant]}, CUDA graphs",
        "kernel": variant,
        "fused_decode": bool(model.fused_decode),
        "decode_tok_s": tok_s,
        "bytes_per_token": bytes_per_token,
        "roofline_tok_s": roofline,
        "roofline_fraction": tok_s / roofline,
        "ttft_ms": ttft * 1000,
        "peak_gib": peak / GIB,
        "peak_reserved_gib": reserved / GIB,
        "kv_cache_tokens": cache_len,
    }


DECODE_NAMES = {
    "triton": "fused Triton step",
    "triton+ops": "Triton GEMV + torch ops",
    "cuda": "torch tiled INT4 + torch ops",
}


def check_cuda(kernels: list[str]) -> dict[str, float]:
    """Relative error of each kernel's logits (prefill and graph decode) against the
    dequantize-then-matmul reference, on a small random model with the same weights."""
    config = LlamaConfig(
        vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
    )
    ids = torch.randint(0, config.vocab_size, (1, 40), device="cuda")
    ref_model = random_int4_llama(config, "cuda", "dequant", dtype=torch.float32, seed=3)
    ref_cache = KVCache(config, 1, 64, torch.float32, torch.device("cuda"))
    ref = ref_model(ids, ref_cache, 0, last_only=False)[0]
    errors: dict[str, float] = {}
    for kernel in kernels:
        from edge.text.cuda_graphs import GraphDecoder

        model = random_int4_llama(config, "cuda", kernel.removesuffix("+ops"), seed=3)
        model.fused_decode = False if kernel.endswith("+ops") else None
        cache = KVCache(config, 1, 64, torch.bfloat16, torch.device("cuda"))
        got = model(ids[:, :32], cache, 0, last_only=False)[0]
        errors[f"{kernel}_prefill"] = float((got - ref[:32]).norm() / ref[:32].norm())
        decoder = GraphDecoder(model, cache, bucket=16)
        worst = 0.0
        for pos in range(32, 40):
            step = decoder.step(ids[0, pos : pos + 1], pos)[0]
            worst = max(worst, float((step - ref[pos]).norm() / ref[pos].norm()))
        errors[f"{kernel}_graph_decode"] = worst
    return errors


GEMV_LABELS = ("triton_bits", "stock_int4")

KERNEL_SHAPES = {  # (N, K) of the 8B model's INT4 matrices, and how many per token
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}


def _bench_shape(n: int, k: int, gen: torch.Generator) -> dict[str, Any]:
    from triton.testing import do_bench

    from edge.text.int4 import Int4Linear
    from edge.text.triton_int4 import int4_dequant, int4_gemv
    from engines.random_llama import random_quantized

    q = random_quantized(n, k, 128, torch.device("cuda"), gen)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    stock = Int4Linear(q, "cuda")
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    fns: dict[str, Callable[[], Any]] = {
        "triton_bits": lambda: int4_gemv(x, q.qweight, q.scales, q.zeros, 128),
        "stock_int4": lambda: stock(x),
        "bf16_cublas": lambda: x @ dense.T,
        "dequant_bf16": lambda: int4_dequant(q.qweight, q.scales, q.zeros, 128, torch.bfloat16),
    }
    entry: dict[str, Any] = {"n": n, "k": k, "int4_bytes": q.nbytes}
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


def run_cuda(args: argparse.Namespace) -> dict[str, Any]:
    config = LLAMA3_8B
    props = torch.cuda.get_device_properties(0)
    checks = check_cuda(args.kernels)
    print("kernel checks (relative error vs float reference):", json.dumps(checks))
    if any(not (e < 2e-2) for e in checks.values()):
        raise SystemExit("a kernel disagrees with the reference; not timing it")
    spin_up()
    bandwidth = copy_bandwidth()
    kernels = bench_kernels()
    _release()
    print("per-token time in INT4 linears (ms):", json.dumps(kernels["per_token_linear_ms"]))
    for name in KERNEL_SHAPES:
        e = kernels[name]
        print(
            f"  {name:<8} N={e['n']:<6} K={e['k']:<6} "
            + " ".join(f"{lab}={e[lab]['us']:.1f}us/{e[lab]['gb_s']:.0f}GB/s" for lab in e if isinstance(e[lab], dict))
        )
    rows: list[dict[str, Any]] = []
    if not args.skip_baseline:
        rows.append(hf_baseline(config, args.prompt, args.new_tokens))
        _release()
    cap = args.cap_gib * GIB / props.total_memory
    torch.cuda.set_per_process_memory_fraction(cap)
    for kernel in args.kernels:
        spin_up(1.0)
        try:
            rows.append(ours_cuda(config, kernel, args.prompt, args.new_tokens, args.cache, bandwidth))
        except Exception as err:  # report a failing variant, keep measuring the others
            rows.append({"name": f"edge INT4 ({kernel})", "error": f"{type(err).__name__}: {err}"})
        _release()
    return {
        "device": props.name,
        "torch": torch.__version__,
        "kernel_checks": checks,
        "kernels": kernels,
        "shape": "Llama-3-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256), random weights",
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "memory_cap_gib": args.cap_gib,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def print_cuda(result: dict[str, Any]) -> None:
    bandwidth = result["copy_bandwidth_gb_s"]
    print(f"{result['device']}, copy bandwidth {bandwidth:.0f} GB/s, cap {result['memory_cap_gib']} GiB")
    print(f"{'variant':<46} {'tok/s':>7} {'roofline':>8} {'TTFT ms':>8} {'peak GiB':>8}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['name']:<46} ERROR {r['error']}")
            continue
        frac = f"{r['roofline_fraction'] * 100:.0f}%" if "roofline_fraction" in r else "-"
        print(f"{r['name']:<46} {r['decode_tok_s']:>7.1f} {frac:>8} {r['ttft_ms']:>8.1f} {r['peak_gib']:>8.2f}")


# ----------------------------------------------------------------------------- CPU


CPU_PROMPT = "Explain in a few sentences why hand hygiene matters in a hospital ward."


def _ours_cpu(path: Path, prompt_ids: list[int], new_tokens: int, repeat: int) -> dict[str, Any]:
    from edge.text.checkpoint import load_checkpoint
    from edge.text.generate import SamplingParams, generate

    ckpt = load_checkpoint(path)
    cache = ckpt.model.new_cache(1, len(prompt_ids) + new_tokens + 1)
    rates = []
    for _ in range(repeat + 1):
        out = generate(
            ckpt.model, ckpt.tokenizer, prompt_ids, SamplingParams(max_new_tokens=new_tokens), frozenset(), cache
        )
        rates.append(out.tokens_per_s)
    return {"decode_tok_s": statistics.median(rates[1:]), "int4_kernel": ckpt.int4_kernel}


def _python_share(path: Path, prompt_ids: list[int], steps: int = 32) -> dict[str, float]:
    """Where a CPU decode step's time goes: inside torch operators (kernels and their
    dispatch) versus the Python around them, measured with torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    from edge.text.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path)
    model = ckpt.model
    cache = model.new_cache(1, len(prompt_ids) + steps + 1)
    ids = torch.tensor([prompt_ids])
    model(ids, cache, 0)
    token = torch.tensor([[prompt_ids[-1]]])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            model(token, cache, len(prompt_ids) + i)
        wall = time.perf_counter() - t0
    # Top-level operator calls: self times of every aten op, summed, is time spent in torch.
    in_ops = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")) / 1e6
    return {
        "step_ms": wall / steps * 1000,
        "in_torch_ops_ms": in_ops / steps * 1000,
        "python_share": max(0.0, 1 - in_ops / wall),
        "ops_per_step": sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps,
    }


def _hf_cpu(gguf: Path, prompt_ids: list[int], new_tokens: int, repeat: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    rates = []
    with torch.inference_mode():
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            t2 = time.perf_counter()
            rates.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return {"decode_tok_s": statistics.median(rates[1:])}


def _llamacpp_cpu(gguf: Path, prompt: str, new_tokens: int, threads: int) -> dict[str, Any]:
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(gguf)
    params.prompt = prompt
    params.n_predict = new_tokens
    params.n_ctx = 512
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.sampling.temp = 0.0
    server = xlc.Server(params)
    body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True}
    rates = []
    for _ in range(4):
        res = server.handle_completions(body)
        rates.append(float(res["timings"]["predicted_per_second"]))
    return {"decode_tok_s": statistics.median(rates[1:])}


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    from edge.text.checkpoint import load_checkpoint
    from edge.text.qa import chatml
    from engines.import_gguf import import_smollm2, smollm2_gguf_path
    from engines.quantize import QuantRecipe
    from engines.text_build import quantize_checkpoint

    torch.set_num_threads(args.threads)
    base = import_smollm2(args.engine_dir)
    awq = quantize_checkpoint(base, QuantRecipe(method="awq"))
    tokenizer = load_checkpoint(base).tokenizer
    prompt = chatml("You are a helpful assistant.", CPU_PROMPT)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    gguf = smollm2_gguf_path()
    rows: list[dict[str, Any]] = []
    variants: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("llama.cpp (xllamacpp, same GGUF)", lambda: _llamacpp_cpu(gguf, prompt, args.new_tokens, args.threads)),
        ("transformers FP32 generate", lambda: _hf_cpu(gguf, prompt_ids, args.new_tokens, 2)),
        ("edge float32", lambda: _ours_cpu(base, prompt_ids, args.new_tokens, 3)),
        ("edge AWQ INT4 g128", lambda: _ours_cpu(awq, prompt_ids, args.new_tokens, 3)),
    ]
    for name, fn in variants:
        try:
            rows.append({"name": name, **fn()})
        except Exception as err:
            rows.append({"name": name, "error": f"{type(err).__name__}: {err}"})
    overhead: dict[str, Any]
    try:
        overhead = dict(_python_share(awq, prompt_ids))
    except Exception as err:
        overhead = {"error": f"{type(err).__name__}: {err}"}
    ref = next((r["decode_tok_s"] for r in rows if r["name"].startswith("llama.cpp") and "decode_tok_s" in r), None)
    for r in rows:
        if ref and "decode_tok_s" in r:
            r["vs_llamacpp"] = r["decode_tok_s"] / ref
    return {
        "machine": platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (real weights)",
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "rows": rows,
        "awq_step_profile": overhead,
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
            f"AWQ INT4 decode step: {prof['step_ms']:.1f} ms, {prof['in_torch_ops_ms']:.1f} ms inside "
            f"{prof['ops_per_step']:.0f} torch operators, {prof['python_share'] * 100:.0f}% in Python around them"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", choices=["cuda", "cpu"])
    parser.add_argument("--prompt", type=int, default=512, help="cuda: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", type=int, default=4096, help="cuda: KV cache tokens")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="cuda: per-process memory cap")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=list(DECODE_NAMES),
        choices=list(DECODE_NAMES),
        help="cuda: decode variants to measure",
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="cpu: threads for every variant")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda":
        result = run_cuda(args)
    else:
        result = run_cpu(args)
    out = args.out or REPO / "bench" / "results" / f"text_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    (print_cuda if args.device == "cuda" else print_cpu)(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
