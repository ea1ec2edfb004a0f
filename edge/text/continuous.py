"""Continuous batching: several sequences decode in one step, and sequences join or
leave between steps.

The KV cache is allocated once with `slots` rows of `slot_len` positions each. A sequence
is prefilled alone into a free row, then advances one token per step together with every
other running sequence (one batched decode step, so each weight is read once per step for
all of them). A finished or paused sequence gives its row back at once. Rows are taken
lowest first, so the running rows stay packed at the front; a free row between running
ones is fed a dummy token at position 0, which the next prefill of that row overwrites.

Pausing drops the sequence's KV and keeps its tokens: on resume its prompt and the tokens
generated so far are prefilled again (recomputation, as vLLM does on preemption). Keeping
the KV would hold the very memory the pause is meant to free; recomputing a few hundred
tokens costs one prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from edge.text.generate import SamplingParams, _find_stop, sample_next, streamable_end
from edge.text.llama import KVCache, LlamaModel

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Sequence:
    """One request's generation state; `owner` is whatever the scheduler tracks it by."""

    owner: Any
    prompt: list[int]
    params: SamplingParams
    on_text: Callable[[str], None] | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish: str | None = None  # "eos" | "stop" | "length" once done
    slot: int | None = None
    logits: torch.Tensor | None = None  # next-token logits, set by prefill and by steps
    generator: torch.Generator | None = None
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    pauses: int = 0

    def __post_init__(self) -> None:
        if self.params.temperature > 0.0:
            self.generator = torch.Generator()
            seed = self.params.seed if self.params.seed is not None else time.time_ns() & 0x7FFFFFFF
            self.generator.manual_seed(seed)

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the last sampled token is written."""
        return len(self.prompt) + len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 and self.tokens else 0.0


class ContinuousBatcher:
    def __init__(
        self, model: LlamaModel, tokenizer: Tokenizer | None, eos_ids: frozenset[int], slots: int, slot_len: int
    ) -> None:
        """tokenizer None: token ids only (no text, no stop strings), for random-weight
        models in benchmarks."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.cache = model.new_cache(slots, slot_len)
        self.slot_len = self.cache.max_len
        self._free = list(range(slots))
        self.running: list[Sequence] = []
        self.steps = 0
        self.batch_sizes: dict[int, int] = {}  # sequences per decode step -> steps

    @property
    def slots(self) -> int:
        return int(self.cache.k.shape[1])

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache.nbytes // (self.slots * self.slot_len)

    @torch.inference_mode()
    def warm_up(self, prefill_lengths: tuple[int, ...] = (1, 8, 9, 64)) -> int:
        """Run every shape serving will run, before any job: prefills of a few lengths
        (either side of the INT4 GEMV's row limit) and one decode step at every batch
        size and every power-of-two KV length. Kernels compiled on first use (Triton's,
        on CUDA) are built now, while no other branch's thread is waiting on the
        interpreter, and their memory is inside the model's measured footprint. Writes
        only to free rows, which a prefill overwrites; returns the steps run."""
        if self.running:
            raise RuntimeError("warm_up runs before any sequence is admitted")
        device = self.model.embed_tokens.weight.device
        runs = 0
        for length in prefill_lengths:
            if length < self.slot_len:
                self.model(torch.zeros((1, length), dtype=torch.long, device=device), self._row(0), 0)
                runs += 1
        for batch in range(1, self.slots + 1):
            ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
            pos = torch.zeros(batch, dtype=torch.long, device=device)
            kv_len = 1
            while True:
                self.model.decode_step(ids, self.cache, pos, min(kv_len, self.slot_len))
                runs += 1
                if kv_len >= self.slot_len:
                    break
                kv_len *= 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return runs

    def _row(self, slot: int) -> KVCache:
        return self.cache.rows(slot, 1)

    @torch.inference_mode()
    def admit(self, seq: Sequence) -> None:
        """Prefill a sequence (its prompt plus any tokens from before a pause) into the
        lowest free row; it decodes from the next step on."""
        if not self._free:
            raise RuntimeError("no free KV row")
        ids = seq.prompt + seq.tokens
        if len(ids) + 1 > self.slot_len:
            raise ValueError(f"{len(ids)} tokens do not fit a KV row of {self.slot_len}")
        self._free.sort()
        seq.slot = self._free.pop(0)
        device = self.model.embed_tokens.weight.device
        t0 = time.perf_counter()
        seq.logits = self.model(torch.tensor([ids], device=device), self._row(seq.slot), 0)[0, -1]
        seq.prefill_ms += (time.perf_counter() - t0) * 1000.0
        self.running.append(seq)

    def pause(self, seq: Sequence) -> None:
        """Take a running sequence out and give its row back; its KV is dropped."""
        self._leave(seq)
        seq.logits = None
        seq.pauses += 1

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.slot is not None:
            self._free.append(seq.slot)
            seq.slot = None

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Sample one token for every running sequence, then run one batched decode step
        for those still going; returns the sequences that finished (rows given back)."""
        if not self.running:
            return []
        t0 = time.perf_counter()
        done: list[Sequence] = []
        for seq in list(self.running):
            if self._advance(seq):
                done.append(seq)
                self._leave(seq)
        going = self.running
        if going:
            n = max(s.slot for s in going if s.slot is not None) + 1
            device = self.model.embed_tokens.weight.device
            ids = torch.zeros((n, 1), dtype=torch.long, device=device)
            pos = torch.zeros(n, dtype=torch.long, device=device)
            for seq in going:
                assert seq.slot is not None
                ids[seq.slot, 0] = seq.tokens[-1]
                pos[seq.slot] = seq.length - 1
            kv_len = max(s.length for s in going)
            logits = self.model.decode_step(ids, self.cache, pos, kv_len)
            for seq in going:
                seq.logits = logits[seq.slot]
            self.batch_sizes[len(going)] = self.batch_sizes.get(len(going), 0) + 1
            self.steps += 1
        elapsed = time.perf_counter() - t0
        for seq in [*going, *done]:
            seq.decode_s += elapsed
        return done

    def _advance(self, seq: Sequence) -> bool:
        """Sample the next token from the sequence's logits; True once it is finished."""
        assert seq.logits is not None
        if len(seq.tokens) >= seq.params.max_new_tokens:
            seq.finish = "length"
            return True
        token = sample_next(seq.logits, seq.params, seq.generator)
        if token in self.eos_ids:
            seq.finish = "eos"
            return True
        seq.tokens.append(token)
        cut = -1
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.tokens)
            cut = _find_stop(seq.text, seq.params.stop)
        if cut >= 0:
            seq.text = seq.text[:cut]
            seq.finish = "stop"
        elif len(seq.tokens) >= seq.params.max_new_tokens or seq.length + 1 > self.slot_len:
            seq.finish = "length"
        self._stream(seq)
        return seq.finish is not None

    @staticmethod
    def _stream(seq: Sequence) -> None:
        if seq.on_text is None:
            return
        if seq.finish is not None:
            if len(seq.text) > seq.emitted:
                seq.on_text(seq.text[seq.emitted :])
                seq.emitted = len(seq.text)
            return
        safe = streamable_end(seq.text, seq.emitted, seq.params.stop)
        if safe > seq.emitted:
            seq.on_text(seq.text[seq.emitted : safe])
            seq.emitted = safe
