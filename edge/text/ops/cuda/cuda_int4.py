"""Our CUDA INT4 kernels (cuda_int4.cu): the decode GEMV on the tensor cores, and the
dequantization that prefill multiplies with cuBLAS; built on the box with nvcc, called
through ctypes on torch's current stream (so CUDA graphs capture them).

The GEMV reads a tiled layout made for it once at load (`repack`): 16-byte loads
coalesced across the warp, nibbles placed so that a mask and one packed subtraction
turn each 32-bit word into a tensor-core operand, and a group's scales and zero points
in one small block for the tile's 16 rows. It takes bfloat16 or float16 activations,
K a multiple of 64 and groups of 32, 64, 128 or 256 (every shape the shipped and
benchmarked models have); other layers keep the Triton kernel.

The source is compiled once per machine, nvcc version, source version and GPU
architecture (sm_80 and later: the Orin's sm_87, Hopper's sm_90) into the kernel cache
(cuda_build.py). Without nvcc the kernel is unavailable, and CUDA serving falls back to
the Triton kernel and says so.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from edge.text.ops.cuda import cuda_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cuda_int4.cu")
TILE_ROWS = 16
CHUNK = 64  # input channels per 16-byte lane load
GROUPS = (32, 64, 128, 256)
MAX_ROWS = 8  # activation rows per pass: the tensor-core product's 8 columns
MAX_PARTS_BYTES = 32 * 1024  # a folded norm's partial sums, in shared memory (cuda_int4.cu)
WARP_CHOICES = (1, 2, 4, 8, 16)  # warps per tile, splitting K
UNROLL_CHOICES = (2, 4, 8)  # chunks a warp has in flight
# Codes repacked at once (16 Mi: an 8B model's 128256-row output layer in 32 slabs): a
# slab's working copies on the device are under 3 bytes a code, 48 MiB.
REPACK_SLAB_VALUES = 1 << 24
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
DEQUANT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

_tuned: dict[tuple[int, int, int, torch.dtype], tuple[int, int]] = {}


def supports(in_features: int, group_size: int) -> bool:
    return in_features % CHUNK == 0 and group_size in GROUPS and in_features % group_size == 0


def nvcc() -> str | None:
    return cuda_build.nvcc()


def library_path(compiler: str, arch: str) -> Path:
    return cuda_build.library_path(compiler, SOURCE, arch)


def build(arch: str) -> Path:
    """Compile for compute capability `arch` into the cache unless it is there; returns
    the library path (cuda_build.build)."""
    return cuda_build.build(SOURCE, arch)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.edge_int4_gemv.restype = i
    lib.edge_int4_gemv.argtypes = [p, p, p, p, p, p, p, ctypes.c_float, p, p, p, p, i, i, i, i, i, i, i, p]
    lib.edge_int4_dequant.restype = i
    lib.edge_int4_dequant.argtypes = [p, p, p, p, i, i, i, i, i, i, p]


_LIBRARY = cuda_build.CudaLibrary(SOURCE, "the CUDA INT4 kernel", _declare)


def _load(device: torch.device) -> ctypes.CDLL:
    return _LIBRARY.load(device)


def available(device: torch.device | str = "cuda") -> bool:
    """Whether the kernel is built (building it now if needed) and loadable for `device`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _load(device)
    except RuntimeError as exc:
        logger.warning("%s; the Triton kernel serves instead", exc)
        return False
    return True


@dataclass(frozen=True)
class TiledInt4:
    """A weight [n, k] in the GEMV's layout (cuda_int4.cu's header says it in full)."""

    codes: torch.Tensor  # int32 [tiles, k/64, 32, 4]
    scales: torch.Tensor  # float16 [tiles, k/G, 16]
    zeros: torch.Tensor  # uint8 [tiles, k/G, 16]
    n: int
    k: int
    group_size: int
    # Rows reordered so that tile i holds gate rows 8i..8i+7 then up rows 8i..8i+7 of a
    # gated unit's [gate; up] weight (pair_order): the GEMV can then write silu(gate)*up.
    paired: bool = False

    @property
    def tiles(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def can_pair(n: int) -> bool:
    return n % (2 * TILE_ROWS) == 0


def pair_order(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The original row held at each row of a paired weight: tile i is gate rows
    8i..8i+7 then up rows 8i..8i+7 (gate the first n/2 rows, up the rest)."""
    f = n // 2
    tile, half, g = torch.meshgrid(
        torch.arange(f // 8, device=device), torch.arange(2, device=device), torch.arange(8, device=device),
        indexing="ij",
    )  # fmt: skip
    return (half * f + tile * 8 + g).reshape(n)


def unpair(out: torch.Tensor) -> torch.Tensor:
    """Columns of a paired weight's product [M, n] back into [gate | up] order."""
    m, n = out.shape
    return out.view(m, n // TILE_ROWS, 2, 8).transpose(1, 2).reshape(m, n)


def repack(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    paired: bool = False,
    device: torch.device | str | None = None,
) -> TiledInt4:
    """The checkpoint's layout (uint8 [N, K/2], even k in the low nibble; scales and
    zeros [N, K/G]) into the tiled one on `device` (default: the tensors' own). Rows are
    padded to a multiple of 16 with zero codes and scales (never stored back).
    `paired`: the weight is a gated unit's [gate; up] (N a multiple of 32), reordered by
    pair_order for gemv_silu.

    Made a slab of tiles at a time (REPACK_SLAB_VALUES codes): on `device` only the
    result, one slab of the source and that slab's working copies exist at once, so the
    source may stay on the host (the loader's) and an 8B model's output layer is never
    held there twice, nor its unpacked codes (a byte each) whole. Tiles are independent:
    the bytes are those of repacking the whole weight at once."""
    n, half = qweight.shape
    k = half * 2
    if not supports(k, group_size):
        raise ValueError(f"the CUDA INT4 kernel takes K a multiple of {CHUNK} and groups {GROUPS} ({k}, {group_size})")
    if paired and not can_pair(n):
        raise ValueError(f"a paired gate/up weight needs rows in multiples of {2 * TILE_ROWS}, got {n}")
    device = qweight.device if device is None else torch.device(device)
    tiles = -(-n // TILE_ROWS)
    groups = k // group_size
    codes = torch.empty(tiles, k // CHUNK, 32, 4, dtype=torch.int32, device=device)
    tile_scales = torch.empty(tiles, groups, TILE_ROWS, dtype=torch.float16, device=device)
    tile_zeros = torch.empty(tiles, groups, TILE_ROWS, dtype=torch.uint8, device=device)
    step = max(1, REPACK_SLAB_VALUES // (TILE_ROWS * k))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        q, s, z = (_slab_rows(t, t0, t1, paired).to(device) for t in (qweight, scales, zeros))
        words, slab_scales, slab_zeros = _repack_tiles(q, s, z, t1 - t0, group_size)
        codes[t0:t1] = words
        tile_scales[t0:t1] = slab_scales
        tile_zeros[t0:t1] = slab_zeros
        del q, s, z, words, slab_scales, slab_zeros
    return TiledInt4(codes, tile_scales, tile_zeros, n=n, k=k, group_size=group_size, paired=paired)


def _slab_rows(t: torch.Tensor, t0: int, t1: int, paired: bool) -> torch.Tensor:
    """The rows of `t` [N, w] that tiles t0..t1-1 hold: a paired weight's in pair_order
    (tile i: gate rows 8i..8i+7, then up rows 8i..8i+7), copied a block at a time."""
    n = t.shape[0]
    if not paired:
        return t[t0 * TILE_ROWS : min(n, t1 * TILE_ROWS)]
    f = n // 2
    gate, up = t[8 * t0 : 8 * t1], t[f + 8 * t0 : f + 8 * t1]
    return torch.stack([gate.reshape(t1 - t0, 8, -1), up.reshape(t1 - t0, 8, -1)], dim=1).reshape(-1, t.shape[1])


def _repack_tiles(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, tiles: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tiles` whole tiles of rows (the last of a weight padded here) into the GEMV's
    codes [tiles, k/64, 32, 4], scales and zeros [tiles, k/G, 16]."""
    n, half = qweight.shape
    k = half * 2
    pad = tiles * TILE_ROWS - n
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(n, k)
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    # row = tile*16 + rh*8 + g; k = c*64 + h*32 + t*8 + i*4 + r*2 + e
    grid = codes.reshape(tiles, 2, 8, k // CHUNK, 2, 4, 2, 2, 2)  # T rh g C h t i r e
    # -> T C g t h i | e r rh: lane = g*4 + t, word = h*2 + i, nibble = e*4 + r*2 + rh
    nib = grid.permute(0, 3, 2, 5, 4, 6, 8, 7, 1).reshape(tiles, k // CHUNK, 32, 4, 4, 2)
    del codes, grid  # the unpacked codes: a byte each, twice the slab's packed ones
    # Nibbles 2b and 2b+1 are byte b of the little-endian word: bytes, then a view.
    packed = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()
    words = packed.view(torch.int32).reshape(tiles, k // CHUNK, 32, 4)
    groups = k // group_size
    return (
        words,
        scales.to(torch.float16).reshape(tiles, TILE_ROWS, groups).transpose(1, 2),
        zeros.to(torch.uint8).reshape(tiles, TILE_ROWS, groups).transpose(1, 2),
    )


def reference_weight(tiled: TiledInt4) -> torch.Tensor:
    """The float32 weight [n, k] the tiled layout holds, decoded element by element the
    way the kernels index it (not by undoing repack's permutation): CI checks the layout
    with this where no GPU runs the kernels."""
    codes = tiled.codes.to(torch.int64) & 0xFFFFFFFF
    tiles, chunks = codes.shape[:2]
    k, g_size = tiled.k, tiled.group_size
    w = torch.empty(tiles * TILE_ROWS, k, dtype=torch.float32, device=codes.device)
    scales, zeros = tiled.scales.float(), tiled.zeros.float()
    ar = torch.arange
    lane = ar(32, device=codes.device)
    g, t = lane // 4, lane % 4
    for word in range(4):
        h, i = divmod(word, 2)
        for nibble in range(8):
            e, rest = divmod(nibble, 4)
            r, rh = divmod(rest, 2)
            value = ((codes[:, :, :, word] >> (4 * nibble)) & 15).float()  # [T, C, 32]
            rows = ar(tiles, device=codes.device)[:, None] * TILE_ROWS + rh * 8 + g[None, :]  # [T, 32]
            ks = ar(chunks, device=codes.device)[:, None] * CHUNK + h * 32 + t[None, :] * 8 + i * 4 + r * 2 + e
            grp = ks // g_size  # [C, 32]
            tile_ix = ar(tiles, device=codes.device)[:, None, None]
            sub = (rh * 8 + g)[None, None, :]
            s = scales[tile_ix, grp[None], sub]
            z = zeros[tile_ix, grp[None], sub]
            w[rows[:, None, :].expand(-1, chunks, -1), ks[None].expand(tiles, -1, -1)] = (value - z) * s
    w = w[: tiled.n]
    if tiled.paired:
        original = torch.empty_like(w)
        original[pair_order(tiled.n, w.device)] = w
        return original
    return w


def _stream() -> int:
    return cuda_build.stream()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"the CUDA INT4 {what} failed to launch (CUDA error {rc})")


@dataclass(frozen=True)
class Residual:
    """A producer's half of the folded RMSNorm (cuda_int4.cu's header): the product is
    added into `resid` [M, n] float32 in place, and the next norm's input is written
    without its division by the RMS."""

    resid: torch.Tensor  # float32 [M, n]
    norm_weight: torch.Tensor  # [n], in the activations' dtype


@dataclass(frozen=True)
class NormInput:
    """A consumer's half: x is resid * w from a producer, and `parts` [M, k/16] float32
    its tiles' sums of squares; the product's sums are scaled by rsqrt(mean + eps)."""

    parts: torch.Tensor
    eps: float


def parts_fit(rows: int, k: int) -> bool:
    """Whether a consumer of width k takes the partial sums of `rows` rows (they sit in
    the kernel's shared memory)."""
    return rows * (k // TILE_ROWS) * 4 <= MAX_PARTS_BYTES


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _launch(
    x: torch.Tensor,
    tiled: TiledInt4,
    config: tuple[int, int] | None,
    gated: bool,
    norm: NormInput | None = None,
    residual: Residual | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GEMV's one launch: [M, n] float32 sums, or with `gated` a paired weight's
    silu(gate) * up [M, n/2] in x's dtype, or with `residual` the next norm's input
    [M, n] in x's dtype and its partial sums [M, n/16] (the second item)."""
    m, k = x.shape
    if m > MAX_ROWS or k != tiled.k or x.dtype not in DTYPES:
        shape = f"[<= {MAX_ROWS}, {tiled.k}] bfloat16 or float16"
        raise ValueError(f"the CUDA INT4 GEMV takes {shape}, got {list(x.shape)} {x.dtype}")
    if norm is not None:
        if norm.parts.shape != (m, k // TILE_ROWS) or norm.parts.dtype != torch.float32 or not _aligned(norm.parts):
            raise ValueError(f"partial sums of squares are [{m}, {k // TILE_ROWS}] float32, contiguous")
        if not parts_fit(m, k):
            raise ValueError(f"a folded norm over {k} channels takes at most {MAX_PARTS_BYTES} bytes of partial sums")
    if residual is not None:
        if gated or tiled.paired or tiled.n % TILE_ROWS:
            raise ValueError(f"a residual product takes an unpaired weight of rows in multiples of {TILE_ROWS}")
        r, w = residual.resid, residual.norm_weight
        if r.shape != (m, tiled.n) or r.dtype != torch.float32 or not _aligned(r):
            raise ValueError(f"the residual is [{m}, {tiled.n}] float32, contiguous")
        if w.shape != (tiled.n,) or w.dtype != x.dtype or not _aligned(w):
            raise ValueError(f"the norm weight is [{tiled.n}] {x.dtype}, contiguous and 16-byte aligned")
    lib = _load(x.device)
    if not _aligned(x):
        x = x.contiguous().clone()
    warps, unroll = tuned_config(tiled, x.dtype) if config is None else config
    out = act = resid = norm_w = normed = part_out = None
    parts = None
    if gated:
        result = torch.empty(m, tiled.n // 2, device=x.device, dtype=x.dtype)
        act = result.data_ptr()
    elif residual is not None:
        result = torch.empty(m, tiled.n, device=x.device, dtype=x.dtype)
        parts = torch.empty(m, tiled.n // TILE_ROWS, device=x.device, dtype=torch.float32)
        resid, norm_w = residual.resid.data_ptr(), residual.norm_weight.data_ptr()
        normed, part_out = result.data_ptr(), parts.data_ptr()
    else:
        result = torch.empty(m, tiled.n, device=x.device, dtype=torch.float32)
        out = result.data_ptr()
    rc = lib.edge_int4_gemv(
        tiled.codes.data_ptr(), tiled.scales.data_ptr(), tiled.zeros.data_ptr(), x.data_ptr(), out, act,
        None if norm is None else norm.parts.data_ptr(), 0.0 if norm is None else norm.eps,
        resid, norm_w, normed, part_out,
        m, tiled.n, k, tiled.group_size, DTYPES[x.dtype], warps, unroll, _stream(),
    )  # fmt: skip
    _check(rc, "GEMV")
    return result, parts


def gemv(
    x: torch.Tensor, tiled: TiledInt4, config: tuple[int, int] | None = None, norm: NormInput | None = None
) -> torch.Tensor:
    """x [M, k] (M <= 8, bfloat16 or float16) times the weight -> [M, n] float32. A row's
    result is the same bits whatever M is. `config` (warps per 16-row tile, chunks in
    flight per warp) skips the tuned choice (tests, sweeps). `norm`: x is a producer's
    un-divided norm input, and the product is that of the normalised x."""
    out, _ = _launch(x, tiled, config, gated=False, norm=norm)
    return unpair(out) if tiled.paired else out


def gemv_silu(
    x: torch.Tensor, tiled: TiledInt4, config: tuple[int, int] | None = None, norm: NormInput | None = None
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [M, n/2] in x's dtype, for a paired weight: the
    gated unit's activation straight from the GEMV's sums (the float32 gate/up products
    never reach memory)."""
    if not tiled.paired:
        raise ValueError("gemv_silu takes a paired gate/up weight (repack(..., paired=True))")
    return _launch(x, tiled, config, gated=True, norm=norm)[0]


def gemv_residual(
    x: torch.Tensor, tiled: TiledInt4, residual: Residual, eps: float, config: tuple[int, int] | None = None
) -> tuple[torch.Tensor, NormInput]:
    """resid += x @ W.T (in place), then the next RMSNorm's input for a consumer: resid * w
    in x's dtype [M, n] and the partial sums that finish the norm inside the consumer."""
    normed, parts = _launch(x, tiled, config, gated=False, residual=residual)
    assert parts is not None
    return normed, NormInput(parts, eps)


def l2_bytes(device: torch.device | str) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


def dequant(
    tiled: TiledInt4, tile0: int, tiles: int, dtype: torch.dtype, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [tile0*16, min(n, (tile0+tiles)*16)) of the weight in `dtype`; written into
    the front of `buffer` (a flat tensor of `dtype`, large enough) when one is given."""
    lib = _load(tiled.codes.device)
    rows = min(tiled.n, (tile0 + tiles) * TILE_ROWS) - tile0 * TILE_ROWS
    if buffer is None:
        out = torch.empty(rows, tiled.k, device=tiled.codes.device, dtype=dtype)
    else:
        if buffer.dtype != dtype or buffer.numel() < rows * tiled.k or not buffer.is_contiguous():
            raise ValueError(f"a dequantization buffer of {rows * tiled.k} contiguous {dtype} values is needed")
        out = buffer[: rows * tiled.k].view(rows, tiled.k)
    rc = lib.edge_int4_dequant(
        tiled.codes.data_ptr(), tiled.scales.data_ptr(), tiled.zeros.data_ptr(), out.data_ptr(),
        tile0, tiles, tiled.n, tiled.k, tiled.group_size, DEQUANT_DTYPES[dtype], _stream(),
    )  # fmt: skip
    _check(rc, "dequantization")
    return out


def configs(k: int) -> list[tuple[int, int]]:
    """(warps, unroll) worth timing for K: no more warps than chunks, and no unroll a
    warp's run of chunks would not half fill."""
    chunks = k // CHUNK
    out = []
    for warps in WARP_CHOICES:
        per = -(-chunks // warps)
        if warps > chunks:
            break
        out += [(warps, u) for u in UNROLL_CHOICES if u == UNROLL_CHOICES[0] or u // 2 < per]
    return out


def tuned_config(tiled: TiledInt4, dtype: torch.dtype) -> tuple[int, int]:
    """(warps, unroll) for this shape: timed once per process inside CUDA graphs (as
    decode runs the kernel), one choice for every number of rows (batch invariance)."""
    key = (tiled.n, tiled.k, tiled.group_size, dtype)
    if key in _tuned:
        return _tuned[key]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the CUDA INT4 GEMV is tuned before capture (int4.tune_gemv)")
    device = tiled.codes.device
    x = torch.zeros(1, tiled.k, device=device, dtype=dtype)
    # Decode streams each weight from memory once per token. A weight smaller than L2
    # timed alone would be read from L2 after the first launch, and the choice made for
    # a cache the real step never has: time copies that together are twice L2's size.
    l2 = l2_bytes(device)
    copies = [tiled] + [
        TiledInt4(tiled.codes.clone(), tiled.scales.clone(), tiled.zeros.clone(), tiled.n, tiled.k, tiled.group_size)
        for _ in range(min(63, -(-2 * l2 // tiled.nbytes) - 1))
    ]
    best, best_t = (WARP_CHOICES[0], UNROLL_CHOICES[0]), float("inf")
    for config in configs(tiled.k):
        elapsed = _graph_time([partial(gemv, x, c, config) for c in copies])
        if elapsed < best_t:
            best, best_t = config, elapsed
    _tuned[key] = best
    logger.debug("CUDA INT4 GEMV [%d x %d] g%d: %d warps per tile, %d chunks in flight (%.1f us)", tiled.n, tiled.k,
                 tiled.group_size, *best, best_t * 1e6)  # fmt: skip
    return best


def _graph_time(fns: list[Callable[[], object]], launches: int = 24, replays: int = 5) -> float:
    """Seconds per launch, `launches` of them (taking `fns` in turn) captured in one
    graph, best replay."""
    launches = max(launches, len(fns))
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fns[0]()  # warm: the first launch loads the module
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(launches):
                fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    best = float("inf")
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / launches)
    del graph
    return best
