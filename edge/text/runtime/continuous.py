"""Continuous batching: several sequences decode in one step, and sequences join or
leave between steps.

The KV cache is allocated once with `slots` rows of `slot_len` positions each; which
sequence holds which row is decided by the KV cache manager (`self.kv`, the one owner of
KV memory), and the batcher only runs what it is handed. A sequence is prefilled alone
into its row, then advances one token per step together with every other running
sequence (one batched decode step, so each weight is read once per step for all of
them). Rows are handed out lowest first, so the running rows stay packed at the front; a
row the step does not advance (free, or mid-prefill) is fed a dummy token at its last
position, which any sequence there writes before it attends to it.

With `prefill_chunk` set, a prompt longer than that joins while others decode a chunk at
a time: one chunk per step, each attending to the chunks before it in the cache, so the
running sequences wait one chunk's time between tokens, not the whole prompt's. A
sequence alone is prefilled whole (nobody waits on it).

With `speculative_tokens` set (models.qa.speculative), a greedy sequence whose recent
tokens occurred earlier in its prompt or answer drafts the tokens that followed them
there (lookup.py), and its step runs its new token and the drafts as one chunk in its
row: the drafts the model would have chosen itself are taken, each as a step would have
taken it, so the answer is the one plain decoding gives, in fewer steps. The rest of the
batch decodes as before in the same step.

Every step's next tokens are chosen on the model's device for all sequences at once
(greedy or sampled) and come back to the host in one transfer. On CUDA the decode step is
captured as CUDA graphs at load, one per batch-size and KV-length bucket
(`capture_graphs`), and replayed per step; there the next step is launched on the
chosen tokens before they reach the host, so the GPU never waits while the host reads
them, checks EOS and stop strings and streams text. A sequence those tokens end has its
row of that step discarded.
A sequence with a grammar (structured output, grammar.py) has its row of the step's
logits masked to the tokens its grammar allows before the batch's tokens are chosen:
after the graph's replay, on a copy of the rows the batch samples from, so the graphs and
every other row are untouched. It does not draft (its drafts would need its mask at each
drafted position).
A prompt of up to fused_prefill.GRAPH_BUCKETS[-1] tokens is prefilled by a graph
captured at load too (fused_prefill.PrefillGraphs); a longer one op by op, and so is one
with rows spliced in (an image's: edge/text/model/splice.py), since the graph looks its
tokens up itself. Such a sequence shares a prefix (the prefix cache) only up to its first
splice.

Pausing drops the sequence's KV and keeps its tokens: on resume its prompt and the tokens
generated so far are prefilled again (recomputation, as vLLM does on preemption). Keeping
the KV would hold the very memory the pause is meant to free; recomputing a few hundred
tokens costs one prefill. Spliced rows that a sequence can make again (`make_splices`: an
image's, made by the tower once the sequence is admitted) are dropped with it too, and
made again when it is admitted again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from edge.text.kv.float_cache import KVCache, SparseAttention
from edge.text.kv.kv_cache import KVCacheManager, KVSlot
from edge.text.kv.kv_offload import KVOffload, RestoreFailed, SavedRow
from edge.text.kv.kv_quant import KVFormat
from edge.text.kv.prefix_cache import MIN_TOKENS as MIN_PREFIX
from edge.text.kv.prefix_cache import PrefixCache
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import LlamaModel
from edge.text.model.splice import Splice, first_spliced
from edge.text.runtime import cpu_step, fused_prefill, fused_step, lookup
from edge.text.runtime.cuda_graphs import StepGraphs
from edge.text.runtime.generate import SamplingParams, _find_stop, choose_rows, streamable_end
from edge.text.runtime.grammar import Constraint, Grammars, allowed_any, apply_masks
from edge.timing import events_ms

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
    decoded: int = 0  # tokens `text` was decoded from (it is decoded only when needed)
    emitted: int = 0
    finish: str | None = None  # "eos" | "stop" | "length" once done; "error": see `error`
    error: str | None = None  # why its generation failed (its scores stopped being finite)
    slot: int | None = None  # the cache row it decodes in, while running
    kv: KVSlot | None = None  # the KV manager's grant for that row, while running
    logits: torch.Tensor | None = None  # next-token logits, set by prefill and by steps
    generator: torch.Generator | None = None
    seed: int = 0
    prefill_ms: float = 0.0
    prefilled: int = 0  # tokens of prompt + tokens in its KV row; short of them: mid-prefill
    decode_s: float = 0.0
    pauses: int = 0
    saved: SavedRow | None = None  # its row off the device while paused (edge/text/kv/kv_offload.py)
    prefix: int = 0  # leading prompt tokens others may share (system and documents; prefix_cache.py)
    split: int | None = None  # where its prefill stops to keep the prefix (decided at admission)
    # Where its time went (edge/timing.py): tokenizing its prompt, decoding tokens to
    # text, and the host's clock as each token was taken. On CUDA each prefill, and each
    # decode step it was in, is also bracketed by CUDA events (prefill_gpu_ms and
    # decode_gpu_ms read them once they have run; a step's pair is shared by its batch).
    tokenize_ms: float = 0.0
    detokenize_ms: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prefill_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    decode_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    # Speculative decoding (prompt lookup): draft tokens verified, and those the model
    # agreed with and that were taken.
    drafted: int = 0
    accepted: int = 0
    # Structured output (grammar.py): the tokens it may take are masked to its grammar's
    # before each of its tokens is chosen; None: unconstrained.
    grammar: Constraint | None = None
    # Rows its prefill reads in place of its prompt tokens' embeddings (an image's
    # features: edge/text/model/splice.py), at prompt positions.
    splices: tuple[Splice, ...] = ()
    # What makes `splices` where they are made only while the sequence holds a KV row:
    # called by `admit` once the row is granted, before the prefill, and again after a
    # pause, which drops them with the row. Its exceptions are the caller's to answer (an
    # image that cannot be read is its job's own fault).
    make_splices: Callable[[], tuple[Splice, ...]] | None = None

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else time.time_ns() & 0x7FFFFFFF

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the last sampled token is written."""
        return len(self.prompt) + len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 and self.tokens else 0.0

    def prefill_gpu_ms(self) -> float | None:
        """The prefills' time on the GPU's own clock (CUDA events), None off CUDA."""
        return events_ms(self.prefill_events)

    def decode_gpu_ms(self) -> float | None:
        """Its decode steps' time on the GPU's own clock (CUDA events), None off CUDA."""
        return events_ms(self.decode_events)


class ContinuousBatcher:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        eos_ids: frozenset[int],
        slots: int,
        slot_len: int,
        kv_format: KVFormat | None = None,
        sparse: SparseAttention | None = None,
    ) -> None:
        """tokenizer None: token ids only (no text, no stop strings), for random-weight
        models in benchmarks. kv_format: how the KV cache holds keys and values (float
        in the activations' type unless told; edge/text/kv/kv_quant.py). sparse: top-k
        block attention in the CPU's decode step (a float cache keeps the summaries it
        selects by: float_cache.py)."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.cache = model.new_cache(slots, slot_len, kv_format, sparse=sparse)
        self.slot_len = self.cache.max_len
        # Bytes per token from what the cache allocated, in whatever format it holds.
        per_token = -(-self.cache.nbytes // (slots * self.slot_len))
        fmt = kv_format.dtype if kv_format is not None else "float16"
        self.kv = KVCacheManager(slots, self.slot_len, per_token, fmt)
        self.device = model.device
        self.graphs: StepGraphs | None = None
        self.prefill_graphs: fused_prefill.PrefillGraphs | None = None
        # Where a paused sequence's row goes, to be restored on resume (None: dropped, and
        # prefilled again).
        self.offload: KVOffload | None = None
        # Prefilled prompt prefixes shared by later prompts (None: every prompt prefilled whole).
        self.prefix_cache: PrefixCache | None = None
        self.running: list[Sequence] = []
        self.prefill_chunk = 0  # tokens per prefill chunk while others decode; 0: whole prompts
        # Draft tokens a sequence proposes by prompt lookup per step, verified in one
        # pass of the model (0: no speculation). Not with CUDA graphs: see _draft.
        self.speculative_tokens = 0
        # CUDA prefills whose time the offload and the prefix cache want, read from their
        # events once the GPU has passed them rather than waited for: (events, start, tokens).
        self._untimed: list[tuple[tuple[torch.cuda.Event, torch.cuda.Event], int, int]] = []
        self.steps = 0
        self.batch_sizes: dict[int, int] = {}  # sequences per decode step -> steps
        # The grammar engine bound to this model's tokenizer (structured output), built by
        # the first caller that asks for it (`grammars`); never for a model without one.
        self._grammars: Grammars | None = None
        self.mask_s = 0.0  # host time spent computing and applying grammar masks (benchmarks read it)

    @property
    def grammars(self) -> Grammars:
        if self.tokenizer is None:
            raise RuntimeError("structured output needs the model's tokenizer")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.eos_ids, self.model.config.vocab_size)
        return self._grammars

    @property
    def slots(self) -> int:
        return self.cache.batch

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    def capture_graphs(self) -> int:
        """Capture the decode step as CUDA graphs for every batch and KV-length bucket
        (after warm_up, which builds and tunes every kernel); returns how many."""
        self.graphs = StepGraphs(self.model, self.cache, self.slots)
        captured = self.graphs.capture_all()
        # A quantized cache is written by its own kernels (edge/text/kv/kv_attention.py): its
        # prompts are prefilled op by op.
        if fused_prefill.supported(self.model) and isinstance(self.cache, KVCache):
            self.prefill_graphs = fused_prefill.PrefillGraphs(self.model, self.cache, pool=self.graphs.pool)
            captured += self.prefill_graphs.capture_all()
        return captured

    @torch.inference_mode()
    def warm_up(self, prefill_lengths: tuple[int, ...] = (1, 8, 9, 64)) -> int:
        """Run every shape serving will run, before any job: prefills of a few lengths
        (either side of the INT4 GEMV's row limit), each also as a chunk after as many
        cached tokens (what a prefix-cache hit, a chunked prefill and a prompt resumed
        mid-prefill run: attention to the cache, and on CUDA its own kernels), and one
        decode step at every batch size and every power-of-two KV length. Kernels
        compiled or loaded on first use (Triton's, on CUDA) are built now, while no other
        branch's thread is waiting on the interpreter, their memory is inside the model's
        measured footprint, and no job's first prefill carries their cost into the
        figures the prefix cache and the offload decide by. Writes only to free rows,
        which a prefill overwrites; returns the steps run.

        On the CPU nothing is compiled or tuned per shape (our kernels are built at load,
        one code for every row count; the INT4 row limit is CUDA's): the longest prefill,
        a chunk after it, and a decode step alone and at full batch over the whole KV
        length touch every weight and every code path, and the other shapes only cost
        start time (a second a start at one thread, where every test starts a daemon)."""
        if self.running:
            raise RuntimeError("warm_up runs before any sequence is admitted")
        device = self.model.device
        cpu = device.type == "cpu"
        runs = 0
        for length in (max(prefill_lengths),) if cpu else prefill_lengths:
            ids = torch.zeros((1, length), dtype=torch.long, device=device)
            for start in (0, length):
                if start + length < self.slot_len:
                    self.model(ids, self._row(0), start)
                    runs += 1
        for batch in sorted({1, self.slots}) if cpu else range(1, self.slots + 1):
            ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
            pos = torch.zeros(batch, dtype=torch.long, device=device)
            kv_len = self.slot_len if cpu else 1
            while True:
                fused_step.decode_step(self.model, ids, self.cache, pos, min(kv_len, self.slot_len))
                runs += 1
                if kv_len >= self.slot_len:
                    break
                kv_len *= 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return runs

    def _row(self, slot: int) -> KVCache | QuantKVCache:
        return self.cache.rows(slot, 1)

    @torch.inference_mode()
    def admit(self, seq: Sequence, slot: KVSlot) -> None:
        """Prefill a sequence (its prompt plus any tokens from before a pause) into the row
        the KV manager granted it; it decodes from the next step on."""
        ids = seq.prompt + seq.tokens
        if len(ids) + 1 > self.slot_len:
            raise ValueError(f"{len(ids)} tokens do not fit a KV row of {self.slot_len}")
        if any(s.slot == slot.row for s in self.running):
            raise RuntimeError(f"KV row {slot.row} is already decoding another sequence")
        if seq.make_splices is not None and not seq.splices:
            # Before anything of the sequence changes, so that a failure leaves it as it was;
            # made even where an offloaded row may be restored, which can still fall back to
            # prefilling it again.
            seq.splices = seq.make_splices()
        if seq.params.temperature > 0.0 and (seq.generator is None or seq.generator.device != self.device):
            # On the device the logits are on, so drawing a token needs no copy back first.
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.seed)
        seq.slot, seq.kv = slot.row, slot
        seq.logits, seq.prefilled, seq.split = None, 0, None
        self.note_timed()  # the costs restore-or-recompute and the prefix split go by
        if seq.saved is not None and self._restore(seq):
            self.running.append(seq)
            return
        # Decided once: each chunk of a chunked prefill, and the part after a kept prefix,
        # stops where this says.
        seq.split = self._split_at(seq, ids)
        if seq.split is not None and self.prefix_cache is not None:
            entry = self.prefix_cache.get(ids[: seq.split])
            if entry is not None:  # the prefix's row as its first prefill left it
                self.cache.load_row(slot.row, entry.tokens, entry.saved)
                seq.prefilled = entry.tokens
        chunked = self.prefill_chunk > 0 and len(ids) - seq.prefilled > self.prefill_chunk and bool(self.running)
        if chunked:
            self._prefill(seq, ids, self.prefill_chunk)
        else:
            while seq.logits is None:  # at once, or in two parts either side of a prefix kept
                self._prefill(seq, ids, len(ids))
        self.running.append(seq)

    def _split_at(self, seq: Sequence, ids: list[int]) -> int | None:
        """Where the sequence's prompt splits for the prefix cache, if it does: where the
        measured costs say a hit pays, and now and then where they do not (recheck.py)."""
        if self.prefix_cache is None or not MIN_PREFIX <= seq.prefix < len(ids):
            return None
        spliced = first_spliced(seq.splices)
        if spliced is not None and seq.prefix > spliced:
            # The cache keys a prefix by its ids, which at a splice's positions (an image
            # token repeated) do not say what the rows were.
            return None
        if not self.prefix_cache.should_split(seq.prefix, len(ids) - seq.prefix):
            return None
        return seq.prefix

    def _restore(self, seq: Sequence) -> bool:
        """Put a paused sequence's offloaded row back where the measured figures say that
        is faster than prefilling it again; True if it was."""
        saved, seq.saved = seq.saved, None
        assert saved is not None and seq.slot is not None
        if self.offload is None:
            return False
        if self.offload.choose(saved) == "recompute":
            self.offload.recomputed(saved)
            return False
        try:
            seq.logits = self.offload.restore(saved, self.cache, seq.slot)
        except RestoreFailed:  # its file gone or damaged (let go, logged): prefilled again
            seq.logits = None
            return False
        seq.prefilled = saved.length
        return True

    def _prefill(self, seq: Sequence, ids: list[int], count: int) -> None:
        """The next `count` tokens of `ids` into the sequence's row after those already
        there; the last of them sets its next-token logits."""
        assert seq.slot is not None
        start, end = seq.prefilled, min(len(ids), seq.prefilled + count)
        boundary = seq.split
        if boundary is not None and start < boundary < end:
            end = boundary  # the prefix alone, so that what is kept is the prefix's own row
        t0 = time.perf_counter()
        events = self._events()
        graphs = self.prefill_graphs
        if start == 0 and graphs is not None and graphs.covers(end) and not seq.splices:
            logits = graphs.run(ids[:end], seq.slot)
        else:
            # A prompt with spliced rows is prefilled op by op: the captured prefill looks
            # its tokens up in the table inside the graph.
            chunk = torch.tensor([ids[start:end]], device=self.device)
            logits = self.model(chunk, self._row(seq.slot), start, splices=seq.splices)[0, -1]
        if events is not None:
            events[1].record()
            seq.prefill_events.append(events)
        if self.offload is not None or self.prefix_cache is not None:
            # What recomputing a row, or prefilling after a kept prefix, costs: on CUDA
            # from the events once the GPU has run them, without waiting here.
            if events is not None:
                self._untimed.append((events, start, end - start))
            else:
                self._note_prefill(start, end - start, time.perf_counter() - t0)
        seq.prefill_ms += (time.perf_counter() - t0) * 1000.0
        seq.prefilled = end
        if boundary is not None and end == boundary and self.prefix_cache is not None:
            self.prefix_cache.put(ids[:boundary], self.cache.save_row(seq.slot, boundary))
        if end == len(ids):
            seq.logits = logits

    def _note_prefill(self, start: int, tokens: int, seconds: float) -> None:
        if self.offload is not None:
            self.offload.note_prefill(tokens, seconds)
        if self.prefix_cache is not None:
            self.prefix_cache.note_prefill(start, tokens, seconds * 1000.0, whole=start == 0)

    def note_timed(self) -> None:
        """The CUDA prefills the GPU has finished since the last call, into the measured
        costs (events on one stream complete in the order they were recorded)."""
        while self._untimed and self._untimed[0][0][1].query():  # type: ignore[no-untyped-call]
            (begin, end), start, tokens = self._untimed.pop(0)
            self._note_prefill(start, tokens, begin.elapsed_time(end) / 1000.0)

    def single(self, seq: Sequence, owner: str = "alone") -> Sequence:
        """Run one sequence to its end alone (the batcher idle): rows from the manager."""
        slot = self.kv.allocate_slots(owner, min(len(seq.prompt) + seq.params.max_new_tokens, self.slot_len))
        if slot is None:
            raise RuntimeError("no KV row free")
        try:
            self.admit(seq, slot)
            while seq.finish is None:
                self.step()
        finally:
            self.kv.free(slot)
            if seq in self.running:
                self._leave(seq)
        return seq

    def run_all(self, seqs: list[Sequence]) -> list[Sequence]:
        """Decode sequences to their ends together (the batcher idle before): each
        admitted as soon as the KV manager grants it a row, the lowest first, so
        sequences join and leave the batch as a continuous scheduler would have them
        (tools, tests and evaluation runs; the text worker schedules for serving)."""
        waiting = list(seqs)
        try:
            while waiting or self.running:
                while waiting:
                    seq = waiting[0]
                    slot = self.kv.allocate_slots(
                        f"batch-{id(seq)}", min(len(seq.prompt) + seq.params.max_new_tokens, self.slot_len)
                    )
                    if slot is None:
                        break
                    waiting.pop(0)
                    self.admit(seq, slot)
                for done in self.step():
                    if done.kv is not None:
                        self.kv.free(done.kv)
                        done.kv = None
        finally:
            for seq in list(self.running):
                slot = self._leave(seq)
                if slot is not None:
                    self.kv.free(slot)
        return seqs

    def pause(self, seq: Sequence, keep: bool = True) -> KVSlot | None:
        """Take a running sequence out. Its row is offloaded (if there is an offload and
        `keep`), else dropped, to be prefilled again. Returns the grant it held, for the
        caller to give back to the KV manager."""
        if keep and self.offload is not None and seq.slot is not None:
            length = seq.length if seq.logits is not None else seq.prefilled
            seq.saved = self.offload.save(self.cache, seq.slot, length, seq.logits)
        slot = self._leave(seq)
        seq.logits = None
        seq.pauses += 1
        if seq.make_splices is not None:
            # Rows that can be made again go with the row: a paused sequence waits holding
            # no memory but its tokens, and they are made again when it is admitted.
            seq.splices = ()
        return slot

    def _leave(self, seq: Sequence) -> KVSlot | None:
        self.running.remove(seq)
        slot = seq.kv
        seq.slot = seq.kv = None
        return slot

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Choose one token for every running sequence, then run one batched decode step
        for those still going; returns the sequences that finished (out of the batch,
        their KV grants `seq.kv` still set for the caller to free)."""
        if not self.running:
            return []
        for seq in [s for s in self.running if s.logits is None]:  # mid-prefill: one more chunk
            self._prefill(seq, seq.prompt + seq.tokens, self.prefill_chunk)
        running = [s for s in self.running if s.logits is not None]
        if not running:
            return []
        t0 = time.perf_counter()
        events = self._events()
        logits = torch.stack([s.logits for s in running if s.logits is not None])
        # A row whose scores are not finite (NaN or infinity: a fault in that sequence's
        # state) must not take the batch with it: its scores are read as zeros, so that
        # drawing a token cannot fail, and its token comes back as -1, which ends it alone.
        finite = torch.isfinite(logits).all(dim=-1)
        logits = torch.where(finite.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
        # After the finiteness check, which the -inf of a mask would fail; before choosing, so
        # a sampled row draws only among its grammar's tokens.
        blocked = self._mask(running, logits)
        params, generators = [s.params for s in running], [s.generator for s in running]
        step_logits: torch.Tensor | None = None  # the step after these tokens, where already run
        chosen = choose_rows(logits, params, generators)
        reported = torch.where(finite, chosen, torch.full_like(chosen, -1))
        if self.graphs is not None:
            step_logits, tokens = self._run_ahead(running, chosen, reported)
        else:
            tokens = reported.tolist()  # one transfer for the whole batch
        done: list[Sequence] = []
        drafts: dict[Sequence, list[int]] = {}
        for i, (seq, token) in enumerate(zip(running, tokens, strict=True)):
            slot = seq.slot
            if token < 0 or i in blocked:
                seq.finish = "error"
                if i in blocked:
                    seq.error = "its grammar allows no next token: " + (blocked[i] or "a dead end")
                    logger.error("a sequence's grammar allows no next token; it alone is ended: %s", blocked[i])
                else:
                    seq.error = "its next-token scores were not finite (NaN or infinity)"
                    logger.error("a sequence's next-token scores were not finite; it alone is ended")
                done.append(seq)
                self.running.remove(seq)
                seq.slot = None
                continue
            if self._advance(seq, token):
                done.append(seq)
                self.running.remove(seq)
                seq.slot = None
            elif step_logits is not None:
                seq.logits = step_logits[slot]
            else:
                draft = self._draft(seq)
                if draft:
                    drafts[seq] = draft
        for seq, draft in drafts.items():
            if self._verify(seq, draft):
                done.append(seq)
                self.running.remove(seq)
                seq.slot = None
        # Not those mid-prefill, nor those whose token went in with their drafts.
        going = [s for s in self.running if s in running and s not in drafts]
        if going and step_logits is None:
            n = max(s.slot for s in going if s.slot is not None) + 1
            ids = [0] * n
            positions = [self.slot_len - 1] * n  # rows not advanced: their last position
            for seq in going:
                assert seq.slot is not None
                ids[seq.slot] = seq.tokens[-1]
                positions[seq.slot] = seq.length - 1
            kv_len = max(s.length for s in going)
            step_logits = self._decode(ids, positions, kv_len)
            for seq in going:
                seq.logits = step_logits[seq.slot]
        advanced = len(going) + len(drafts)
        if advanced:
            self.batch_sizes[advanced] = self.batch_sizes.get(advanced, 0) + 1
            self.steps += 1
        elapsed = time.perf_counter() - t0
        if events is not None:
            events[1].record()
        for seq in running:
            seq.decode_s += elapsed
            if events is not None:
                seq.decode_events.append(events)
        return done

    def _mask(self, running: list[Sequence], logits: torch.Tensor) -> dict[int, str | None]:
        """Mask the rows of sequences with a grammar to the tokens it allows (in place);
        returns the rows whose grammar allows none (its error, if it has one), which the
        step ends instead of taking a token."""
        rows = [i for i, s in enumerate(running) if s.grammar is not None]
        if not rows:
            return {}
        t0 = time.perf_counter()
        constraints = [c for c in (running[i].grammar for i in rows) if c is not None]
        masks = self.grammars.masks(constraints, pin=logits.device.type == "cuda")
        apply_masks(logits, rows, masks)
        # A row its grammar leaves no token, or whose matcher failed (a mask it fills then
        # may allow only the end of text), is ended rather than drawn from; its scores are
        # read as zeros, so that choosing the batch's tokens cannot fail on a row of -inf.
        allowed = allowed_any(masks)
        blocked = {
            i: c.error for i, c, ok in zip(rows, constraints, allowed, strict=True) if not ok or c.error is not None
        }
        if blocked:
            logits[torch.tensor(list(blocked), dtype=torch.long, device=logits.device)] = 0.0
        self.mask_s += time.perf_counter() - t0
        return blocked

    def _draft(self, seq: Sequence) -> list[int]:
        """Draft tokens to verify after the sequence's newest token (not yet in its row),
        by prompt lookup; [] where it decodes as usual this step.

        Greedy sequences speculate, and sampled ones without a nucleus cut (top_p 1):
        their drafts are taken by the rejection rule (_accepted_draws), which keeps the
        sampling distribution; with a cut, the residual a rejection leaves is not a
        distribution the next draw can take as logits. Constrained ones do not: each
        drafted position would need its own mask. Not with CUDA graphs: the step run
        ahead on the device is one token per row.
        At most as many drafts as the sequence may still take, and none at the row's last
        position, which rows a step does not advance are written at."""
        k = self.speculative_tokens
        sampled_with_cut = seq.params.temperature > 0.0 and seq.params.top_p < 1.0
        if k <= 0 or self.graphs is not None or sampled_with_cut or seq.grammar is not None:
            return []
        start = seq.length - 1  # where the newest token goes
        k = min(k, seq.params.max_new_tokens - len(seq.tokens), self.slot_len - 2 - start)
        if isinstance(self.cache, QuantKVCache):
            # A quantized row codes a key block from its float ring once the block leaves
            # the window, and the positions a chunk codes never go into the ring. Drafts
            # that made the chunk code a block could put rejected keys into codes (int8
            # has no window), and the block would be coded again later from ring slots
            # the chunk's rejected positions overwrote. A chunk that codes nothing keeps
            # every write in the ring, on slots beyond the row's live ones (the window
            # and a key block fit in the ring), which the tokens really taken there
            # overwrite before attention reads them: so drafts stop short of the next
            # block to be coded.
            fmt = self.cache.fmt
            while k > 0 and fmt.coded(start + k + 1) != fmt.coded(start):
                k -= 1
        if k <= 0:
            return []
        return lookup.propose(seq.prompt + seq.tokens, k)

    def _verify(self, seq: Sequence, draft: list[int]) -> bool:
        """Run the model once over the sequence's newest token and its drafts, as a chunk
        in its row after its cached tokens, and take the drafts up to the first the model
        would not have chosen greedily (a sampled sequence: up to the first the rejection
        rule turns down), each as a decode step would have taken it (EOS, stop strings,
        max_new_tokens). Its next-token logits are the last taken position's; the keys
        and values written for drafts not taken lie beyond its length, overwritten before
        they are attended. True once it is finished."""
        assert seq.slot is not None
        start = seq.length - 1
        if isinstance(self.cache, KVCache) and fused_step.steps_on_cpu(self.model):
            # The CPU's step takes the token and its drafts as rows of one step: the
            # weights read once, each position's logits those of decoding it alone.
            logits = cpu_step.verify(self.model, [seq.tokens[-1], *draft], self.cache, seq.slot, start)
        else:
            chunk = torch.tensor([[seq.tokens[-1], *draft]], dtype=torch.long, device=self.device)
            logits = self.model(chunk, self._row(seq.slot), start, last_only=False)[0]
        seq.drafted += len(draft)
        sampled = seq.params.temperature > 0.0
        if sampled:
            taken = _accepted_draws(logits[: len(draft)], draft, seq.params.temperature, seq.generator)
        else:
            best: list[int] = torch.argmax(logits, dim=-1).tolist()  # one transfer for the chunk
            taken = next((i for i, (t, c) in enumerate(zip(draft, best, strict=False)) if t != c), len(draft))
        for token in draft[:taken]:
            seq.accepted += 1
            if self._advance(seq, token):
                return True
        seq.logits = logits[taken]
        if sampled and taken < len(draft):
            # Turned down: the next token is drawn from what is left of the distribution
            # once the draft's token is taken out (the rule's residual, the draft being
            # certain of its token). The lowest finite score, not -inf, which the step
            # reads as a fault in the row.
            seq.logits = seq.logits.clone()
            seq.logits[draft[taken]] = torch.finfo(seq.logits.dtype).min
        return False

    def _events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """On CUDA, a (start, end) pair of timing events, the start recorded now on the
        current stream; None elsewhere."""
        if self.device.type != "cuda":
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
        events[0].record()
        return events

    def _run_ahead(
        self, running: list[Sequence], chosen: torch.Tensor, reported: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """On CUDA graphs: the next step, launched on the tokens chosen on the device
        before they come back, every running sequence assumed to go on (each at the
        position its new token takes); returns its logits and the tokens. The sequences
        those tokens end drop their row of it."""
        assert self.graphs is not None
        n = max(s.slot for s in running if s.slot is not None) + 1
        sources, positions = [len(running)] * n, [self.slot_len - 1] * n
        for i, seq in enumerate(running):
            assert seq.slot is not None
            sources[seq.slot], positions[seq.slot] = i, seq.length
        kv_len = max(s.length for s in running) + 1
        if isinstance(self.cache, KVCache):
            self.cache.make_room_for_step(positions)
        return self.graphs.run_chosen(chosen, sources, positions, kv_len, reported)

    def _decode(self, ids: list[int], positions: list[int], kv_len: int) -> torch.Tensor:
        if isinstance(self.cache, KVCache):
            self.cache.make_room_for_step(positions)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device).view(-1, 1)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return fused_step.decode_step(self.model, ids_t, self.cache, pos_t, kv_len)

    def _advance(self, seq: Sequence, token: int) -> bool:
        """Take the token chosen for the sequence; True once it is finished."""
        if len(seq.tokens) >= seq.params.max_new_tokens:
            seq.finish = "length"
        elif token in self.eos_ids and not seq.params.ignore_eos:
            seq.finish = "eos"
        else:
            seq.tokens.append(token)
            seq.token_times.append(time.perf_counter())
            if seq.grammar is not None and not seq.grammar.accept(token):
                # The mask allowed only tokens the grammar admits: this is a fault, and the
                # text so far is not to be passed off as a sentence of it.
                seq.finish, seq.error = "error", f"the grammar refused a token: {seq.grammar.error}"
            # The text is decoded every token only when something reads it as it grows
            # (stop strings, streaming); otherwise once, at the end.
            if seq.finish is None and self.tokenizer is not None and (seq.params.stop or seq.on_text is not None):
                self._decode_text(seq)
                cut = _find_stop(seq.text, seq.params.stop)
                if cut >= 0:
                    seq.text = seq.text[:cut]
                    seq.finish = "stop"
            if seq.finish is None and (len(seq.tokens) >= seq.params.max_new_tokens or seq.length + 1 > self.slot_len):
                seq.finish = "length"
        if seq.finish is not None and seq.finish != "stop" and self.tokenizer is not None:
            self._decode_text(seq)
        self._stream(seq)
        return seq.finish is not None

    def _decode_text(self, seq: Sequence) -> None:
        if seq.decoded != len(seq.tokens):
            assert self.tokenizer is not None
            t0 = time.perf_counter()
            seq.text = self.tokenizer.decode(seq.tokens)
            seq.decoded = len(seq.tokens)
            seq.detokenize_ms += (time.perf_counter() - t0) * 1000.0

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


def _accepted_draws(
    logits: torch.Tensor, draft: list[int], temperature: float, generator: torch.Generator | None
) -> int:
    """How many of the drafts a sampled sequence takes, by the rejection rule of
    speculative sampling (Leviathan et al., 2023; Chen et al., 2023): draft i, proposed
    with certainty, is taken with the probability the model gives it after the ones
    before, the first turned down ending the run. With the residual draw the batcher
    makes after a turned-down draft, every token has the distribution plain sampling
    gives it. logits [k, V]: the model's scores before each draft."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    chosen = probs[torch.arange(len(draft), device=probs.device), torch.tensor(draft, device=probs.device)]
    draws = torch.rand(len(draft), generator=generator, device=probs.device)
    turned_down: list[bool] = (draws >= chosen).tolist()  # one transfer for the chunk
    return next((i for i, down in enumerate(turned_down) if down), len(draft))
