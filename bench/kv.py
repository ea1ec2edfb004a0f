#!/usr/bin/env python3
"""KV-cache memory: what quantized KV costs in quality and speed and gains in capacity,
and what lossless coding gets from real keys and values.

Every model is the engine the daemon builds from the shipped profile of its device
(bench/text_engines.py), with models.qa.kv_dtype and the fields a part measures changed
(each part records its engine's configuration). On the CPU, SmolLM2-135M-Instruct (real
weights, float32), on held-out text (the Python reference topics of the evaluation
split), every figure through the cache the daemon serves (edge/text/kv/quant_cache.py
and the attention kernels that read its codes, edge/text/kv/kv_attention.py):
- perplexity with each KV format, the text read in chunks of 64 tokens: each chunk
  attends to the earlier ones as the cache holds them (codes, and the float ring of the
  newest) and to its own in float, as chunked prefill does; the delta is against the
  float cache (the activations' type);
- greedy agreement (the served formats): continuations decoded together by the engine's
  batcher over each format's cache, against the float cache's;
- capacity: the tokens the shipped jetson-orin profile's KV pool (its max_sequences rows
  of max_context_tokens float16 tokens) holds in each format, counted from the caches as
  allocated (edge/text/kv/kv_capacity.py), and the same for one 4K row;
- lossless codecs (lz4, delta + lz4, byte-shuffle + lz4 or zstd) on the float16 cache of
  the same text, each checked to give back every byte;
- chunked prefill: the time between the tokens of two decoding sequences while a
  2048-token prompt joins them, prefilled whole and a chunk per step.

On CUDA (--only cuda): decode speed at 4K context of an 8B-shaped INT4 checkpoint
(random weights: speed only, quantized at the group size `edgectl build` uses) in the
served engine, CUDA graphs and all, with float16, int8 and int4 KV in the same run;
merged into the rows by kv_dtype.

Writes bench/results/kv.json and prints a table.

    python -m bench.kv [--max-tokens 8192] [--threads 2] [--only chunked|cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import REPO, RESULTS, agreement, perplexity, write_json
from bench.text_engines import engine_fields, fixed, load_engine
from edge.text.architecture import LlamaConfig
from edge.text.engine import TextEngine
from edge.text.kv.float_cache import KVCache
from edge.text.kv.kv_capacity import cache_bytes, longest_rows
from edge.text.kv.kv_quant import FORMATS, KVDtype, KVFormat
from edge.text.model.llama import LlamaModel
from engines.text.corpus import corpus_fingerprint, evaluation_text
from engines.text.import_gguf import import_smollm2

CONTEXT = 1024  # tokens per perplexity window
CHUNK = 64  # tokens per step of the chunked read
SEED_CLAIM = {"codec": "LZ4 + delta coding", "ratio": 4.8}
PROFILE = REPO / "profiles" / "jetson-orin.yaml"  # whose KV pool the capacity is counted in

# The shipped formats first (the rows the goals of docs/design/kv-cache.md are read from), then other int4
# layouts measured beside them: what the shipped one was chosen against.
VARIANTS: list[tuple[KVDtype, KVFormat]] = [
    ("float16", FORMATS["float16"]),
    ("int8", FORMATS["int8"]),
    ("int4", FORMATS["int4"]),
    ("int4", replace(FORMATS["int4"], sink=0)),
    ("int4", KVFormat("int4", key_block=32, value_group=32, window=128)),
]


def describe(fmt: KVFormat) -> str:
    if fmt.dtype == "float16":
        return "float (the activations' type)"
    group = f"per {fmt.value_group} channels" if fmt.value_group else "per token"
    kind = "symmetric " if fmt.value_symmetric else ""
    window = f", newest {fmt.window} float" if fmt.window else ""
    sink = f", first {fmt.sink} float" if fmt.sink else ""
    return f"{fmt.dtype}, keys per channel per {fmt.key_block} tokens, {kind}values {group}{window}{sink}"


def shipped(fmt: KVFormat) -> bool:
    return FORMATS[fmt.dtype] == fmt


def profile_pool() -> tuple[int, int]:
    """The jetson-orin profile's KV pool: (rows, tokens per row)."""
    import yaml

    qa = yaml.safe_load(PROFILE.read_text(encoding="utf-8"))["models"]["qa"]
    return int(qa["max_sequences"]), int(qa["max_context_tokens"])


def _cache_format(fmt: KVFormat) -> KVFormat | None:
    return None if fmt.dtype == "float16" else fmt


def continuations(
    checkpoint: Path, prompts: list[list[int]], new_tokens: int, dtype: KVDtype
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy continuations decoded together by the served engine's batcher over
    `dtype`'s cache, and the engine's fields."""
    longest = max(len(p) for p in prompts) + new_tokens + 1
    engine = load_engine(
        checkpoint, "cpu", kv_dtype=dtype, max_sequences=len(prompts), max_context_tokens=max(64, longest)
    )
    seqs = engine.batcher.run_all([engine.sequence(p, fixed(new_tokens), i) for i, p in enumerate(prompts)])
    return [s.tokens for s in seqs], engine_fields(engine)


def capacity(config: LlamaConfig, fmt: KVFormat) -> dict[str, float]:
    """Tokens the profile's pool holds in `fmt` (rows as long as fit) against float16, and
    the bytes of one 4K row against float16's."""
    rows, row_tokens = profile_pool()
    half = torch.float16
    pool = cache_bytes(config, FORMATS["float16"], rows, row_tokens, half)
    longest = longest_rows(config, fmt, rows, pool, half)
    return {
        "bytes_per_token": cache_bytes(config, fmt, rows, row_tokens, half) / (rows * row_tokens),
        "capacity_ratio": longest / row_tokens,
        "capacity_tokens": rows * longest,
        "capacity_ratio_4k": cache_bytes(config, FORMATS["float16"], 1, 4096, half)
        / cache_bytes(config, fmt, 1, 4096, half),
    }


def _shuffle(raw: bytes) -> bytes:
    """Float16 values' bytes as two planes, the high bytes (sign, exponent) together."""
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2)
    return bytes(a.T.copy().tobytes())


def _delta(raw: bytes, width: int) -> bytes:
    """Each token's 16-bit patterns minus the previous token's (rows of `width` values)."""
    a = np.frombuffer(raw, dtype=np.uint16).reshape(-1, width)
    out = a.copy()
    out[1:] = a[1:] - a[:-1]  # modulo 2^16: exactly invertible
    return bytes(out.tobytes())


def codecs(kv: list[bytes], width: int) -> list[dict[str, Any]]:
    import lz4.frame
    import zstandard

    zc3, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    zc19 = zstandard.ZstdCompressor(level=19)

    def unshuffle(data: bytes) -> bytes:
        a = np.frombuffer(data, dtype=np.uint8).reshape(2, -1)
        return bytes(a.T.copy().tobytes())

    def undelta(data: bytes) -> bytes:
        a = np.frombuffer(data, dtype=np.uint16).reshape(-1, width)
        return bytes(np.cumsum(a, axis=0, dtype=np.uint16).tobytes())

    table: list[tuple[str, Callable[[bytes], bytes], Callable[[bytes], bytes]]] = [
        ("lz4", lz4.frame.compress, lz4.frame.decompress),
        ("delta + lz4", lambda b: lz4.frame.compress(_delta(b, width)), lambda c: undelta(lz4.frame.decompress(c))),
        ("zstd -3", zc3.compress, zd.decompress),
        (
            "byte-shuffle + lz4",
            lambda b: lz4.frame.compress(_shuffle(b)),
            lambda c: unshuffle(lz4.frame.decompress(c)),
        ),
        ("byte-shuffle + zstd -3", lambda b: zc3.compress(_shuffle(b)), lambda c: unshuffle(zd.decompress(c))),
        ("byte-shuffle + zstd -19", lambda b: zc19.compress(_shuffle(b)), lambda c: unshuffle(zd.decompress(c))),
    ]
    raw_bytes = sum(len(b) for b in kv)
    rows = []
    for name, compress, decompress in table:
        t0 = time.perf_counter()
        packed = [compress(b) for b in kv]
        t1 = time.perf_counter()
        back = [decompress(p) for p in packed]
        t2 = time.perf_counter()
        if back != kv:
            raise SystemExit(f"{name} did not give back the bytes it was given")
        size = sum(len(p) for p in packed)
        rows.append(
            {
                "name": name,
                "ratio": raw_bytes / size,
                "compress_mb_s": raw_bytes / 1e6 / (t1 - t0),
                "decompress_mb_s": raw_bytes / 1e6 / (t2 - t1),
            }
        )
        print(f"  {name:<24} {rows[-1]['ratio']:.3f}x", flush=True)
    return rows


def real_kv(model: LlamaModel, ids: list[int]) -> list[bytes]:
    """The float16 keys and values of `ids` read in one window: one buffer per layer and
    kind ([heads, tokens, head size], as the cache lays them out)."""
    cache = model.new_cache(1, len(ids), window_sized=False)  # every position of every layer
    assert isinstance(cache, KVCache)
    for c in range(0, len(ids), 512):
        with torch.inference_mode():
            model(torch.tensor([ids[c : c + 512]]), cache, c)
    out = []
    for layer in range(model.config.num_layers):
        for t in cache.layer(layer):
            # Token-major ([tokens, heads * head size]): a token's values together, as an
            # offloaded row is written, and what delta coding along tokens needs.
            out.append(t[0].transpose(0, 1).contiguous().to(torch.float16).numpy().tobytes())
    return out


def chunked_prefill(
    checkpoint: Path, device: str, ids: list[int], long_tokens: int, chunks: tuple[int, ...]
) -> dict[str, Any]:
    """Two sequences decode; a `long_tokens` prompt joins; the gaps between their tokens
    from its arrival to its first token, for each prefill chunk (0: the whole prompt;
    models.qa.prefill_chunk), each in its own engine, warmed up as the daemon's is."""
    rows = []
    long_prompt = ids[:long_tokens]
    shorts = [ids[long_tokens + 100 * i : long_tokens + 100 * i + 48] for i in range(2)]
    for chunk in chunks:
        engine = load_engine(
            checkpoint, device, max_sequences=3, max_context_tokens=long_tokens + 16, prefill_chunk=chunk
        )
        batcher = engine.batcher
        running = [engine.sequence(p, fixed(long_tokens), i) for i, p in enumerate(shorts)]
        for seq in running:
            slot = batcher.kv.allocate_slots(str(seq.owner), long_tokens + 16)
            assert slot is not None
            batcher.admit(seq, slot)
        for _ in range(8):  # both decoding at their pace before the prompt arrives
            batcher.step()
        joining = engine.sequence(long_prompt, fixed(4), "long")
        slot = batcher.kv.allocate_slots("long", long_tokens + 4)
        assert slot is not None
        arrived = time.perf_counter()
        batcher.admit(joining, slot)
        while not joining.tokens:
            batcher.step()
        first = joining.token_times[0]
        batcher.step()  # the step after: the gap that ends once the prompt is in
        gaps = []
        for seq in running:
            times = seq.token_times
            gaps += [(b - a) * 1000.0 for a, b in itertools.pairwise(times) if b > arrived and a <= first]
        before = [(b - a) * 1000.0 for seq in running for a, b in itertools.pairwise(seq.token_times[:8])]
        rows.append(
            {
                "prefill_chunk": chunk,
                "gap_p50_ms": float(np.percentile(gaps, 50)),
                "gap_p99_ms": float(np.percentile(gaps, 99)),
                "gap_max_ms": max(gaps),
                "gap_before_ms": float(np.median(before)),
                "ttft_ms": (first - arrived) * 1000.0,
                "gaps": len(gaps),
                **engine_fields(engine),
            }
        )
        print(
            f"  prefill chunk {chunk or 'whole':>5}: gaps p50 {rows[-1]['gap_p50_ms']:.0f} ms, "
            f"p99 {rows[-1]['gap_p99_ms']:.0f} ms (before {rows[-1]['gap_before_ms']:.0f} ms), "
            f"its first token after {rows[-1]['ttft_ms']:.0f} ms",
            flush=True,
        )
        del engine, batcher, running, joining
        _release(device)
    return {"prompt_tokens": long_tokens, "running": 2, "warmed": True, "rows": rows}


def decode_4k(
    checkpoint: Path, context: int, new_tokens: int, rounds: int = 5, profile: bool = False
) -> list[dict[str, Any]]:
    """Decode tok/s of one sequence after `context` prompt tokens, in the served engine
    (CUDA graphs, the fused step), for each shipped KV format: one engine each, all held
    at once. The formats take turns, round after round, so that a slow spell of the
    machine falls on all of them alike; each one's figure is the median of its rounds
    after a first that builds what is left to build. With `profile`, each format's
    in-graph kernel profile at that context too (bench.text.graph_profile), so a gap
    between formats is named by kernel."""
    dtypes: tuple[KVDtype, ...] = ("float16", "int8", "int4")
    engines = {
        dtype: load_engine(
            checkpoint, "cuda", kv_dtype=dtype, max_sequences=1, max_context_tokens=context + new_tokens + 1
        )
        for dtype in dtypes
    }
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, engines["float16"].model.config.vocab_size, (context,), generator=gen).tolist()
    rates: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for _ in range(rounds + 1):
        for dtype in dtypes:
            seq = engines[dtype].generate(prompt, fixed(new_tokens))
            times = seq.token_times
            rates[dtype].append((len(times) - 1) / (times[-1] - times[0]))
    rows = []
    for dtype in dtypes:
        rows.append(
            {
                "kv_dtype": dtype,
                "decode_tok_s_4k": float(np.median(rates[dtype][1:])),
                "decode_runs_tok_s": rates[dtype],
                "kv_cache_bytes": engines[dtype].kv_cache_bytes,
                **engine_fields(engines[dtype]),
            }
        )
        print(f"  {dtype:<8} {rows[-1]['decode_tok_s_4k']:.1f} tok/s at {context} tokens of context", flush=True)
    if profile:
        from bench import text

        bandwidth = text.copy_bandwidth()
        for row in rows:
            row["graph_profile"] = text.graph_profile(engines[row["kv_dtype"]], prompt, bandwidth)
    del engines
    _release("cuda")
    return rows


def _attention_at(config: LlamaConfig, context: int, with_rope: bool) -> dict[str, float]:
    """Microseconds of each kernel at `context` (see attention_kernels)."""
    import triton

    from edge.text.kv.quant_cache import QuantKVCache
    from edge.text.ops.triton import decode_ops, triton_kv

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    length = context + 64
    pos = torch.tensor([context + 5], device=dev)  # not a step that codes a key block
    q = torch.randn(1, nh, hd, device=dev, dtype=torch.bfloat16)
    flo = KVCache(config, 1, length, torch.bfloat16, dev)
    flo.k.normal_()
    flo.v.normal_()
    layers = {}
    for dtype in ("int8", "int4"):
        cache = QuantKVCache(config, 1, length, FORMATS[dtype], torch.bfloat16, dev)
        for t in (cache.k_codes, cache.v_codes):
            t.random_(0, 100)
        for t in (
            cache.k_scale,
            cache.v_scale,
            cache.k_zero,
            cache.v_zero,
            cache.ring_k,
            cache.ring_v,
            cache.sink_k,
            cache.sink_v,
        ):
            t.normal_()
        layers[dtype] = cache.layer(0)
    runs: dict[str, Callable[[], Any]] = {
        "float16": lambda: decode_ops.decode_attention(q, flo.k[0], flo.v[0], pos, length, sms),
        "int8": lambda: triton_kv.attention(layers["int8"], q, pos, length, 1.0),
        "int4": lambda: triton_kv.attention(layers["int4"], q, pos, length, 1.0),
    }
    if with_rope:
        qkv = torch.randn(1, (nh + 2 * nkv) * hd, device=dev, dtype=torch.bfloat16)
        cos = torch.randn(length + 64, hd // 2, device=dev)
        sin = torch.randn(length + 64, hd // 2, device=dev)
        due = torch.tensor([context], device=dev)  # the step on which a key block is coded
        runs["rope float16"] = lambda: decode_ops.rope_kv_write(qkv, cos, sin, pos, flo.k[0], flo.v[0], nh)
        runs["rope int8"] = lambda: triton_kv.rope_write(qkv, cos, sin, pos, layers["int8"], nh)
        runs["rope int8, block coded"] = lambda: triton_kv.rope_write(qkv, cos, sin, due, layers["int8"], nh)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for name, fn in runs.items():
            times[name].append(triton.testing.do_bench_cudagraph(fn, rep=200) * 1000.0)
    return {name: min(t) for name, t in times.items()}


def attention_kernels(config: LlamaConfig, contexts: tuple[int, ...] = (4096, 16384)) -> dict[str, Any]:
    """One layer's decode attention alone (split kernel and merge) for one sequence, per
    KV format, in CUDA graphs (triton's do_bench_cudagraph), the formats taking turns for
    three rounds, the fastest of each kept; and the rotary-and-write kernel, for int8 also
    on the step where a key block leaves the float ring and is coded (one step in 64).
    The caches hold random codes and scales: speed only."""
    from edge.text.ops.triton import triton_kv

    rows: list[dict[str, Any]] = []
    rope: dict[str, float] = {}
    for context in contexts:
        best = _attention_at(config, context, with_rope=context == contexts[0])
        row: dict[str, Any] = {"context": context, **{f"{d}_us": best[d] for d in ("float16", "int8", "int4")}}
        row.update({f"{d}_speed_ratio": best["float16"] / best[d] for d in ("int8", "int4")})
        rows.append(row)
        rope.update({name: us for name, us in best.items() if name.startswith("rope")})
        print(
            f"  attention at {context}: float16 {best['float16']:.2f} us, int8 {best['int8']:.2f} us "
            f"({row['int8_speed_ratio']:.2f}x), int4 {best['int4']:.2f} us ({row['int4_speed_ratio']:.2f}x)",
            flush=True,
        )
        torch.cuda.empty_cache()
    config8 = {
        "warps": triton_kv.ATTN8_WARPS,
        "stages": triton_kv.ATTN8_STAGES,
        "block_t": triton_kv.ATTN8_BLOCK_T,
        "spread": triton_kv.ATTN8_SPREAD,
        "maxnreg": triton_kv.ATTN8_MAXNREG,
    }
    return {"rows": rows, "rope_write_us": rope, "int8_config": config8}


def offload_figures(
    checkpoint: Path, device: str, ids: list[int], lengths: tuple[int, ...], directory: Path
) -> list[dict[str, Any]]:
    """A paused row of each length and KV format: saved to host memory and to a file
    (lz4 where it pays), restored from each, against prefilling it again, in the served
    engine's cache (the store as models.qa.kv_offload builds it, each place in turn)."""
    from edge.text.kv.kv_offload import KVOffload

    rows = []
    dtypes: tuple[KVDtype, ...] = ("float16", "int8", "int4")
    for dtype in dtypes:
        engine = load_engine(checkpoint, device, kv_dtype=dtype, max_sequences=2, max_context_tokens=max(lengths) + 1)
        batcher, model = engine.batcher, engine.model
        for length in lengths:
            chunk = torch.tensor([ids[:length]], device=batcher.device)
            recompute = []
            for _ in range(2):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model(chunk, batcher.cache.rows(0, 1), 0)
                _sync(batcher.device)
                recompute.append(time.perf_counter() - t0)
            figures: dict[str, Any] = {
                "kv_dtype": dtype,
                "tokens": length,
                "recompute_ms": min(recompute) * 1000,
                **engine_fields(engine),
            }
            for where in ("memory", "disk"):
                store = KVOffload(where, batcher.device, directory / "offload", max_memory_bytes=1 << 34)
                t0 = time.perf_counter()
                saved = store.save(batcher.cache, 0, length, None)
                assert saved is not None
                _sync(batcher.device)
                figures[f"save_{where}_ms"] = (time.perf_counter() - t0) * 1000
                if saved.written is not None:
                    saved.written.result()  # on the writer thread: off the serving path
                    figures["bytes"], figures["stored_bytes"] = saved.nbytes, saved.stored_bytes
                    figures["lz4_ratio"] = saved.nbytes / saved.stored_bytes
                t0 = time.perf_counter()
                store.restore(saved, batcher.cache, 1)
                figures[f"restore_{where}_ms"] = (time.perf_counter() - t0) * 1000
                store.close()
            figures["faster"] = "restore" if figures["restore_disk_ms"] < figures["recompute_ms"] else "recompute"
            rows.append(figures)
            print(
                f"  {dtype:<8} {length:>5} tokens, {figures['bytes'] / 2**20:6.2f} MiB "
                f"(lz4 {figures['lz4_ratio']:.2f}x):"
                f" restore {figures['restore_memory_ms']:.1f} ms from memory, {figures['restore_disk_ms']:.1f} ms "
                f"from disk; prefill again {figures['recompute_ms']:.0f} ms",
                flush=True,
            )
        del engine, batcher, model
        _release(device)
    return rows


def prefix_ttft(
    checkpoint: Path, device: str, document: list[int], questions: list[list[int]], repeat: int = 3
) -> dict[str, Any]:
    """Time to first token of prompts sharing a document: the first (a miss: the document
    prefilled and kept), the later ones (hits: the question alone), and the same prompts
    with no prefix cache (prefilled whole): two served engines, one with
    models.qa.prefix_cache_mib 1024 and one with it 0."""
    longest = len(document) + max(len(q) for q in questions) + 8
    cached_engine, plain_engine = (
        load_engine(checkpoint, device, max_sequences=1, max_context_tokens=longest, prefix_cache_mib=mib)
        for mib in (1024, 0)
    )
    cached = cached_engine.batcher

    def ttft(engine: TextEngine, question: list[int]) -> float:
        t0 = time.perf_counter()
        seq = engine.generate(document + question, fixed(1), "q", prefix=len(document))
        return (seq.token_times[0] - t0) * 1000

    for question in questions[:1]:  # warm: kernels built, nothing kept
        ttft(plain_engine, question)
    cold, warm, whole = [], [], []
    for _ in range(repeat):
        assert cached.prefix_cache is not None
        cached.prefix_cache.clear()
        cold.append(ttft(cached_engine, questions[0]))
        warm += [ttft(cached_engine, q) for q in questions[1:]]
        whole += [ttft(plain_engine, q) for q in questions]
    snap = cached.prefix_cache.snapshot() if cached.prefix_cache is not None else {}
    assert cached.prefix_cache is not None
    return {
        # Whether the batcher still splits such prompts once it has measured both
        # prefill rates (a hit must cost at most half a whole prefill).
        "split": cached.prefix_cache.worth(len(document), len(questions[0])),
        "warmed": True,  # the batchers warmed up first, the chunk after cached tokens included
        # Declined splits the batcher made all the same, to measure a hit again (recheck.py).
        "rechecked": snap.get("rechecked", 0),
        # The batcher's fitted costs (fixed ms + ms a token) of a hit's chunk and a whole prefill.
        **{key: snap.get(key) for key in ("hit_fixed_ms", "hit_ms_per_token", "whole_fixed_ms", "whole_ms_per_token")},
        "document_tokens": len(document),
        "question_tokens": [len(q) for q in questions],
        "ttft_cold_ms": float(np.median(cold)),
        "ttft_warm_ms": float(np.median(warm)),
        "ttft_uncached_ms": float(np.median(whole)),
        "speedup": float(np.median(cold) / np.median(warm)),
        "entry_bytes": snap.get("bytes", 0),
        **engine_fields(cached_engine),
    }


def cpu_offload(checkpoint: Path, ids: list[int]) -> dict[str, Any]:
    import tempfile

    print("offload of a paused row (real SmolLM2, CPU): restore from memory or disk, or prefill again")
    with tempfile.TemporaryDirectory() as tmp:
        rows = offload_figures(checkpoint, "cpu", ids, (256, 1024, 2048), Path(tmp))
    return {"device": "cpu", "model": "SmolLM2-135M-Instruct", "rows": rows}


def cpu_prefix(checkpoint: Path, tokenizer: Any, ids: list[int]) -> dict[str, Any]:
    """A 1536-token reference document (held-out text) asked four questions."""
    print("prefix cache (real SmolLM2, CPU): time to first token of a repeated document")
    questions = [
        tokenizer.encode(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False).ids
        for q in ("What is this about?", "Which keyword is defined?", "Give one example.", "Summarise it.")
    ]
    figures = prefix_ttft(checkpoint, "cpu", ids[:1536], questions)
    print(
        f"  TTFT {figures['ttft_cold_ms']:.0f} ms cold, {figures['ttft_warm_ms']:.0f} ms warm "
        f"({figures['speedup']:.1f}x); {figures['ttft_uncached_ms']:.0f} ms with no prefix cache",
        flush=True,
    )
    return {"device": "cpu", "model": "SmolLM2-135M-Instruct", **figures}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: str | torch.device) -> None:
    """Gives an engine's device memory back before the next is loaded."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


CUDA_PARTS = {
    "cuda": ("decode", "attention", "offload", "prefix", "chunked"),
    "cuda-decode": ("decode",),
    "cuda-attention": ("attention",),
    "cuda-prefix": ("prefix",),
    "cuda-chunked": ("chunked",),
}


def run_cuda(args: argparse.Namespace) -> None:
    """The CUDA parts `args.only` names, on the 8B shape, each merged into the results and
    written as soon as it is measured (a part's figures compare within one run)."""
    import tempfile

    from engines.text.random_llama import LLAMA3_8B, write_random_checkpoint
    from engines.text.text_build import serving_group

    group = serving_group(LLAMA3_8B.parameter_count())  # as `edgectl build` quantizes it

    parts = CUDA_PARTS[args.only]
    result = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    gpu = torch.cuda.get_device_name()

    def save() -> None:
        write_json(args.out, result)

    if "attention" in parts:
        print("decode attention alone, one layer, per KV format (CUDA graphs):")
        result["cuda_attention"] = {"gpu": gpu, **attention_kernels(LLAMA3_8B)}
        save()
    if parts == ("attention",):
        return
    cuda = result.setdefault("cuda_decode", {})
    cuda.update(
        {
            "model": f"Llama-3-8B shape, INT4 weights at group size {group} (random: speed only)",
            "context": args.context,
            "new_tokens": args.new_tokens_cuda,
            "gpu": gpu,
            "torch": torch.__version__,
        }
    )
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, LLAMA3_8B.vocab_size, (args.context,), generator=gen).tolist()
    questions = [torch.randint(0, LLAMA3_8B.vocab_size, (24,), generator=gen).tolist() for _ in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(
            Path(tmp) / "llama3-8b-int4-random", LLAMA3_8B, device="cuda", group=group, seed=3
        )
        if "decode" in parts:
            print(f"decode at {args.context} tokens of context, 8B-shaped INT4 model, served engine, per KV format:")
            measured = decode_4k(checkpoint, args.context, args.new_tokens_cuda)
            by_dtype = {m["kv_dtype"]: m for m in measured}
            for row in result["rows"]:
                if row.get("shipped") and row["kv_dtype"] in by_dtype:
                    row["decode_tok_s_4k"] = by_dtype[row["kv_dtype"]]["decode_tok_s_4k"]
                    row["decode_ratio_4k"] = row["decode_tok_s_4k"] / by_dtype["float16"]["decode_tok_s_4k"]
            cuda["rows"] = measured
            cuda["kernel"] = measured[0]["engine_config"]["kernel"]
            save()
        if "offload" in parts:
            print("offload of a paused row (8B shape, CUDA): restore from pinned memory or disk, or prefill again")
            cuda["offload"] = offload_figures(checkpoint, "cuda", ids, (1024, args.context), Path(tmp))
            save()
        if "prefix" in parts:
            prefix = prefix_ttft(checkpoint, "cuda", ids[:2048], questions)
            print(f"  prefix cache: TTFT {prefix['ttft_cold_ms']:.1f} ms cold, {prefix['ttft_warm_ms']:.1f} ms warm")
            cuda["prefix_cache"] = prefix
            save()
        if "chunked" in parts:
            print("chunked prefill (8B shape, CUDA): a 2048-token prompt joins two decoding sequences")
            cuda["chunked_prefill"] = chunked_prefill(checkpoint, "cuda", ids, 2048, (0, 256))
            save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens for perplexity")
    parser.add_argument("--codec-tokens", type=int, default=4096, help="tokens of real KV for the codecs")
    parser.add_argument("--prompts", type=int, default=16, help="greedy continuation prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096, help="cuda: context the decode is timed at")
    parser.add_argument("--new-tokens-cuda", type=int, default=256, help="cuda: tokens decoded per timed run")
    parser.add_argument("--skip-chunked", action="store_true", help="keep the chunked-prefill figures already there")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv.json")
    parser.add_argument(
        "--only",
        choices=["chunked", "offload", "prefix", *CUDA_PARTS],
        help="only this part, merged into the existing results",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in CUDA_PARTS:
        run_cuda(args)
        return

    base = import_smollm2(args.engine_dir)
    # The served CPU engine: its model reads the text for perplexity and the codecs.
    engine = load_engine(base, "cpu")
    model, config = engine.model, engine.model.config
    ids = engine.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids
    parts: dict[str, Callable[[], Any]] = {
        "chunked_prefill": lambda: chunked_prefill(base, "cpu", ids, 2048, (0, 256)),
        "offload": lambda: cpu_offload(base, ids),
        "prefix_cache": lambda: cpu_prefix(base, engine.tokenizer, ids),
    }
    if args.only in ("chunked", "offload", "prefix"):
        name = {"chunked": "chunked_prefill", "prefix": "prefix_cache"}.get(args.only, args.only)
        result = json.loads(args.out.read_text())
        result[name] = parts[name]()
        write_json(args.out, result)
        return
    eval_ids = ids[: args.max_tokens]
    stride = len(eval_ids) // args.prompts
    prompts = [eval_ids[i * stride : i * stride + 48] for i in range(args.prompts)]
    pool_rows, row_tokens = profile_pool()

    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for dtype, fmt in VARIANTS:
        t0 = time.perf_counter()
        # In windows of CONTEXT tokens, CHUNK at a time into a served cache in `fmt`.
        ppl = perplexity(model, eval_ids, CONTEXT, CHUNK, _cache_format(fmt))
        # Greedy continuations through an engine for the formats a profile can name; the
        # compared layouts are read for perplexity only.
        conts, fields = continuations(base, prompts, args.new_tokens, dtype) if shipped(fmt) else (None, {})
        if dtype == "float16":
            reference = {"ppl": ppl, "conts": conts}
        row = {
            "kv_dtype": dtype,
            "shipped": shipped(fmt),
            "name": describe(fmt),
            "format": {
                "key_block": fmt.key_block,
                "value_group": fmt.value_group,
                "window": fmt.window,
                "value_symmetric": fmt.value_symmetric,
                "sink": fmt.sink,
            },
            "perplexity": ppl,
            "ppl_delta_pct": (ppl / reference["ppl"] - 1.0) * 100.0,
            "greedy_agreement": agreement(reference["conts"], conts)["token_agreement"] if conts else None,
            **capacity(config, fmt),
            **fields,
        }
        rows.append(row)
        print(
            f"{row['name']:<80} ppl {ppl:.4f} ({row['ppl_delta_pct']:+.3f}%), greedy {row['greedy_agreement']}, "
            f"capacity {row['capacity_ratio']:.2f}x ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    kv = real_kv(model, ids[: args.codec_tokens])
    print(f"lossless codecs on {args.codec_tokens} tokens of real float16 KV ({sum(map(len, kv)) / 2**20:.1f} MiB):")
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    result = {
        "what": "SmolLM2-135M-Instruct (real weights): quantized KV formats and lossless codecs on real KV",
        "serving": "every quality figure through the served cache (edge/text/kv/quant_cache.py) and the attention "
        "kernels that read its codes: our C kernel on the CPU here",
        "eval_text": f"pydoc_data topics, eval split, corpus {corpus_fingerprint()}",
        "eval_tokens": len(eval_ids),
        "context": CONTEXT,
        "chunk": CHUNK,
        "greedy_prompts": len(prompts),
        "greedy_new_tokens": args.new_tokens,
        "pool": {
            "profile": PROFILE.name,
            "rows": pool_rows,
            "row_tokens": row_tokens,
            "bytes": cache_bytes(config, FORMATS["float16"], pool_rows, row_tokens, torch.float16),
        },
        "codec_tokens": args.codec_tokens,
        "kv_bytes": sum(len(b) for b in kv),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "seed_claim": SEED_CLAIM,
        "rows": rows,
        "codecs": codecs(kv, config.num_kv_heads * config.head_dim),
    }
    kept_parts = ["cuda_decode", "cuda_attention"]  # measured by their own runs, on CUDA
    for name, measure in parts.items():
        if args.skip_chunked and name == "chunked_prefill":
            kept_parts.append(name)
        else:
            result[name] = measure()
    for kept in kept_parts:
        if kept in previous:
            result[kept] = previous[kept]
    if "cuda_decode" in result:
        by_dtype = {m["kv_dtype"]: m for m in result["cuda_decode"]["rows"]}
        for row in rows:
            if row["shipped"] and row["kv_dtype"] in by_dtype:
                row["decode_tok_s_4k"] = by_dtype[row["kv_dtype"]]["decode_tok_s_4k"]
                row["decode_ratio_4k"] = row["decode_tok_s_4k"] / by_dtype["float16"]["decode_tok_s_4k"]
    write_json(args.out, result)
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
