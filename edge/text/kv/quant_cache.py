"""A KV cache held as int8 or int4 codes (edge/text/kv/kv_quant.py's formats), for serving.

Per layer and row, for every KV head:
- codes for each position (int8, or int4 two channels a byte), written when a key block
  is coded: keys' scales (and int4 zero points) per channel per block of `key_block`
  tokens, values' per token and group of channels;
- a float ring of `fmt.ring` slots holding the positions not yet coded (the window and
  the key block still filling, in the activations' type): position t is in slot
  t % ring. One more slot past the ring takes the writes at the row's last position,
  which the batcher uses for rows a step does not advance: they must not land on a live
  ring slot of a sequence mid-prefill there;
- the first `fmt.sink` positions in float too, for good (read in place of their codes,
  which are never used, and left out of the first key block's scales).

A sliding layer (Mistral's, Phi-3's, Gemma 3's local ones) reads only its last `window`
positions, so where rows are longer than that needs, the sliding layers keep codes for
`local_slots` positions a row (whole key blocks: the window's and one more) used as a
circle: position t's codes in slot t % local_slots, key block b's scales in slot b %
(local_slots / key_block). Every layer is addressed so (a layer holding every position
has more slots than positions), so the kernels need nothing else; a key block coded
overwrites one the window left long before. Unlike the float cache's sliding buffers
(float_cache.py) nothing moves: a coded block is written once, where it stays.

A row holding n tokens has its first fmt.coded(n) as codes and the rest in the ring.
Writing tokens start..end-1 codes every key block that leaves the window, from the ring
and the new tokens, then puts the new tokens in the ring. Attention reads the codes where
they are (edge/text/kv/kv_attention.py): nothing here dequantizes for attention.

With sparse attention (`SparseAttention`, models.qa.sparse_attention; CPU only) the cache
also keeps, for the layers that see every position, each block's key summary: per row, KV
head and block of `block_tokens` positions, the per-channel min and max (float32) of the
keys as attention reads them: the decoded codes (code x scale (+ zero point)), the sink's
floats, and the ring's floats for positions not yet coded. Decoded, not the keys as
written: Quest's bound must hold for the keys the kernel multiplies, and coding moves a key
by up to half a step (a block's bound over the written keys can fall below a decoded
key's score). A block's summary is recomputed from its first position by every write that
changes what attention reads there (`QuantLayer.store`: a decode step's token, a prefill or
chunk, a key block coded from the ring, a rollback's rewrite) and by `load_row` (the prefix
cache's and the offload's rows), so it is never read stale. A sliding layer stays dense
(its window bounds it; its codes may be a circle): it keeps no summaries. The CPU's
attention (ops/cpu/cpu_kv.c) selects blocks by them with the float decode step's rule.

On CUDA the decode step writes and codes in its own kernel (Triton's,
edge/text/ops/triton/triton_kv.py, or ours where Triton is absent, edge/text/ops/cuda/kv_ops.cu);
what is here (torch) serves prefills on every device and the CPU's decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from edge.text.kv import kv_quant
from edge.text.kv.float_cache import SparseAttention
from edge.text.kv.kv_quant import SYM4_ZERO, KVFormat, _unpack4

if TYPE_CHECKING:
    from edge.text.architecture import LlamaConfig


@dataclass
class QuantLayer:
    """One layer's share of a quantized cache (each tensor [rows, kv_heads, ...])."""

    fmt: KVFormat
    max_len: int
    k_codes: torch.Tensor  # [B, H, code_len, D] int8 or [B, H, code_len, D/2] uint8
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # [B, H, blocks, D] float16
    k_zero: torch.Tensor  # int4: as k_scale; int8: empty
    v_scale: torch.Tensor  # [B, H, code_len, groups] float16
    v_zero: torch.Tensor  # int4: as v_scale; int8: empty
    ring_k: torch.Tensor  # [B, H, ring + 1, D] activations' type
    ring_v: torch.Tensor
    sink_k: torch.Tensor  # [B, H, sink, D] activations' type (empty without a sink)
    sink_v: torch.Tensor
    # Sparse attention's block summaries [B, H, blocks, 2 (min, max), D] float32 of the keys
    # as attention reads them, and the policy selecting by them (None: dense, no summaries).
    summary: torch.Tensor | None = None
    sparse: SparseAttention | None = None

    @property
    def code_len(self) -> int:
        """Code slots a row has: position t's are slot t % code_len (every position a row
        can ever code where the layer keeps them all, a sliding layer's window otherwise)."""
        return int(self.k_codes.shape[2])

    @property
    def circular(self) -> bool:
        """Whether this layer keeps fewer code slots than a row can code (a sliding
        layer's window-sized codes, reused as the window moves)."""
        return self.code_len < full_code_len(self.fmt, self.max_len)

    @property
    def scratch(self) -> int:
        """The slot past the ring that the row's last position writes to."""
        return self.fmt.ring

    def slot(self, position: int) -> int:
        return self.scratch if position == self.max_len - 1 else position % self.fmt.ring

    def ring_span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions start..end-1 from the ring, [B, H, end-start, D]."""
        slots = torch.arange(start, end, device=self.ring_k.device) % self.fmt.ring
        return self.ring_k.index_select(2, slots), self.ring_v.index_select(2, slots)

    def store(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keys and values [B, H, T, D] of positions start..start+T-1 of every row of this
        layer (rows holding `start` tokens each): the key blocks that leave the window
        coded, the new tokens into the ring."""
        fmt, end = self.fmt, start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"positions up to {end} in a row of {self.max_len}")
        if end == self.max_len:  # the row's last position: the scratch slot, never coded
            self.store(k[:, :, :-1], v[:, :, :-1], start)
            self.ring_k[:, :, self.scratch] = k[:, :, -1]
            self.ring_v[:, :, self.scratch] = v[:, :, -1]
            return
        c0, c1 = fmt.coded(start), fmt.coded(end)
        if c1 > c0:
            old_k, old_v = self.ring_span(c0, start)
            span_k = torch.cat([old_k, k.to(old_k.dtype)], dim=2)[:, :, : c1 - c0]
            span_v = torch.cat([old_v, v.to(old_v.dtype)], dim=2)[:, :, : c1 - c0]
            self._code(span_k, span_v, c0)
        if fmt.sink and start < fmt.sink:  # the first tokens, kept float for good
            upto = min(end, fmt.sink)
            self.sink_k[:, :, start:upto] = k[:, :, : upto - start].to(self.sink_k.dtype)
            self.sink_v[:, :, start:upto] = v[:, :, : upto - start].to(self.sink_v.dtype)
        first = max(c1, start)
        if end > first:
            slots = torch.arange(first, end, device=k.device) % fmt.ring
            self.ring_k[:, :, slots] = k[:, :, first - start :].to(self.ring_k.dtype)
            self.ring_v[:, :, slots] = v[:, :, first - start :].to(self.ring_v.dtype)
        if end > start:
            # What attention reads changed from the first key coded (ring floats became
            # decoded codes) or else from the first new token.
            self.summarize(c0 if c1 > c0 else start, end)

    def keys_read(self, first: int, end: int, length: int) -> torch.Tensor:
        """Keys [B, H, end-first, D] float32 of positions first..end-1 as attention reads
        them in rows holding `length` tokens: the sink's floats, decoded codes, the ring's
        floats (read's keys, for a span)."""
        fmt, parts = self.fmt, []
        coded = min(fmt.coded(length), end)
        if first < coded:
            at = torch.arange(first, coded, device=self.k_codes.device)
            slots, blocks = at % self.code_len, at // fmt.key_block % (self.code_len // fmt.key_block)
            codes = self.k_codes[:, :, slots]
            if fmt.dtype == "int4":
                codes = _unpack4(codes)
            k = codes.float() * self.k_scale[:, :, blocks].float()
            if fmt.dtype == "int4":
                k = k + self.k_zero[:, :, blocks].float()
            sink = min(fmt.sink, coded)
            if sink > first:
                k[:, :, : sink - first] = self.sink_k[:, :, first:sink].float()
            parts.append(k)
        if end > max(first, coded):
            parts.append(self.ring_span(max(first, coded), end)[0].float())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def summarize(self, first: int, end: int) -> None:
        """Recompute the block summaries of the blocks holding positions first..end-1, each
        from its first position up to `end` (rows holding `end` tokens): positions past
        `end` (a rollback's drafts) drop out. Nothing without summaries."""
        if self.summary is None or self.sparse is None or end <= first:
            return
        bt = self.sparse.block_tokens
        lo = first // bt * bt
        keys = self.keys_read(lo, end, end)
        n = end - lo
        full = n // bt * bt
        b0 = lo // bt
        if full:
            blocks = keys[:, :, :full].reshape(*keys.shape[:2], full // bt, bt, keys.shape[3])
            self.summary[:, :, b0 : b0 + full // bt, 0] = blocks.amin(3)
            self.summary[:, :, b0 : b0 + full // bt, 1] = blocks.amax(3)
        if n > full:
            tail = keys[:, :, full:]
            self.summary[:, :, b0 + full // bt, 0] = tail.amin(2)
            self.summary[:, :, b0 + full // bt, 1] = tail.amax(2)

    def _code(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Code whole key blocks [B, H, n, D] of positions first..first+n-1, into their
        slots (of a circle shorter than n, the last blocks only: the earlier ones' slots
        would be written again within the same call)."""
        n, kb = k.shape[2], self.fmt.key_block
        codes = kv_quant.code(k, v, self.fmt, first_block=first == 0)
        kept = min(n, self.code_len)
        slots = torch.arange(first + n - kept, first + n, device=k.device) % self.code_len
        blocks = slots[::kb] // kb
        self.k_codes[:, :, slots] = codes.k_codes[:, :, n - kept :]
        self.v_codes[:, :, slots] = codes.v_codes[:, :, n - kept :]
        self.k_scale[:, :, blocks] = codes.k_scale[:, :, (n - kept) // kb :]
        self.v_scale[:, :, slots] = codes.v_scale[:, :, n - kept :]
        if codes.k_zero is not None:
            self.k_zero[:, :, blocks] = codes.k_zero[:, :, (n - kept) // kb :]
        if codes.v_zero is not None:
            self.v_zero[:, :, slots] = codes.v_zero[:, :, n - kept :]

    def write_tokens(self, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> None:
        """One token per row ([B, H, 1, D]) at each row's own position (a decode step)."""
        for row, position in enumerate(positions):
            self.rows(row).store(k[row : row + 1], v[row : row + 1], position)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, length, D] float32 of rows holding `length` tokens, as
        attention must see them: the reference the kernels are checked against (serving
        never builds this). In a circular layer, positions whose slots a later block has
        taken read as that block: only the window's are the row's own."""
        fmt = self.fmt
        coded = fmt.coded(length)
        rows, heads, _, dim = self.ring_k.shape
        group = fmt.group(dim)
        slots = torch.arange(coded, device=self.k_codes.device) % self.code_len
        blocks = slots[:: fmt.key_block] // fmt.key_block
        kc, vc = self.k_codes[:, :, slots], self.v_codes[:, :, slots]
        if fmt.dtype == "int4":
            kc, vc = _unpack4(kc), _unpack4(vc)
        vf = vc.float() - SYM4_ZERO if fmt.value_symmetric else vc.float()
        n = coded // fmt.key_block
        k = kc.float().reshape(rows, heads, n, fmt.key_block, dim) * self.k_scale[:, :, blocks, None].float()
        v = vf.reshape(rows, heads, coded, dim // group, group) * self.v_scale[:, :, slots, :, None].float()
        if fmt.dtype == "int4":
            k = k + self.k_zero[:, :, blocks, None].float()
        if self.v_zero.numel():
            v = v + self.v_zero[:, :, slots, :, None].float()
        ring_k, ring_v = self.ring_span(coded, length)
        k, v = k.reshape(rows, heads, coded, dim), v.reshape(rows, heads, coded, dim)
        sink = min(fmt.sink, coded)
        if sink:
            k[:, :, :sink], v[:, :, :sink] = self.sink_k[:, :, :sink].float(), self.sink_v[:, :, :sink].float()
        k = torch.cat([k, ring_k.float()], dim=2)
        v = torch.cat([v, ring_v.float()], dim=2)
        return k, v

    def rows(self, row: int) -> QuantLayer:
        """This layer's share of one row."""
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in parts.items():
            if isinstance(value, torch.Tensor) and value.numel():
                parts[name] = value[row : row + 1]
        return QuantLayer(**parts)


_CODES = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero")
_FLOATS = ("ring_k", "ring_v", "sink_k", "sink_v")
_TENSORS = (*_CODES, *_FLOATS, *(f"local_{name}" for name in _CODES))


def full_code_len(fmt: KVFormat, max_len: int) -> int:
    """Code slots of a layer holding every position a row of `max_len` can code (at least
    one block, so that every format's tensors have a shape)."""
    return max(fmt.coded(max_len), fmt.key_block)


def local_slots(config: LlamaConfig, fmt: KVFormat, max_len: int) -> int:
    """Code slots a row of the sliding layers keeps: the key blocks a window of positions
    can touch and one more (whole blocks: scales are per block), or 0 where no layer
    slides or that would save nothing. A decode step codes the block leaving the format's
    float window before it attends; the blocks its window reads then are at most
    ceil(window / key_block), so the one the step codes never takes a slot they use, nor
    does a chunk's, which attends before it stores."""
    kb = fmt.key_block
    slots = (-(-config.window // kb) + 1) * kb
    return slots if config.window and slots < full_code_len(fmt, max_len) else 0


class QuantKVCache:
    """Keys and values of `batch` rows of up to `max_len` tokens in an int8 or int4 format,
    allocated once (the same interface as llama.KVCache: rows, max_len, nbytes).
    `window_sized`: the sliding layers' codes in circles where that saves memory, for
    kernels that read them so (step_ops.circular_kv, which LlamaModel.new_cache asks)."""

    def __init__(
        self,
        config: LlamaConfig,
        batch: int,
        max_len: int,
        fmt: KVFormat,
        dtype: torch.dtype,
        device: torch.device,
        window_sized: bool = False,
        sparse: SparseAttention | None = None,
    ) -> None:
        if fmt.dtype == "float16":
            raise ValueError("a float16 cache is llama.KVCache")
        dim, group = config.head_dim, fmt.group(config.head_dim)
        if dim % 2 or dim % group or (fmt.dtype == "int4" and group % 2):
            raise ValueError(f"head size {dim} does not take value groups of {group} channels")
        if fmt.key_block % 32:
            raise ValueError(f"key blocks of {fmt.key_block} tokens: a multiple of 32 is needed")
        lead = (config.num_layers, batch, config.num_kv_heads)
        self.fmt = fmt
        self.max_len = max_len
        # Codes only for the positions a row can ever code (its newest tokens stay in the
        # ring), or, in the sliding layers, for their window's blocks.
        self.local_slots = local_slots(config, fmt, max_len) if window_sized else 0
        local = [bool(self.local_slots and config.layer_window(i)) for i in range(config.num_layers)]
        # Each layer's index among the layers holding every position, or among the
        # sliding layers' (the local_ tensors).
        self.index = [sum(local[:i]) if local[i] else i - sum(local[:i]) for i in range(config.num_layers)]
        self.is_local = local
        heads = config.num_kv_heads
        codes = _code_tensors(
            config, fmt, (config.num_layers - sum(local), batch, heads), full_code_len(fmt, max_len), device
        )
        self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero = (codes[n] for n in _CODES)
        codes = _code_tensors(config, fmt, (sum(local), batch, heads), self.local_slots, device)
        self.local_k_codes, self.local_v_codes, self.local_k_scale = (
            codes["k_codes"],
            codes["v_codes"],
            codes["k_scale"],
        )
        self.local_k_zero, self.local_v_scale, self.local_v_zero = codes["k_zero"], codes["v_scale"], codes["v_zero"]
        self.ring_k = torch.zeros(*lead, fmt.ring + 1, dim, dtype=dtype, device=device)
        self.ring_v = torch.zeros(*lead, fmt.ring + 1, dim, dtype=dtype, device=device)
        sink = (lambda: torch.zeros(*lead, fmt.sink, dim, dtype=dtype, device=device)) if fmt.sink else None
        self.sink_k = sink() if sink is not None else _empty(device)
        self.sink_v = sink() if sink is not None else _empty(device)
        # Sparse attention's block summaries (the module's header) for the layers that see
        # every position: [such layers, rows, KV heads, blocks, 2, head dim] float32, and
        # each layer's index there (-1: a sliding layer, attended densely).
        self.sparse = sparse
        self.summary: torch.Tensor | None = None
        self.summary_index = [-1] * config.num_layers
        if sparse is not None:
            if device.type != "cpu":
                raise ValueError(f"sparse attention over an {fmt.dtype} cache runs on the CPU, not on {device.type}")
            every = [i for i in range(config.num_layers) if not config.layer_window(i)]
            for n, i in enumerate(every):
                self.summary_index[i] = n
            blocks = -(-max_len // sparse.block_tokens)
            self.summary = torch.zeros((len(every), batch, heads, blocks, 2, dim), dtype=torch.float32)

    @property
    def batch(self) -> int:
        return int(self.ring_k.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The float part's type (the activations')."""
        return self.ring_k.dtype

    @property
    def nbytes(self) -> int:
        summary = self.summary.numel() * 4 if self.summary is not None else 0
        return sum(t.numel() * t.element_size() for t in self._tensors().values()) + summary

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _TENSORS}

    def rows(self, first: int, count: int) -> QuantKVCache:
        """A cache over rows first..first+count-1 that shares this one's memory."""
        view = QuantKVCache.__new__(QuantKVCache)
        view.__dict__.update(self.__dict__)
        for name, tensor in self._tensors().items():
            setattr(view, name, tensor[:, first : first + count] if tensor.numel() else tensor)
        if self.summary is not None:
            view.summary = self.summary[:, first : first + count]
        return view

    def layer(self, i: int) -> QuantLayer:
        """Layer i's share: its codes (a sliding layer's own, where it keeps its window's
        only) and its float ring and sink."""
        tensors = self._tensors()
        prefix, at = ("local_" if self.is_local[i] else ""), self.index[i]
        parts: dict[str, Any] = {name: _at(tensors[prefix + name], at) for name in _CODES}
        parts.update({name: _at(tensors[name], i) for name in _FLOATS})
        layer = QuantLayer(self.fmt, self.max_len, **parts)
        at_summary = self.summary_index[i]
        if self.summary is not None and at_summary >= 0:
            layer.summary, layer.sparse = self.summary[at_summary], self.sparse
        return layer

    def save_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """What a row holding `length` tokens needs to go on from where it is: its codes
        and scales up to fmt.coded(length) (a circular layer's slots: every one once the
        row has gone round), its ring's tokens after that (copies)."""
        coded = self.fmt.coded(length)
        blocks = coded // self.fmt.key_block
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self._tensors().items():
            if not tensor.numel():
                continue
            part = tensor[:, row]
            if name.startswith("ring"):
                slots = torch.arange(coded, length, device=tensor.device) % self.fmt.ring
                out[name] = part.index_select(2, slots)
            elif name.startswith("sink"):
                out[name] = part.clone()
            else:
                out[name] = part[:, :, : blocks if name.endswith(("k_scale", "k_zero")) else coded].clone()
        if self.summary is not None and self.sparse is not None:
            out["summary"] = self.summary[:, row, :, : -(-length // self.sparse.block_tokens)].clone()
        return out

    def load_row(self, row: int, length: int, saved: dict[str, torch.Tensor]) -> None:
        """Put a row saved at `length` tokens into row `row` (any row: positions, not rows,
        decide where a token lives)."""
        coded = self.fmt.coded(length)
        for name, tensor in self._tensors().items():
            if not tensor.numel():
                continue
            part = tensor[:, row]
            value = saved[name].to(part.device, non_blocking=True)
            if name.startswith("ring"):
                slots = torch.arange(coded, length, device=tensor.device) % self.fmt.ring
                part[:, :, slots] = value
            elif name.startswith("sink"):
                part.copy_(value)
            else:
                part[:, :, : value.shape[2]] = value
        if self.summary is not None and self.sparse is not None:
            # The saved summaries of the blocks wholly coded are the codes' (copied, as the
            # codes are); the block the float part starts in and those after are made again
            # from the row as loaded (all of them from a row saved without summaries).
            first = 0
            if "summary" in saved:
                summary = saved["summary"].to(self.summary.device)
                self.summary[:, row, :, : summary.shape[2]] = summary
                first = coded
            for i, at in enumerate(self.summary_index):
                if at >= 0:
                    self.layer(i).rows(row).summarize(first, length)


def _code_tensors(
    config: LlamaConfig, fmt: KVFormat, lead: tuple[int, ...], code_len: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Codes, scales and zero points of `code_len` slots for layers x rows x KV heads
    `lead` (empty tensors for what the format does not keep, or no slots)."""
    dim, group = config.head_dim, fmt.group(config.head_dim)
    if not code_len or not lead[0]:
        return {name: _empty(device) for name in _CODES}
    blocks = code_len // fmt.key_block
    code_dim, code_type = (dim, torch.int8) if fmt.dtype == "int8" else (dim // 2, torch.uint8)
    half = torch.float16
    zeros = fmt.dtype == "int4"
    v_zeros = zeros and not fmt.value_symmetric
    return {
        "k_codes": torch.zeros(*lead, code_len, code_dim, dtype=code_type, device=device),
        "v_codes": torch.zeros(*lead, code_len, code_dim, dtype=code_type, device=device),
        "k_scale": torch.zeros(*lead, blocks, dim, dtype=half, device=device),
        "k_zero": torch.zeros(*lead, blocks, dim, dtype=half, device=device) if zeros else _empty(device),
        "v_scale": torch.zeros(*lead, code_len, dim // group, dtype=half, device=device),
        "v_zero": torch.zeros(*lead, code_len, dim // group, dtype=half, device=device) if v_zeros else _empty(device),
    }


def _at(tensor: torch.Tensor, i: int) -> torch.Tensor:
    return tensor[i] if tensor.numel() else tensor


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float16, device=device)
