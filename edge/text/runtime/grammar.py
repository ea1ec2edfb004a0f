"""Decoding constrained by a grammar (structured output): which tokens a sequence may take
next, as a bitmask over the vocabulary, applied to its row of the batch's logits before
its token is chosen.

The grammar engine is llguidance, chosen over xgrammar by measurement (bench/structured.py's
`engines`, rendered in docs/benchmarks.md): with SmolLM2's tokenizer on the CPU both compute
a mask in a small fraction of a decode step, but xgrammar's compile of a schema with bounds
(an integer's minimum and maximum, a string's maxLength) is far slower than llguidance's,
and a compile runs on the text branch's thread between steps; llguidance's wheel is one
abi3 file per platform (x86_64 and aarch64, any Python from 3.10) with no dependencies,
where xgrammar's pulls in transformers and triton at run time.

Its import is guarded (edge/json_grammar.py, where schemas become grammars): a box without
it serves every other job, and a job that asks for structured output is told it is
unavailable.

A compiled grammar is cached by its text's hash (bounded, least recently used first out):
each sequence gets a copy of the cached matcher, which shares its compiled lexer.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from edge.json_grammar import (  # the schema side, re-exported: the batcher's callers reach it here
    ENGINE,
    GrammarError,
    available,
    engine_version,
    json_schema_grammar,
    limits,
    missing_reason,
    require,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ENGINE",
    "Constraint",
    "GrammarError",
    "Grammars",
    "allowed_any",
    "apply_masks",
    "available",
    "engine_version",
    "json_schema_grammar",
    "missing_reason",
    "unpack_on",
]

CACHE_ENTRIES = 64  # compiled grammars kept (a few kinds of job per box; each is small)


class Constraint:
    """One sequence's position in its grammar: the mask of the tokens it may take next, and
    each token it takes. The batcher masks with it and feeds it every token taken."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, out: torch.Tensor) -> None:
        """Write the next-token bitmask (int32 words, bit i of word w: token 32*w+i) into
        `out`, a contiguous CPU tensor of one row."""
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def accept(self, token: int) -> bool:
        """Take a token; False where the grammar does not admit it (the matcher's error)."""
        return bool(self._m.consume_token(token))

    @property
    def complete(self) -> bool:
        """True where the text so far is a whole sentence of the grammar (the JSON closed)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None


class Grammars:
    """The grammar engine bound to one model's tokenizer: grammar text to Constraint, with
    compiled grammars cached by hash. Built lazily (the engine's view of the tokenizer
    takes a fraction of a second) by the first job that asks for structured output."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words of a row's bitmask
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._ll: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compiled = 0  # grammars compiled (misses), for tests and status

    def _lltokenizer(self) -> Any:
        if self._ll is None:
            llg = require()
            try:
                self._ll = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # the engine's Rust panics are BaseExceptions
                raise GrammarError(f"the grammar engine cannot read this model's tokenizer: {err}"[:300]) from err
        return self._ll

    def constraint(self, grammar: str) -> Constraint:
        """A fresh Constraint at the start of the grammar; GrammarError if the engine cannot
        build it for this tokenizer."""
        llg = require()
        key = hashlib.sha256(grammar.encode("utf-8")).hexdigest()
        proto = self._cache.get(key)
        if proto is None:
            try:
                proto = llg.LLMatcher(self._lltokenizer(), grammar, log_level=0, limits=limits())
            except GrammarError:
                raise
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # the engine's Rust panics are BaseExceptions
                raise GrammarError(f"{type(err).__name__}: {err}"[:300]) from err
            if proto.is_error():
                raise GrammarError(str(proto.get_error()).strip().splitlines()[0][:300])
            self.compiled += 1
            self._cache[key] = proto
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Constraint(proto.deep_copy())

    def masks(self, constraints: list[Constraint], pin: bool) -> torch.Tensor:
        """The next-token bitmasks of several sequences, [n, words] int32 on the host; in
        page-locked memory where `pin` (the copy to the GPU then does not wait on the
        host, and torch's pinned allocator keeps a block until the copies reading it ran)."""
        out = torch.empty((len(constraints), self.words), dtype=torch.int32, pin_memory=pin)
        for i, c in enumerate(constraints):
            c.fill(out[i])
        return out


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set to -inf, in place, every token of logits [n, V] row rows[i] that masks[i] (int32
    bitmask words, on the host) does not allow. On a GPU the unpacking runs there: only
    the bitmask (4 bytes per 32 tokens) crosses to it, not a [rows, V] tensor. On the CPU
    numpy unpacks it in one pass (torch's shifts would be several passes over [rows, V],
    split across the threads the decode step needs)."""
    device = logits.device
    vocab = logits.shape[-1]
    if device.type == "cpu":
        # Little-endian words: bit i of word w is bit i % 8 of byte 4w + i // 8 (x86_64, aarch64).
        unpacked = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(unpacked.view(np.bool_))
        if allowed.shape[1] < vocab:  # tokens past the tokenizer's (a padded embedding): never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        for i, row in enumerate(rows):
            logits[row].masked_fill_(~allowed[i], float("-inf"))
        return
    allowed = unpack_on(masks, device, vocab)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_on(masks: torch.Tensor, device: torch.device, vocab: int) -> torch.Tensor:
    """Bitmask words [n, words] (host) as allowed-token flags [n, vocab] on `device`, unpacked
    there by shifts (the GPU path; on the CPU apply_masks unpacks with numpy instead)."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = masks.to(device, non_blocking=True)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(masks.shape[0], -1)
    if bits.shape[1] < vocab:  # tokens past the tokenizer's (a padded embedding): never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab].bool()


def allowed_any(masks: torch.Tensor) -> list[bool]:
    """Per row of bitmasks: whether any token is allowed (host side, no device work)."""
    return [bool(v) for v in (masks != 0).any(dim=1).tolist()]
