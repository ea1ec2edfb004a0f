"""Decoding constrained by a grammar (structured output): which tokens a sequence may take
next, as a bitmask over the vocabulary, applied to its row of the batch's logits before
its token is chosen.

The grammar engine is llguidance, chosen over xgrammar by measurement (bench/structured.py's
`engines`, rendered in docs/benchmarks.md): with SmolLM2's tokenizer on the CPU both compute
a mask in a small fraction of a decode step, but xgrammar's compile of a schema with bounds
(an integer's minimum and maximum, a string's maxLength) is far slower than llguidance's,
and a job waits for its compile; llguidance's wheel is one
abi3 file per platform (x86_64 and aarch64, any Python from 3.10) with no dependencies,
where xgrammar's pulls in transformers and triton at run time.

Its import is guarded (edge/json_grammar.py, where schemas become grammars): a box without
it serves every other job, and a job that asks for structured output is told it is
unavailable.

A compiled grammar is cached by its text's hash (bounded, least recently used first out):
each sequence gets a copy of the cached matcher, which shares its compiled lexer. Compiles
run on a thread of their own (`ready`), so the text branch's thread keeps decoding the
running sequences while a new schema compiles (llguidance lets go of the interpreter
while it compiles); the job that asked waits in the queue meanwhile. The first structured
job also has the engine's view of the tokenizer built there, which holds the interpreter
(about a third of a second for SmolLM2, once per process): the running sequences pause
for it that once.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
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
    takes a fraction of a second) by the first job that asks for structured output.
    Compiles run on one thread of their own (`ready`); a grammar the engine refuses is
    remembered with its error like a compiled one."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Iterable[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words of a row's bitmask
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()  # the cache and the compiles in flight
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # hash -> matcher, or the GrammarError
        self._compiling: dict[str, Future[None]] = {}
        self._failed: dict[str, bool] = {}  # compiles that broke (not refusals): ready once, then tried again
        self._pool: ThreadPoolExecutor | None = None
        self.compiled = 0  # grammars compiled (misses), for tests and status

    def _lltokenizer(self) -> Any:
        """The engine's view of the tokenizer, built once (llguidance holds the interpreter
        while it builds it: about a third of a second for SmolLM2's 49k tokens, once per
        process); a refusal is remembered, not tried again for every schema."""
        with self._tokenizer_lock:
            if isinstance(self._ll, GrammarError):
                raise GrammarError(str(self._ll))
            if self._ll is None:
                llg = require()
                try:
                    self._ll = llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)
                except (KeyboardInterrupt, SystemExit, MemoryError):
                    raise
                except BaseException as err:  # the engine's Rust panics are BaseExceptions
                    self._ll = GrammarError(f"the grammar engine cannot read this model's tokenizer: {err}"[:300])
                    raise GrammarError(str(self._ll)) from err
            return self._ll

    @staticmethod
    def _key(grammar: str) -> str:
        return hashlib.sha256(grammar.encode("utf-8")).hexdigest()

    def _compile(self, grammar: str) -> Any:
        """The grammar's matcher at its start, or the GrammarError saying why not."""
        llg = require()
        try:
            proto = llg.LLMatcher(self._lltokenizer(), grammar, log_level=0, limits=limits())
        except GrammarError as err:
            return err
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except BaseException as err:  # the engine's Rust panics are BaseExceptions: its refusals
            return GrammarError(f"{type(err).__name__}: {err}"[:300])
        if proto.is_error():
            return GrammarError(str(proto.get_error()).strip().splitlines()[0][:300])
        return proto

    def _store(self, key: str, compiled: Any) -> None:
        with self._lock:
            if not isinstance(compiled, GrammarError):
                self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)

    def ready(self, grammar: str, wait_s: float = 0.0) -> bool:
        """Whether `constraint(grammar)` would return at once (compiled, or refused: its
        error is ready too). If not, its compile is started on the compile thread (once)
        and waited for up to `wait_s`."""
        key = self._key(grammar)
        with self._lock:
            if key in self._cache or self._failed.pop(key, False):
                return True  # (a compile that failed otherwise is tried again by constraint: its error is the job's)
            future = self._compiling.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
                future = self._pool.submit(self._compile_into_cache, key, grammar)
                self._compiling[key] = future
        if wait_s > 0:
            try:
                future.result(timeout=wait_s)
            except futures.TimeoutError:  # (not the builtin one before Python 3.11)
                return False
        with self._lock:
            return key in self._cache or self._failed.pop(key, False)

    def _compile_into_cache(self, key: str, grammar: str) -> None:
        try:
            self._store(key, self._compile(grammar))
        except BaseException:  # not a refusal (out of memory, say): not remembered as one
            logger.exception("grammar compile failed")
            with self._lock:
                self._failed[key] = True
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def constraint(self, grammar: str) -> Constraint:
        """A fresh Constraint at the start of the grammar; GrammarError if the engine cannot
        build it for this tokenizer. Compiles here where `ready` did not."""
        require()
        key = self._key(grammar)
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
        if proto is None:
            proto = self._compile(grammar)
            self._store(key, proto)
        if isinstance(proto, GrammarError):
            raise GrammarError(str(proto))
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
