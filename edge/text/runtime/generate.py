"""Token generation: greedy or nucleus sampling, EOS and stop strings, streaming hooks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from edge.text.kv.float_cache import KVCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import LlamaModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # The end-of-text token taken as any other: for measurements that time a fixed number
    # of tokens (a benchmark's run must not end early where the model would stop).
    ignore_eos: bool = False


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop" | "length"
    prefill_ms: float
    decode_ms: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        n = len(self.token_ids)
        return n / (self.decode_ms / 1000.0) if self.decode_ms > 0 and n else 0.0


def _sampled(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """One token drawn from logits [V] with temperature and nucleus cut, as a 0-d tensor on
    the logits' device (the generator must live there too)."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = cumulative - sorted_p < params.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
        return order[choice][0]
    return torch.multinomial(probs, 1, generator=gen)[0]


def sample_next(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    return int(_sampled(logits, params, gen).item())


def choose_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """The next token of every row of logits [n, V], chosen on the logits' device: [n]
    token ids there, nothing read back (the batcher launches the next step first)."""
    tokens = torch.argmax(logits, dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if drawn:
        tokens = tokens.clone()
        for i in drawn:
            tokens[i] = _sampled(logits[i], params[i], generators[i])
    return tokens


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """The next token of every row of logits [n, V], chosen on the logits' device and
    read back to the host once for the whole batch (not once per sequence)."""
    out: list[int] = choose_rows(logits, params, generators).tolist()
    return out


def streamable_end(text: str, emitted: int, stops: tuple[str, ...]) -> int:
    """How far `text` may be streamed while generation goes on: not a tail that could
    still turn into a stop string, nor an incomplete UTF-8 sequence the byte-level
    decoder shows as U+FFFD."""
    hold = max((len(s) - 1 for s in stops), default=0)
    safe = len(text) - hold
    while safe > emitted and text[safe - 1] == "\ufffd":
        safe -= 1
    return safe


def _find_stop(text: str, stops: tuple[str, ...]) -> int:
    hits = [text.find(s) for s in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: frozenset[int],
    cache: KVCache | QuantKVCache,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Run one sequence to completion in `cache` (which must hold prompt + new tokens)."""
    gen: torch.Generator | None = None
    if params.temperature > 0.0:
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else int(time.time_ns() & 0x7FFFFFFF))
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    t0 = time.perf_counter()
    logits = model(ids, cache, 0)[0, -1]
    t1 = time.perf_counter()
    out: list[int] = []
    pos = len(prompt_ids)
    finish = "length"
    text = ""
    emitted = 0
    for _ in range(params.max_new_tokens):
        token = sample_next(logits, params, gen)
        if token in eos_ids and not params.ignore_eos:
            finish = "eos"
            break
        out.append(token)
        text = tokenizer.decode(out)
        cut = _find_stop(text, params.stop)
        if cut >= 0:
            text = text[:cut]
            finish = "stop"
            break
        if on_text is not None:
            safe = streamable_end(text, emitted, params.stop)
            if safe > emitted:
                on_text(text[emitted:safe])
                emitted = safe
        if pos + 1 >= cache.max_len:
            break
        step = torch.tensor([[token]], dtype=torch.long, device=ids.device)
        logits = model(step, cache, pos)[0, -1]
        pos += 1
    t2 = time.perf_counter()
    if on_text is not None and len(text) > emitted:
        on_text(text[emitted:])
    return Generation(
        text=text,
        token_ids=out,
        prompt_tokens=len(prompt_ids),
        finish_reason=finish,
        prefill_ms=(t1 - t0) * 1000.0,
        decode_ms=(t2 - t1) * 1000.0,
    )
