#!/usr/bin/env python3
"""Top-k block sparse attention on the CPU (models.qa.sparse_attention) against dense
attention: the engine profiles/cpu-dev.yaml's qa section builds (the clinic build), with
sparse attention on (the shipped profile leaves it off, so the result's `served` is
false) and selecting from position 0. Each method (dense, and each k) decodes in a
cache of its own as the engine makes them (LlamaModel.new_cache, with the section's
blocks), every cache loaded with the same prefilled row, and the methods take turns
step by step (in an order that rotates each step), so other work on the box slows them
alike.

Per context length and k (top_k_blocks):

- attention_us, dense_attention_us: every layer's attention alone for one token after
  the scored text, as the decode step runs it (its own code, every layer in one call of
  edge_cpu_step_attention, with queries drawn at random: the work does not depend on
  their values, which blocks it picks aside), the median of repeats taken in turns;
- decode_tok_s, dense_decode_tok_s: decode steps a second, from the median step, while
  the held-out text after the context is scored token by token through the decode step
  (the first step, which summarizes the whole context once, left out);
- ppl_delta_pct: the perplexity of those tokens with sparse attention over dense's, in
  percent;
- passkey_accuracy, dense_passkey_accuracy: a five-digit number hidden at depths from
  10% to 90% of a prompt of the context's length, asked at the end; greedy answers through
  the decode step, right where they contain the number; the same prompts for both.

Each row names its KV cache (`kv_dtype`): float16 (the C decode step over a float cache),
or int8 (the cache as the engine makes it for kv_dtype: int8: its steps run op by op, its
attention in the quantized-KV kernel, ops/cpu/cpu_kv.c, timed alone layer by layer with
the same random queries; dense against sparse over the same codes).

Writes bench/results/sparse_attention.json and prints a table.

    python -m bench.sparse_attention [--contexts 512 1024 2048 4096] [--k 4 8 16 32] [--threads 2]
        [--kv-dtype float16 int8]
    python -m bench.sparse_attention --quick   # a smoke test: one short context, written under /tmp
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch

from bench.common import REPO, RESULTS, write_json
from bench.text_engines import engine_fields, load_engine
from edge.config.text import SparseAttentionConfig
from edge.text.engine import TextEngine
from edge.text.kv import kv_attention
from edge.text.kv.float_cache import KVCache, SparseAttention
from edge.text.kv.kv_quant import FORMATS, KVDtype
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.ops.cpu import cpu_kv
from edge.text.runtime import cpu_step, fused_step
from engines.text.corpus import corpus_fingerprint, evaluation_text

BLOCK = 64  # block_tokens: the section's default
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
ANSWER_TOKENS = 8
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


Method = int | None  # a k, or None: dense
Cache = KVCache | QuantKVCache


def _caches(engine: TextEngine, methods: list[Method], slots: int, kv_dtype: str = "float16") -> dict[Method, Cache]:
    """A one-row cache a method, as the engine makes its own for `kv_dtype`: dense, or
    keeping the block summaries with that k selecting from position 0."""
    model = engine.model
    caches = {}
    for k in methods:
        policy = None if k is None else SparseAttention(top_k_blocks=k, block_tokens=BLOCK, min_context=0)
        caches[k] = model.new_cache(1, slots, FORMATS[cast(KVDtype, kv_dtype)], sparse=policy)
    return caches


def _step(engine: TextEngine, cache: Cache, token: int, position: int) -> torch.Tensor:
    """One decode step of the cache's row: the logits [V] after `token` at `position`."""
    ids, pos = torch.tensor([[token]]), torch.tensor([position])
    return fused_step.decode_step(engine.model, ids, cache, pos, position + 1)[0]


def _load(engine: TextEngine, caches: dict[Method, Cache], ids: list[int]) -> None:
    """Every cache's row after `ids`: prefilled once (dense's), loaded into the others."""
    dense = caches[None]
    with torch.inference_mode():
        engine.model(torch.tensor([ids]), dense, 0)
    saved = dense.save_row(0, len(ids))
    for k, cache in caches.items():
        if k is not None:
            cache.load_row(0, len(ids), saved)


def _turns(methods: list[Method], i: int) -> list[Method]:
    """The methods in the order they go at turn i: rotated each turn."""
    at = i % len(methods)
    return methods[at:] + methods[:at]


def score(
    engine: TextEngine, caches: dict[Method, Cache], context: list[int], targets: list[int]
) -> tuple[dict[Method, float], dict[Method, list[float]]]:
    """Per method, (negative log-likelihood summed, each step's seconds) of `targets`
    after `context` (its first len - 1 tokens in the caches), each scored by a decode
    step: the context's last token fed at its position, each target after it in turn,
    the methods in turns. The first step, which summarizes the whole context once, is
    not among the times."""
    methods = list(caches)
    feed = [context[-1], *targets[:-1]]
    nll = dict.fromkeys(methods, 0.0)
    times: dict[Method, list[float]] = {k: [] for k in methods}
    first = len(context) - 1
    with torch.inference_mode():
        for i, (token, target) in enumerate(zip(feed, targets, strict=True)):
            for k in _turns(methods, i):
                began = time.perf_counter()
                logits = _step(engine, caches[k], token, first + i)
                if i > 0:
                    times[k].append(time.perf_counter() - began)
                nll[k] -= float(torch.log_softmax(logits.float(), -1)[target])
    return nll, times


def _quant_attention(cache: QuantKVCache, q: torch.Tensor, position: int) -> None:
    """Every layer's attention over a quantized cache for one token at `position` (q
    [layers, 1, heads x head dim]), as kv_attention.decode calls the kernel, nothing
    written."""
    for i in range(q.shape[0]):
        layer = cache.layer(i)
        heads = q[i].view(1, -1, layer.ring_k.shape[-1])
        selection = None
        if layer.summary is not None and layer.sparse is not None:
            selection = cpu_kv.Selection(layer.summary, layer.sparse.block_tokens, [layer.sparse.top_k_blocks])
        cpu_kv.attention(
            heads,
            kv_attention._codes(layer),
            kv_format=kv_attention._format(layer),
            rows=[0],
            pos=[position],
            coded=[layer.fmt.coded(position + 1)],
            frows=[0],
            fbase=[0],
            float_kv=(layer.ring_k, layer.ring_v),
            fmod=layer.fmt.ring,
            sink_kv=kv_attention._sink(layer),
            selection=selection,
        )


def attention_us(engine: TextEngine, caches: dict[Method, Cache], position: int, repeats: int) -> dict[Method, float]:
    """Per method, every layer's attention for one token at `position` (each cache and its
    summaries as the scoring left them), microseconds, the median of `repeats` taken in
    turns."""
    config = engine.model.config
    shape = (config.num_layers, 1, config.num_heads * config.head_dim)
    q = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([position])
    methods = list(caches)
    times: dict[Method, list[float]] = {k: [] for k in methods}
    for i in range(repeats):
        for k in _turns(methods, i):
            cache = caches[k]
            began = time.perf_counter()
            if isinstance(cache, QuantKVCache):
                _quant_attention(cache, q, position)
            else:
                cpu_step.attention(engine.model, cache, q, pos, position + 1)
            times[k].append(time.perf_counter() - began)
    return {k: statistics.median(t) * 1e6 for k, t in times.items()}


def passkey_prompts(engine: TextEngine, length: int, seed: int) -> list[tuple[list[int], str]]:
    """(prompt ids of `length` tokens, its key) for each depth: the number hidden at that
    share of the filler."""
    tokenizer = engine.tokenizer
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    filler, head, question = encode(FILLER), encode(HEAD), encode(QUESTION)
    prompts = []
    for depth in DEPTHS:
        key = str(rng.randint(10000, 99999))
        needle = encode(NEEDLE.format(key=key))
        room = length - len(head) - len(needle) - len(question)
        if room < 2 * len(filler):
            raise ValueError(f"a passkey prompt of {length} tokens leaves too little room for filler")
        text = (filler * (room // len(filler) + 1))[:room]
        cut = int(room * depth) // len(filler) * len(filler)  # the needle between two filler sentences' runs
        prompts.append((head + text[:cut] + needle + text[cut:] + question, key))
    return prompts


def passkey(
    engine: TextEngine, caches: dict[Method, Cache], prompts: list[tuple[list[int], str]]
) -> dict[Method, float]:
    """Per method, the share of prompts whose greedy answer holds their key."""
    right = dict.fromkeys(caches, 0)
    for ids, key in prompts:
        _load(engine, caches, ids[:-1])
        for k, cache in caches.items():
            token, answer = ids[-1], []
            with torch.inference_mode():
                for i in range(ANSWER_TOKENS):
                    token = int(_step(engine, cache, token, len(ids) - 1 + i).argmax())
                    answer.append(token)
            right[k] += key in engine.tokenizer.decode(answer)
    return {k: n / len(prompts) for k, n in right.items()}


def measure(
    engine: TextEngine, ids: list[int], length: int, ks: list[int], args: argparse.Namespace, kv_dtype: str
) -> list[dict[str, Any]]:
    """The rows of one context length and KV cache, one a k."""
    context, targets = ids[:length], ids[length : length + args.score_tokens]
    caches = _caches(engine, [None, *ks], length + max(len(targets), ANSWER_TOKENS), kv_dtype)
    _load(engine, caches, context[:-1])
    nll, times = score(engine, caches, context, targets)
    tok_s = {k: 1.0 / statistics.median(t) for k, t in times.items()}
    position = length - 1 + len(targets) - 1  # the scoring's last token
    attention = attention_us(engine, caches, position, args.repeats)
    for k in caches:
        print(
            f"  {length} tokens, {kv_dtype}, k={k}: ppl {math.exp(nll[k] / len(targets)):.3f}, {tok_s[k]:.1f} tok/s",
            flush=True,
        )
    found = passkey(engine, caches, passkey_prompts(engine, length, length))
    dense_ppl = math.exp(nll[None] / len(targets))
    rows = []
    for k in ks:
        ppl = math.exp(nll[k] / len(targets))
        rows.append(
            {
                "context_tokens": length,
                "kv_dtype": kv_dtype,
                "top_k_blocks": k,
                "block_tokens": BLOCK,
                # At most: the first block, the k chosen and the two recent ones.
                "attended_tokens": min(length + len(targets), (k + 3) * BLOCK),
                "attention_us": attention[k],
                "dense_attention_us": attention[None],
                "decode_tok_s": tok_s[k],
                "dense_decode_tok_s": tok_s[None],
                "ppl": ppl,
                "dense_ppl": dense_ppl,
                "ppl_delta_pct": (ppl / dense_ppl - 1.0) * 100.0,
                "passkey_accuracy": found[k],
                "dense_passkey_accuracy": found[None],
                "passkey_prompts": len(DEPTHS),
            }
        )
        print(f"  {length} tokens, k={k}: {rows[-1]}", flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engines.text.text_build import build_text_engine

    torch.set_num_threads(args.threads)
    path = build_text_engine(args.engine_dir, "clinic", "awq-int4", progress=False)
    longest = max(args.contexts) + args.score_tokens + ANSWER_TOKENS
    # A plain dict: the engine's origin records the fields changed as they were given.
    section = SparseAttentionConfig(enabled=True, top_k_blocks=min(args.k), block_tokens=BLOCK, min_context=0)
    engine = load_engine(
        path,
        "cpu",
        threads=args.threads,
        max_sequences=1,
        max_context_tokens=-(-longest // BLOCK) * BLOCK,
        sparse_attention=section.model_dump(),
    )
    if engine.sparse is None:
        raise RuntimeError(f"sparse attention is not served here: {engine.sparse_refused}")
    ids = engine.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    for length in args.contexts:
        for kv_dtype in args.kv_dtype:
            began = time.perf_counter()
            rows += measure(engine, ids, length, args.k, args, kv_dtype)
            print(f"{length} tokens over {kv_dtype} measured in {time.perf_counter() - began:.0f} s", flush=True)
    return {
        "machine": platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "eval_text": f"pydoc_data topics, eval split, corpus {corpus_fingerprint()}",
        "score_tokens": args.score_tokens,
        "passkey_depths": list(DEPTHS),
        "passkey_answer_tokens": ANSWER_TOKENS,
        "attention_repeats": args.repeats,
        "quick": args.quick,
        # Other work on the box slows timings: its one-minute load average as the run
        # began and ended, on this many CPUs.
        "load_average": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "rows": rows,
        **engine_fields(engine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16, 32], help="top_k_blocks, a row each")
    parser.add_argument("--score-tokens", type=int, default=512, help="held-out tokens scored after the context")
    parser.add_argument("--repeats", type=int, default=30, help="timings of attention alone, the median taken")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-dtype", nargs="+", choices=["float16", "int8", "int4"], default=["float16", "int8"], help="a row each"
    )
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke test: one short context, one k, few tokens")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.k, args.score_tokens, args.repeats = [384], [1], 8, 2
    out = args.out or (Path("/tmp/sparse_attention.quick.json") if args.quick else RESULTS / "sparse_attention.json")
    result = run(args)
    write_json(out, result)
    print(
        f"{'context':>8} {'kv':>7} {'k':>3} {'attn us':>9} {'dense us':>9} {'tok/s':>7} {'dense':>7} "
        f"{'ppl %':>7} {'passkey':>7}"
    )
    for r in result["rows"]:
        print(
            f"{r['context_tokens']:>8} {r['kv_dtype']:>7} {r['top_k_blocks']:>3} "
            f"{r['attention_us']:>9.0f} {r['dense_attention_us']:>9.0f} "
            f"{r['decode_tok_s']:>7.1f} {r['dense_decode_tok_s']:>7.1f} {r['ppl_delta_pct']:>+7.2f} "
            f"{r['passkey_accuracy']:>4.0%}/{r['dense_passkey_accuracy']:.0%}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
