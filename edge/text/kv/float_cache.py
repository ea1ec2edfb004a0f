"""The float KV cache: keys and values in the activations' type, allocated once.

A sliding layer (Mistral's, Phi-3's, Gemma 3's local ones) reads only its last `window`
positions, so where rows are longer than that needs, the sliding layers keep a shorter
buffer of their own (`local_slots` positions a row) instead of the whole row: the last
window - 1 positions before the tokens being written, room for `LOCAL_ROOM` new ones, and
one scratch slot. Slot j of a row there holds position offsets[row] + j. Before tokens
start..end-1 are written, `make_room` moves the window's positions to the front when the
new ones would not fit (window - 1 positions copied once every LOCAL_ROOM steps of a
decode); the attention kernels, which take positions and a window, are handed positions
relative to the row's offset and need nothing else (the keys are stored already turned
by the rotary, so a key's slot does not have to be its position). A row's last position
(max_len - 1), where a step writes a row it does not advance, is the buffer's last slot.

With sparse attention (`SparseAttention`, models.qa.sparse_attention) the cache also
holds each block's key summary for the layers that see every position: per row, KV head
and block of `block_tokens` positions, the per-channel min and max of its keys (float32),
which the CPU's decode step scores blocks by (ops/cpu/cpu_step.c). The step computes them
itself, lazily; the cache keeps each row's count of leading positions they are exact over
(`summarized`), which every write the step does not make lowers (`rewritten`: the prefill
and the per-op step in LlamaModel, `load_row`), so a summary is never read stale, only
brought up to date from further back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edge.text.architecture import LlamaConfig

# New positions a sliding layer's buffer takes after the window before it must move: a
# chunk of prefill at most this long (longer ones go in pieces) and a decode step's
# token with its drafts.
LOCAL_ROOM = 128


def local_slots(config: LlamaConfig, max_len: int, room: int = LOCAL_ROOM) -> int:
    """Positions a row of the sliding layers' own buffer holds, or 0 where a row of
    `max_len` is no longer (nothing would be saved) or no layer slides."""
    slots = config.window + room  # the window - 1 kept, the room, the scratch slot
    return slots if config.window and slots < max_len else 0


@dataclass(frozen=True)
class SparseAttention:
    """Top-k block attention on the CPU (models.qa.sparse_attention): in the C decode step
    over this float cache, or the quantized-KV attention kernel over an int8/int4 cache
    (quant_cache.py keeps that one's summaries). A token at `min_context` or later
    attends, in each layer that sees every position, to block 0, its own block and the one
    before, and the `top_k_blocks` others whose key summaries bound its scores highest;
    blocks of `block_tokens` positions."""

    top_k_blocks: int
    block_tokens: int = 64
    min_context: int = 0

    def __post_init__(self) -> None:
        if self.top_k_blocks < 1 or self.block_tokens < 1 or self.min_context < 0:
            raise ValueError(f"sparse attention of {self}: top_k_blocks and block_tokens from 1, min_context from 0")


class KVCache:
    """Keys and values for `batch` sequences of up to `max_len` tokens, allocated once."""

    def __init__(
        self,
        config: LlamaConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        window_sized: bool = True,
        room: int = LOCAL_ROOM,
        sparse: SparseAttention | None = None,
    ) -> None:
        if room < 1:
            raise ValueError(f"a sliding buffer's room for new positions is at least 1, not {room}")
        self.max_len = max_len
        self.room = room
        self.local_slots = local_slots(config, max_len, room) if window_sized else 0
        self.window = config.window
        local = [bool(self.local_slots and config.layer_window(i)) for i in range(config.num_layers)]
        # Each layer's index in its tensor: k/v for the layers that keep every position,
        # local_k/local_v for the sliding layers' buffers.
        self.index = [sum(local[:i]) if local[i] else i - sum(local[:i]) for i in range(config.num_layers)]
        self.is_local = local
        heads, hd = config.num_kv_heads, config.head_dim
        full = (config.num_layers - sum(local), batch, heads, max_len, hd)
        self.k = torch.zeros(full, dtype=dtype, device=device)
        self.v = torch.zeros(full, dtype=dtype, device=device)
        shape = (sum(local), batch, heads, self.local_slots, hd)
        self.local_k = torch.zeros(shape, dtype=dtype, device=device) if self.local_slots else None
        self.local_v = torch.zeros(shape, dtype=dtype, device=device) if self.local_slots else None
        # The position slot 0 of each row's sliding buffers holds: on the host (read when
        # deciding a move) and where the step runs (read inside captured graphs).
        self.offsets = torch.zeros(batch, dtype=torch.long)
        self.offsets_dev = self.offsets if device.type == "cpu" else torch.zeros(batch, dtype=torch.long, device=device)
        # Sparse attention's block summaries, for the layers that see every position (a
        # sliding one is attended densely: its window bounds it already): [such layers,
        # rows, KV heads, blocks, min and max, head dim], each layer's index there (-1:
        # none), and each row's count of positions they are exact over. Only the CPU's
        # decode step selects blocks over a float cache (the CUDA and Triton kernels do
        # not yet).
        self.sparse = sparse
        self.block_tokens = sparse.block_tokens if sparse is not None else 0  # the summaries' blocks
        self.summary: torch.Tensor | None = None
        self.summary_index = [-1] * config.num_layers
        self.summarized: torch.Tensor | None = None
        if sparse is not None:
            if device.type != "cpu":
                raise ValueError(f"sparse attention runs in the CPU's decode step, not on {device.type}")
            every = [i for i in range(config.num_layers) if not config.layer_window(i)]
            for n, i in enumerate(every):
                self.summary_index[i] = n
            blocks = -(-max_len // sparse.block_tokens)
            self.summary = torch.zeros((len(every), batch, heads, blocks, 2, hd), dtype=torch.float32)
            self.summarized = torch.zeros(batch, dtype=torch.long)

    @property
    def nbytes(self) -> int:
        local = self.local_k.numel() * self.local_k.element_size() * 2 if self.local_k is not None else 0
        summary = 0
        if self.summary is not None and self.summarized is not None:
            summary = self.summary.numel() * self.summary.element_size() + self.summarized.numel() * 8
        return self.k.numel() * self.k.element_size() * 2 + local + summary

    @property
    def batch(self) -> int:
        return int(self.offsets.shape[0])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [rows, KV heads, slots, head dim]: a sliding layer's
        own buffer (local_slots positions from each row's offset) or every position."""
        if self.is_local[i]:
            assert self.local_k is not None and self.local_v is not None
            return self.local_k[self.index[i]], self.local_v[self.index[i]]
        return self.k[self.index[i]], self.v[self.index[i]]

    def make_room(self, row: int, start: int, end: int) -> None:
        """Let row `row` take positions start..end-1 (end - start <= room) with the
        window's positions before them still held: the sliding buffers' positions from
        start - window + 1 moved to the front when the new ones would not fit."""
        if self.local_k is None or self.local_v is None:
            return
        if end - start > self.room:
            raise ValueError(f"{end - start} tokens at once: a sliding layer's buffer takes {self.room}")
        held = int(self.offsets[row])
        offset = 0 if start == 0 else held  # a row written from 0 takes a new sequence
        if start < offset:
            raise ValueError(f"position {start} of row {row} is before its sliding buffers' first ({offset})")
        if end - offset > self.local_slots - 1:  # the last slot is the scratch
            first = max(0, start - self.window + 1)
            for t in (self.local_k, self.local_v):
                t[:, row, :, : start - first] = t[:, row, :, first - offset : start - offset].clone()
            offset = first
        if offset != held:
            self._set_offset(row, offset)

    def make_room_for_step(self, positions: list[int]) -> None:
        """make_room for a decode step's token at positions[row] in each row (a row at
        the last position, which the step does not advance, left as it is). A step run
        without it reads wrong keys in the sliding layers or, past the buffer, fails."""
        if self.local_k is None:
            return
        for row, at in enumerate(positions):
            if at != self.max_len - 1:
                self.make_room(row, at, at + 1)

    def rewritten(self, first: torch.Tensor | int, rows: int | None = None) -> None:
        """Rows 0..rows-1 (every row where None) had keys written from position `first`
        on (one for all, or one a row) by something other than the CPU's decode step:
        their block summaries are no longer vouched for from there (the step summarizes
        them again before it next selects). Called by every such writer; a float cache
        without summaries has nothing to do."""
        if self.summarized is None:
            return
        marks = self.summarized[: self.batch if rows is None else rows]
        # Back to the first written block's start: its summary may hold keys from past
        # the write, so it is summarized again from its first position.
        start = torch.as_tensor(first, dtype=torch.long) // self.block_tokens * self.block_tokens
        torch.minimum(marks, start.expand_as(marks), out=marks)

    def _set_offset(self, row: int, offset: int) -> None:
        self.offsets[row] = offset
        if self.offsets_dev.device != self.offsets.device:
            self.offsets_dev[row].fill_(offset)

    def local_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """Each row's position in its sliding buffers (pos [B] on the device): relative to
        the row's offset, and the buffer's scratch slot for a row not advanced."""
        rel = pos - self.offsets_dev[: pos.shape[0]]
        return torch.where(pos == self.max_len - 1, torch.full_like(pos, self.local_slots - 1), rel)

    def save_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Copies of a row's keys and values for its first `length` tokens (of its sliding
        buffers: those from its offset)."""
        saved = {"k": self.k[:, row, :, :length].clone(), "v": self.v[:, row, :, :length].clone()}
        if self.local_k is not None and self.local_v is not None:
            offset = int(self.offsets[row])
            saved["local_k"] = self.local_k[:, row, :, : length - offset].clone()
            saved["local_v"] = self.local_v[:, row, :, : length - offset].clone()
            saved["offset"] = torch.tensor([offset], device=self.local_k.device)  # where the row's parts are
        return saved

    def load_row(self, row: int, length: int, saved: dict[str, torch.Tensor]) -> None:
        """Put a row saved at `length` tokens into row `row`."""
        self.k[:, row, :, :length] = saved["k"].to(self.k.device, non_blocking=True)
        self.v[:, row, :, :length] = saved["v"].to(self.v.device, non_blocking=True)
        if self.local_k is not None and self.local_v is not None:
            offset = int(saved["offset"][0])
            self.local_k[:, row, :, : length - offset] = saved["local_k"].to(self.local_k.device, non_blocking=True)
            self.local_v[:, row, :, : length - offset] = saved["local_v"].to(self.local_v.device, non_blocking=True)
            self._set_offset(row, offset)
        if self.summarized is not None:
            self.summarized[row] = 0  # another sequence's keys, possibly: summarized afresh when read

    def rows(self, first: int, count: int) -> KVCache:
        """A cache over sequences first..first+count-1 that shares this one's memory."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k = self.k[:, first : first + count]
        view.v = self.v[:, first : first + count]
        if self.local_k is not None and self.local_v is not None:
            view.local_k = self.local_k[:, first : first + count]
            view.local_v = self.local_v[:, first : first + count]
        view.offsets = self.offsets[first : first + count]
        if self.summary is not None and self.summarized is not None:
            view.summary = self.summary[:, first : first + count]
            view.summarized = self.summarized[first : first + count]
        view.offsets_dev = self.offsets_dev[first : first + count]
        return view
