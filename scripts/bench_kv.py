#!/usr/bin/env python3
"""KV-cache memory on the real model: what quantized KV costs in quality and gains in
capacity, and what lossless coding gets from real keys and values.

SmolLM2-135M-Instruct (real weights, float32 on the CPU), on held-out text (the Python
reference topics of the evaluation split):
- perplexity with each KV format, the text read in chunks: each chunk attends to the
  earlier ones' keys and values as the format stores them (edge/text/kv_quant.py:
  quantized, then read back) and to its own in float, as chunked prefill and decode
  read a quantized cache; the delta is against float16 KV;
- greedy agreement: continuations decoded token by token over each format's cache,
  against float16 KV's;
- capacity: tokens a KV pool holds in each format, scales and float tokens counted;
- lossless codecs (lz4, delta + lz4, byte-shuffle + lz4 or zstd) on the float16 cache of
  the same text, each checked to give back every byte;
- chunked prefill: the time between the tokens of two decoding sequences while a
  2048-token prompt joins them, prefilled whole and a chunk per step (the serving batcher,
  edge/text/continuous.py).

Writes bench/results/kv.json and prints a table.

    python scripts/bench_kv.py [--max-tokens 8192] [--threads 2] [--only chunked]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from eval_text_quality import agreement  # noqa: E402

from edge.text.checkpoint import load_checkpoint  # noqa: E402
from edge.text.continuous import ContinuousBatcher, Sequence  # noqa: E402
from edge.text.generate import SamplingParams  # noqa: E402
from edge.text.kv_quant import (  # noqa: E402
    FORMATS,
    KVFormat,
    bytes_per_token,
    capacity_tokens,
    dequantize,
    quantize,
)
from edge.text.llama import KVCache, LlamaModel  # noqa: E402
from engines.corpus import corpus_fingerprint, evaluation_text  # noqa: E402
from engines.import_gguf import import_smollm2  # noqa: E402

CONTEXT = 1024  # tokens per perplexity window
CHUNK = 64  # tokens per step of the chunked read
SEED_CLAIM = {"codec": "LZ4 + delta coding", "ratio": 4.8}
# The serving pool the daemon sizes for this model by default: 4 rows of 1024 tokens.
POOL_ROWS, POOL_ROW_TOKENS = 4, 1024

VARIANTS: list[tuple[str, KVFormat]] = [
    ("float16", FORMATS["float16"]),
    ("int8", FORMATS["int8"]),
    ("int4", FORMATS["int4"]),
    ("int4", KVFormat("int4", key_block=64, value_group=64, window=64)),
    ("int4", KVFormat("int4", key_block=128, value_group=64, window=32)),
]


def describe(fmt: KVFormat) -> str:
    if fmt.dtype == "float16":
        return "float16"
    group = f"values per {fmt.value_group} channels" if fmt.value_group else "values per token"
    window = f", newest {fmt.window} float16" if fmt.window else ""
    return f"{fmt.dtype}, keys per channel per {fmt.key_block} tokens, {group}{window}"


class FormattedCache:
    """A model's KV cache held as `fmt` stores it: after each step the tokens the format
    codes are replaced by their codes read back, from the float values kept aside (a
    block is quantized once, from the model's own values, never twice)."""

    def __init__(self, model: LlamaModel, fmt: KVFormat, length: int) -> None:
        self.cache: KVCache = model.new_cache(1, length)
        self.fmt = fmt
        self._k = torch.zeros_like(self.cache.k, dtype=torch.float32)
        self._v = torch.zeros_like(self.cache.v, dtype=torch.float32)

    def stored(self, start: int, end: int) -> None:
        """Tokens start..end-1 were just written by the model; tokens 0..end-1 now hold
        what the format gives back."""
        self._k[..., start:end, :] = self.cache.k[..., start:end, :]
        self._v[..., start:end, :] = self.cache.v[..., start:end, :]
        q = quantize(self._k[:, 0, :, :end], self._v[:, 0, :, :end], self.fmt)
        k, v = dequantize(q, self.cache.k.dtype)
        self.cache.k[:, 0, :, :end] = k
        self.cache.v[:, 0, :, :end] = v


def perplexity(model: LlamaModel, ids: list[int], fmt: KVFormat) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, CONTEXT):
        window = ids[start : start + CONTEXT + 1]
        if len(window) < 2:
            break
        held = FormattedCache(model, fmt, CONTEXT + 1)
        for c in range(0, len(window) - 1, CHUNK):
            chunk = torch.tensor([window[c : min(c + CHUNK, len(window) - 1)]])
            targets = torch.tensor(window[c + 1 : c + 1 + chunk.shape[1]])
            with torch.inference_mode():
                logits = model(chunk, held.cache, c, last_only=False)[0]
            held.stored(c, c + chunk.shape[1])
            nll += float(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
            count += chunk.shape[1]
    return math.exp(nll / count)


def continuations(model: LlamaModel, prompts: list[list[int]], new_tokens: int, fmt: KVFormat) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        held = FormattedCache(model, fmt, len(prompt) + new_tokens + 1)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt]), held.cache, 0)
        held.stored(0, len(prompt))
        tokens: list[int] = []
        pos = len(prompt)
        for _ in range(new_tokens):
            token = int(logits[0].argmax())
            tokens.append(token)
            with torch.inference_mode():
                logits = model(torch.tensor([[token]]), held.cache, pos)
            held.stored(pos, pos + 1)
            pos += 1
        outs.append(tokens)
    return outs


def _shuffle(raw: bytes) -> bytes:
    """Float16 values' bytes as two planes, the high bytes (sign, exponent) together."""
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2)
    return a.T.copy().tobytes()


def _delta(raw: bytes, width: int) -> bytes:
    """Each token's 16-bit patterns minus the previous token's (rows of `width` values)."""
    a = np.frombuffer(raw, dtype=np.uint16).reshape(-1, width)
    out = a.copy()
    out[1:] = a[1:] - a[:-1]  # modulo 2^16: exactly invertible
    return out.tobytes()


def codecs(kv: list[bytes], width: int) -> list[dict[str, Any]]:
    import lz4.frame
    import zstandard

    zc3, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    zc19 = zstandard.ZstdCompressor(level=19)

    def unshuffle(data: bytes) -> bytes:
        a = np.frombuffer(data, dtype=np.uint8).reshape(2, -1)
        return a.T.copy().tobytes()

    def undelta(data: bytes) -> bytes:
        a = np.frombuffer(data, dtype=np.uint16).reshape(-1, width)
        return np.cumsum(a, axis=0, dtype=np.uint16).tobytes()

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
    cache = model.new_cache(1, len(ids))
    for c in range(0, len(ids), 512):
        with torch.inference_mode():
            model(torch.tensor([ids[c : c + 512]]), cache, c)
    out = []
    for layer in range(cache.k.shape[0]):
        for t in (cache.k, cache.v):
            # Token-major ([tokens, heads * head size]): a token's values together, as an
            # offloaded row is written, and what delta coding along tokens needs.
            out.append(t[layer, 0].transpose(0, 1).contiguous().to(torch.float16).numpy().tobytes())
    return out


def chunked_prefill(model: LlamaModel, ids: list[int], long_tokens: int, chunks: tuple[int, ...]) -> dict[str, Any]:
    """Two sequences decode; a `long_tokens` prompt joins; the gaps between their tokens
    from its arrival to its first token, for each prefill chunk (0: the whole prompt)."""
    rows = []
    long_prompt = ids[:long_tokens]
    shorts = [ids[long_tokens + 100 * i : long_tokens + 100 * i + 48] for i in range(2)]
    for chunk in chunks:
        batcher = ContinuousBatcher(model, None, frozenset(), slots=3, slot_len=long_tokens + 16)
        batcher.prefill_chunk = chunk
        running = [Sequence(i, p, SamplingParams(max_new_tokens=long_tokens)) for i, p in enumerate(shorts)]
        for seq in running:
            slot = batcher.kv.allocate_slots(str(seq.owner), long_tokens + 16)
            assert slot is not None
            batcher.admit(seq, slot)
        for _ in range(8):  # both decoding at their pace before the prompt arrives
            batcher.step()
        joining = Sequence("long", long_prompt, SamplingParams(max_new_tokens=4))
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
            }
        )
        print(
            f"  prefill chunk {chunk or 'whole':>5}: gaps p50 {rows[-1]['gap_p50_ms']:.0f} ms, "
            f"p99 {rows[-1]['gap_p99_ms']:.0f} ms (before {rows[-1]['gap_before_ms']:.0f} ms), "
            f"its first token after {rows[-1]['ttft_ms']:.0f} ms",
            flush=True,
        )
    return {"prompt_tokens": long_tokens, "running": 2, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8192, help="evaluation tokens for perplexity")
    parser.add_argument("--codec-tokens", type=int, default=4096, help="tokens of real KV for the codecs")
    parser.add_argument("--prompts", type=int, default=16, help="greedy continuation prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv.json")
    parser.add_argument("--only", choices=["chunked"], help="only this part, merged into the existing results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ckpt = load_checkpoint(import_smollm2(args.engine_dir))
    model, config = ckpt.model, ckpt.model.config
    ids = ckpt.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids
    if args.only == "chunked":
        print("chunked prefill: two sequences decoding, a 2048-token prompt joins")
        result = json.loads(args.out.read_text())
        result["chunked_prefill"] = chunked_prefill(model, ids, 2048, (0, 256))
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    eval_ids = ids[: args.max_tokens]
    stride = len(eval_ids) // args.prompts
    prompts = [eval_ids[i * stride : i * stride + 48] for i in range(args.prompts)]
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    pool = POOL_ROWS * POOL_ROW_TOKENS * int(bytes_per_token(FORMATS["float16"], *shape))
    row_4k = 4096 * int(bytes_per_token(FORMATS["float16"], *shape))

    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for dtype, fmt in VARIANTS:
        t0 = time.perf_counter()
        ppl = perplexity(model, eval_ids, fmt)
        conts = continuations(model, prompts, args.new_tokens, fmt)
        if dtype == "float16":
            reference = {"ppl": ppl, "conts": conts}
        row = {
            "kv_dtype": dtype,
            "name": describe(fmt),
            "format": {"key_block": fmt.key_block, "value_group": fmt.value_group, "window": fmt.window},
            "perplexity": ppl,
            "ppl_delta_pct": (ppl / reference["ppl"] - 1.0) * 100.0,
            "greedy_agreement": agreement(reference["conts"], conts)["token_agreement"],
            "bytes_per_token": bytes_per_token(fmt, *shape),
            "capacity_ratio": capacity_tokens(fmt, pool, POOL_ROWS, *shape) / (POOL_ROWS * POOL_ROW_TOKENS),
            "capacity_ratio_4k": capacity_tokens(fmt, row_4k, 1, *shape) / 4096,
        }
        rows.append(row)
        print(
            f"{row['name']:<72} ppl {ppl:.4f} ({row['ppl_delta_pct']:+.3f}%), greedy {row['greedy_agreement']:.3f}, "
            f"capacity {row['capacity_ratio']:.2f}x ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    kv = real_kv(model, ids[: args.codec_tokens])
    print(f"lossless codecs on {args.codec_tokens} tokens of real float16 KV ({sum(map(len, kv)) / 2**20:.1f} MiB):")
    result = {
        "what": "SmolLM2-135M-Instruct (real weights): quantized KV formats and lossless codecs on real KV",
        "serving": "formats measured through their reference (edge/text/kv_quant.py, quantized and read back in "
        "torch); the attention kernels that read the codes are not built yet",
        "eval_text": f"pydoc_data topics, eval split, corpus {corpus_fingerprint()}",
        "eval_tokens": len(eval_ids),
        "context": CONTEXT,
        "chunk": CHUNK,
        "greedy_prompts": len(prompts),
        "greedy_new_tokens": args.new_tokens,
        "pool": {"rows": POOL_ROWS, "row_tokens": POOL_ROW_TOKENS, "bytes": pool},
        "codec_tokens": args.codec_tokens,
        "kv_bytes": sum(len(b) for b in kv),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "seed_claim": SEED_CLAIM,
        "rows": rows,
        "codecs": codecs(kv, config.num_kv_heads * config.head_dim),
    }
    print("chunked prefill: two sequences decoding, a 2048-token prompt joins")
    result["chunked_prefill"] = chunked_prefill(model, ids, 2048, (0, 256))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
