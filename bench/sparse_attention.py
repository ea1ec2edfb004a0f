#!/usr/bin/env python3
"""Top-k block sparse attention on the CPU (models.qa.sparse_attention) against dense
attention: the engine profiles/cpu-dev.yaml's qa section builds (the clinic build), with
sparse attention on (the shipped profile leaves it off, so the result's `served` is
false) and selecting from position 0, each row's k set on the engine's cache
(KVCache.sparse) between passes, so sparse and dense run on one engine and one cache.

Per context length and k (top_k_blocks, blocks of the section's block_tokens):

- attention_us, dense_attention_us: every layer's attention alone for one token after
  the context, as the decode step runs it (its own code, every layer in one call of
  edge_cpu_step_attention, with queries drawn at random: the work does not depend on
  their values, which blocks it picks aside), the median of repeats;
- decode_tok_s, dense_decode_tok_s: decode steps a second while the held-out text after
  the context is scored token by token through the decode step (the first step, which
  summarizes the whole context once, left out); each pass run twice, in an order and
  its reverse, the faster counting;
- ppl_delta_pct: the perplexity of those tokens with sparse attention over dense's, in
  percent;
- passkey_accuracy, dense_passkey_accuracy: a five-digit number hidden at depths from
  10% to 90% of a prompt of the context's length, asked at the end; greedy answers through
  the decode step, right where they contain the number; the same prompts for both.

Writes bench/results/sparse_attention.json and prints a table.

    python -m bench.sparse_attention [--contexts 512 1024 2048 4096] [--k 4 8 16] [--threads 2]
    python -m bench.sparse_attention --quick   # a smoke test: one short context, written under /tmp
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, write_json
from bench.text_engines import engine_fields, load_engine
from edge.config.text import SparseAttentionConfig
from edge.text.engine import TextEngine
from edge.text.kv.float_cache import KVCache, SparseAttention
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


def _cache(engine: TextEngine) -> KVCache:
    cache = engine.batcher.cache
    assert isinstance(cache, KVCache) and cache.summary is not None
    return cache


def _policy(k: int | None) -> SparseAttention | None:
    """k blocks selected from position 0 on; None: dense."""
    return None if k is None else SparseAttention(top_k_blocks=k, block_tokens=BLOCK, min_context=0)


def _step(engine: TextEngine, token: int, position: int) -> torch.Tensor:
    """One decode step of row 0: the logits [V] after `token` at `position`."""
    ids, pos = torch.tensor([[token]]), torch.tensor([position])
    return fused_step.decode_step(engine.model, ids, engine.batcher.cache, pos, position + 1)[0]


def _prefilled(engine: TextEngine, ids: list[int]) -> dict[str, torch.Tensor]:
    """Row 0 after `ids`, saved to be loaded again before each pass."""
    cache = _cache(engine)
    with torch.inference_mode():
        engine.model(torch.tensor([ids]), cache.rows(0, 1), 0)
    return cache.save_row(0, len(ids))


def score(
    engine: TextEngine, saved: dict[str, torch.Tensor], context: list[int], targets: list[int], k: int | None
) -> tuple[float, float]:
    """(negative log-likelihood summed, tokens a second) of `targets` after `context`,
    each scored by a decode step: the context's last token fed at its position, each
    target after it in turn."""
    cache = _cache(engine)
    cache.load_row(0, len(context) - 1, saved)
    cache.sparse = _policy(k)
    feed = [context[-1], *targets[:-1]]
    nll, first, began = 0.0, len(context) - 1, 0.0
    with torch.inference_mode():
        for i, (token, target) in enumerate(zip(feed, targets, strict=True)):
            if i == 1:
                began = time.perf_counter()  # the first step summarizes the context: left out
            logits = _step(engine, token, first + i)
            nll -= float(torch.log_softmax(logits.float(), -1)[target])
    rate = (len(targets) - 1) / (time.perf_counter() - began)
    return nll, rate


def attention_us(engine: TextEngine, position: int, k: int | None, repeats: int) -> float:
    """Every layer's attention for one token at `position` of row 0 (the cache and its
    summaries as the scoring pass left them), microseconds, the median of `repeats`."""
    cache = _cache(engine)
    cache.sparse = _policy(k)
    config = engine.model.config
    shape = (config.num_layers, 1, config.num_heads * config.head_dim)
    q = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([position])
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        cpu_step.attention(engine.model, cache, q, pos, position + 1)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


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


def passkey(engine: TextEngine, prompts: list[tuple[list[int], str]], ks: list[int | None]) -> dict[int | None, float]:
    """For each k (None: dense), the share of prompts whose greedy answer holds their key;
    each prompt prefilled once and its row loaded again for each k."""
    cache = _cache(engine)
    right = dict.fromkeys(ks, 0)
    for ids, key in prompts:
        saved = _prefilled(engine, ids[:-1])
        for k in ks:
            cache.load_row(0, len(ids) - 1, saved)
            cache.sparse = _policy(k)
            token, answer = ids[-1], []
            with torch.inference_mode():
                for i in range(ANSWER_TOKENS):
                    token = int(_step(engine, token, len(ids) - 1 + i).argmax())
                    answer.append(token)
            right[k] += key in engine.tokenizer.decode(answer)
    return {k: n / len(prompts) for k, n in right.items()}


def measure(
    engine: TextEngine, ids: list[int], length: int, ks: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The rows of one context length, one a k."""
    context, targets = ids[:length], ids[length : length + args.score_tokens]
    saved = _prefilled(engine, context[:-1])
    nll: dict[int | None, float] = {}
    rate: dict[int | None, float] = {}
    attention: dict[int | None, float] = {}
    position = length - 1 + len(targets) - 1  # the scoring pass's last token
    # Each twice, in an order and its reverse, the faster pass counting: other work on the
    # box slows one pass or another, not one method throughout.
    for k in [None, *ks, *reversed(ks), None]:
        got, tok_s = score(engine, saved, context, targets, k)
        nll[k], rate[k] = got, max(tok_s, rate.get(k, 0.0))
        if k not in attention:  # over the summaries the pass just brought up to date
            attention[k] = attention_us(engine, position, k, args.repeats)
        print(f"  {length} tokens, k={k}: ppl {math.exp(got / len(targets)):.3f}, {tok_s:.1f} tok/s", flush=True)
    found = passkey(engine, passkey_prompts(engine, length, length), [None, *ks])
    dense_ppl = math.exp(nll[None] / len(targets))
    rows = []
    for k in ks:
        ppl = math.exp(nll[k] / len(targets))
        rows.append(
            {
                "context_tokens": length,
                "top_k_blocks": k,
                "block_tokens": BLOCK,
                # At most: the first block, the k chosen and the two recent ones.
                "attended_tokens": min(length + len(targets), (k + 3) * BLOCK),
                "attention_us": attention[k],
                "dense_attention_us": attention[None],
                "decode_tok_s": rate[k],
                "dense_decode_tok_s": rate[None],
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
    rows: list[dict[str, Any]] = []
    for length in args.contexts:
        began = time.perf_counter()
        rows += measure(engine, ids, length, args.k, args)
        print(f"{length} tokens measured in {time.perf_counter() - began:.0f} s", flush=True)
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
        "rows": rows,
        **engine_fields(engine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16], help="top_k_blocks, a row each")
    parser.add_argument("--score-tokens", type=int, default=128, help="held-out tokens scored after the context")
    parser.add_argument("--repeats", type=int, default=20, help="timings of attention alone, the median taken")
    parser.add_argument("--threads", type=int, default=2)
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
        f"{'context':>8} {'k':>3} {'attn us':>9} {'dense us':>9} {'tok/s':>7} {'dense':>7} {'ppl %':>7} {'passkey':>7}"
    )
    for r in result["rows"]:
        print(
            f"{r['context_tokens']:>8} {r['top_k_blocks']:>3} "
            f"{r['attention_us']:>9.0f} {r['dense_attention_us']:>9.0f} "
            f"{r['decode_tok_s']:>7.1f} {r['dense_decode_tok_s']:>7.1f} {r['ppl_delta_pct']:>+7.2f} "
            f"{r['passkey_accuracy']:>4.0%}/{r['dense_passkey_accuracy']:.0%}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
