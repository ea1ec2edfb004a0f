"""Offload of a paused sequence's KV row: to host memory or to files in the state
directory, so that its resume restores the row instead of prefilling it again, when the
measured figures say restoring is the faster.

- save: the row's state (llama.KVCache / quant_cache.QuantKVCache.save_row: a float row,
  or codes, scales and the float ring) and its next-token logits are copied off the
  device. On CUDA the copy runs on a side stream into pinned memory (pooled buffers,
  kept for the next pause) and the serving
  stream waits for it on the GPU (not the host) before it reuses the row; on the CPU it
  is a memory copy. A file, when asked for, is written by a worker thread after that:
  lz4-coded where that pays (float KV barely compresses, about 1.0x; see
  bench/kv.py), raw otherwise.
- restore: from memory while the copy is still held, else from the file. A file is
  checked before anything of it is used: its header carries its own CRC-32 and each
  part's length and CRC-32, the file must be exactly as long as they say, each part
  decodes to its recorded shape, and every floating-point value (the float KV, a
  quantized cache's scales and ring, the logits) must be finite. A row that cannot be
  restored (its file missing, truncated, altered, or holding NaN or infinity) is let go,
  its file removed and its bytes taken off the figures, and its sequence is prefilled
  again: one bad file costs a prefill, never a job.
- memory: rows held in host memory (all of them with "memory", each until it is written
  with "disk") are charged to the daemon's memory ledger through `reserve` and `release`
  where the budget covers host memory; a row the ledger refuses is not offloaded.
- choose: restoring costs the row's bytes over the measured restore bandwidth;
  recomputing costs its tokens over the measured prefill rate. Until both have been
  measured once, it restores. Every prefill measures the prefill rate, but only a
  restore measures restoring: where the figures say recompute, a row is restored all
  the same now and then (after 16 such resumes, then 32, ...), so that a slow first
  restore is not the figure for good (recheck.py).

Offloaded rows live as long as the daemon: the directory is emptied when the store is
made, so nothing offloaded survives a restart (the job itself does: its journal entry is
replayed, and it is prefilled again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from edge.text.kv.recheck import Recheck

logger = logging.getLogger(__name__)

OffloadWhere = Literal["off", "memory", "disk"]
MAGIC = b"EDGEKV2\n"  # 2: the header's CRC-32, each part's CRC-32, lengths checked
PREFIX = struct.Struct("<II")  # the header's length and its CRC-32, after MAGIC
MIN_RATIO = 1.05  # lz4 is kept only where it saves at least this much
EMA = 0.3  # weight of the newest measurement in the running rates


class RowCache(Protocol):
    """What the batcher's caches offer for offload (llama.KVCache, QuantKVCache)."""

    def save_row(self, row: int, length: int) -> dict[str, torch.Tensor]: ...

    def load_row(self, row: int, length: int, saved: dict[str, torch.Tensor]) -> None: ...


def _size_class(nbytes: int) -> int:
    """nbytes rounded up to one of 8 sizes an octave: a pooled buffer wastes at most 1/8."""
    if nbytes <= 4096:
        return 4096
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class PinnedPool:
    """Page-locked host buffers for device-to-host copies, kept for reuse once let go:
    pinning host memory costs about what the copy into it does (74 ms for a 128 MiB row
    on the H200's host), and it would run on the batcher's thread at every pause. At most
    `limit` bytes are held, in use and idle together; idle ones go first when more is
    needed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[torch.Tensor] = []
        self.in_use = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return sum(b.numel() for b in self.idle)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A pinned uint8 buffer of at least nbytes, or None when the limit leaves no room."""
        size = _size_class(nbytes)
        with self._lock:
            fits = [b for b in self.idle if size <= b.numel() <= size + size // 4]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self.idle.remove(buf)
                self.in_use += buf.numel()
                return buf
            while self.idle and self.in_use + self.idle_bytes + size > self.limit:
                self.idle.remove(max(self.idle, key=lambda b: b.numel()))
            if self.in_use + size > self.limit:
                return None
            self.in_use += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        """A buffer back, once no copy into or out of it is in flight."""
        with self._lock:
            self.in_use -= buf.numel()
            self.idle.append(buf)


def _views(buf: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors shaped as `like`'s, laid one after another in `buf` (256-byte aligned)."""
    out, at = {}, 0
    for name, t in like.items():
        nbytes = t.numel() * t.element_size()
        out[name] = buf[at : at + nbytes].view(t.dtype).view(t.shape)
        at += -(-nbytes // 256) * 256
    return out


def _span(tensors: dict[str, torch.Tensor]) -> int:
    return sum(-(-(t.numel() * t.element_size()) // 256) * 256 for t in tensors.values())


@dataclass
class SavedRow:
    """One paused sequence's row, off the device."""

    length: int  # tokens of KV held
    nbytes: int  # raw bytes of the row's tensors
    tensors: dict[str, torch.Tensor] | None  # in host memory until written (or for good)
    logits: torch.Tensor | None  # next-token logits (host), None mid-prefill
    path: Path | None = None
    stored_bytes: int = 0  # on disk, after the codec
    codec: str = "none"
    copied: torch.cuda.Event | None = None  # the device-to-host copy, on CUDA
    written: Future[None] | None = None
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    buffer: torch.Tensor | None = None  # the pooled pinned buffer the tensors live in (CUDA)
    grant: Any = None  # the ledger's reservation for its host copy, while held


def _to_bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous().view(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        flat = flat.view(torch.int16)
    return bytes(flat.numpy().view(np.uint8).data)


def _from_bytes(raw: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    array = np.frombuffer(raw, dtype=torch.empty(0, dtype=carrier).numpy().dtype).copy()
    return torch.from_numpy(array).view(dtype).reshape(shape)


class RestoreFailed(Exception):
    """An offloaded row could not be restored; its sequence is prefilled again."""


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
          "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}  # fmt: skip


def write_row_file(
    path: Path,
    length: int,
    parts: dict[str, torch.Tensor],
    placed: Callable[[int, list[str]], None] | None = None,
    lock: threading.Lock | None = None,
) -> list[str]:
    """`parts` into the file at `path` (written beside it, then renamed into place):
    MAGIC, the header's length and CRC-32, the header (JSON: the row's length, each
    part's name, shape, dtype, codec, stored bytes and CRC-32), the parts. Returns the
    codecs used. `placed(stored_bytes, codecs)`, where given, runs right after the rename,
    both under `lock`: whoever takes that lock never sees the file under its name
    without its entry saying where it is."""
    import lz4.frame

    entries: list[dict[str, object]] = []
    blobs = []
    for name, t in parts.items():
        raw = _to_bytes(t)
        packed = lz4.frame.compress(raw)
        codec = "lz4" if len(raw) >= MIN_RATIO * len(packed) else "none"
        blob = packed if codec == "lz4" else raw
        entries.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "codec": codec,
                "bytes": len(blob),
                "crc32": zlib.crc32(blob),
            }
        )
        blobs.append(blob)
    meta = json.dumps({"length": length, "parts": entries}).encode()
    codecs = [str(e["codec"]) for e in entries]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + PREFIX.pack(len(meta), zlib.crc32(meta)) + meta)
        for blob in blobs:
            f.write(blob)
        stored = f.tell()
    with lock if lock is not None else contextlib.nullcontext():
        tmp.rename(path)
        if placed is not None:
            placed(stored, codecs)
    return codecs


def read_row_file(path: Path, length: int) -> dict[str, torch.Tensor]:
    """The parts of a row file, every check passed (RestoreFailed saying which did not):
    the header and each part as their CRC-32s say, the file exactly as long as its
    header says, the row's length as saved, every floating-point value finite."""
    import lz4.frame

    try:
        data = path.read_bytes()
    except OSError as err:
        raise RestoreFailed(f"cannot read {path.name}: {err.strerror or err}") from err
    start = len(MAGIC) + PREFIX.size
    if len(data) < start or not data.startswith(MAGIC):
        raise RestoreFailed(f"{path.name} is not an offloaded KV row (or is cut short)")
    size, crc = PREFIX.unpack_from(data, len(MAGIC))
    meta = data[start : start + size]
    if len(meta) != size or zlib.crc32(meta) != crc:
        raise RestoreFailed(f"{path.name}: its header does not match its checksum")
    header = json.loads(meta)
    entries = header["parts"]
    expected = start + size + sum(int(e["bytes"]) for e in entries)
    if len(data) != expected or header["length"] != length:
        raise RestoreFailed(f"{path.name} is {len(data)} bytes, not the {expected} its header says (truncated?)")
    parts: dict[str, torch.Tensor] = {}
    at = start + size
    for e in entries:
        blob = data[at : at + int(e["bytes"])]
        at += int(e["bytes"])
        if zlib.crc32(blob) != e["crc32"]:
            raise RestoreFailed(f"{path.name}: part {e['name']} does not match its checksum")
        dtype = DTYPES.get(e["dtype"])
        if dtype is None or e["codec"] not in ("lz4", "none"):
            raise RestoreFailed(f"{path.name}: part {e['name']} has an unknown type or codec")
        try:
            raw = lz4.frame.decompress(blob) if e["codec"] == "lz4" else blob
            tensor = _from_bytes(raw, tuple(e["shape"]), dtype)
        except (RuntimeError, ValueError) as err:
            raise RestoreFailed(f"{path.name}: part {e['name']} does not decode: {err}") from err
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RestoreFailed(f"{path.name}: part {e['name']} holds NaN or infinite values")
        parts[e["name"]] = tensor
    return parts


class KVOffload:
    """Rows of paused sequences, off the device: in `where` ("memory" or "disk", under
    `directory`), at most `max_memory_bytes` held in host memory at once (beyond that a
    row is not offloaded: its sequence is prefilled again)."""

    def __init__(
        self, where: OffloadWhere, device: torch.device, directory: Path | None = None, max_memory_bytes: int = 1 << 28
    ) -> None:
        if where == "disk" and directory is None:
            raise ValueError("offload to disk needs a directory")
        self.where = where
        self.device = device
        self.directory = directory
        self.max_memory_bytes = max_memory_bytes
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.restore_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self.counts = {"saved": 0, "restored": 0, "recomputed": 0, "skipped": 0, "restore_failed": 0}
        # The memory ledger's say over host copies (the daemon sets these where its budget
        # covers host memory): a grant, or None when the ledger refuses the bytes.
        self.reserve: Callable[[int], Any | None] = lambda nbytes: True
        self.release_grant: Callable[[Any], None] = lambda grant: None
        self.recheck = Recheck()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload") if where == "disk" else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.pinned = PinnedPool(max_memory_bytes) if device.type == "cuda" else None
        if directory is not None and where == "disk":
            # What an earlier run offloaded belongs to sequences that are gone.
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True, exist_ok=True)

    # -- saving ---------------------------------------------------------------------
    def save(self, cache: RowCache, row: int, length: int, logits: torch.Tensor | None) -> SavedRow | None:
        """Copy row `row` (holding `length` tokens) and its logits off the device; None
        when it does not fit in host memory now (the caller recomputes instead)."""
        if self.where == "off" or length <= 0:
            return None
        with torch.inference_mode():
            if self._stream is not None:
                cuda_saved = self._save_cuda(cache, row, length, logits)
                if cuda_saved is None:
                    with self._lock:
                        self._skipped(0)
                    return None
                saved = cuda_saved
            else:
                parts = cache.save_row(row, length)  # copies already
                host = logits.detach().clone() if logits is not None else None
                nbytes = sum(t.numel() * t.element_size() for t in parts.values())
                saved = SavedRow(length, nbytes, parts, host)
        with self._lock:
            if saved.buffer is None and self.memory_bytes + saved.nbytes > self.max_memory_bytes:
                self._skipped(saved.nbytes)
                return None
        # A pooled pinned buffer is held whole while the row is in it: that is what it costs.
        charged = saved.buffer.numel() if saved.buffer is not None else saved.nbytes
        saved.grant = self.reserve(charged)
        with self._lock:
            if saved.grant is None:
                self._skipped(charged, "the memory ledger")
                if saved.buffer is not None:
                    self._let_go(saved, charged=False)
                return None
            self.memory_bytes += saved.nbytes
            self.counts["saved"] += 1
        if self._writer is not None:
            saved.written = self._writer.submit(self._write, saved)
        return saved

    def _skipped(self, nbytes: int, by: str = "") -> None:
        """Under the lock: a row not offloaded (its sequence will be prefilled again)."""
        self.counts["skipped"] += 1
        if by:
            logger.info("KV offload: %s refused %d bytes; recompute instead", by, nbytes)
        else:
            limit = self.max_memory_bytes
            logger.info("KV offload: %d bytes do not fit the %d allowed; recompute instead", nbytes, limit)

    def _save_cuda(self, cache: RowCache, row: int, length: int, logits: torch.Tensor | None) -> SavedRow | None:
        """The row into a pooled pinned buffer, copied on the side stream; None when the
        pool has no room for it."""
        assert self._stream is not None and self.pinned is not None
        serving = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(serving)  # the row as the steps so far left it
        with torch.cuda.stream(self._stream):
            parts = cache.save_row(row, length)
            if logits is not None:
                parts["__logits__"] = logits
            buf = self.pinned.take(_span(parts))
            if buf is None:
                return None
            host = _views(buf, parts)
            for name, t in parts.items():
                host[name].copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self._stream)
        serving.wait_event(copied)  # the row is reused only after its copy, on the GPU
        host_logits = host.pop("__logits__", None)
        nbytes = sum(t.numel() * t.element_size() for t in host.values())
        return SavedRow(length, nbytes, host, host_logits, copied=copied, buffer=buf)

    def _let_go(self, saved: SavedRow, charged: bool = True) -> None:
        """Under the lock: the row's host copy released (its pooled buffer back once the
        copy into it is done), and its ledger grant."""
        saved.tensors = saved.logits = None
        if charged:
            self.memory_bytes -= saved.nbytes
            if saved.grant is not None:
                self.release_grant(saved.grant)
            saved.grant = None
        if saved.buffer is not None and self.pinned is not None:
            if saved.copied is not None:
                saved.copied.synchronize()
            self.pinned.give(saved.buffer)
            saved.buffer = None

    def _write(self, saved: SavedRow) -> None:
        """On the writer thread: the row into a file, then its host copy let go."""
        assert self.directory is not None and saved.tensors is not None
        if saved.copied is not None:
            saved.copied.synchronize()
        parts = dict(saved.tensors)
        if saved.logits is not None:
            parts["__logits__"] = saved.logits
        path = self.directory / f"{uuid.uuid4().hex}.kv"

        def placed(stored: int, codecs: list[str]) -> None:
            # With the rename, under the lock: once the file has its name, the entry
            # points at it and its host copy is gone, so a restore reads the file.
            saved.path, saved.stored_bytes = path, stored
            saved.codec = "lz4" if "lz4" in codecs else "none"
            saved.shapes = {name: (tuple(t.shape), t.dtype) for name, t in parts.items()}
            self._let_go(saved)  # on disk now: its host memory goes back
            self.disk_bytes += stored

        write_row_file(path, saved.length, parts, placed, self._lock)

    # -- restoring ------------------------------------------------------------------
    def choose(self, saved: SavedRow) -> Literal["restore", "recompute"]:
        """Restore or recompute `saved`, by the rates measured so far."""
        if self.restore_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return "restore"
        restore_s = saved.nbytes / self.restore_bytes_per_s
        recompute_s = saved.length / self.prefill_tokens_per_s
        if restore_s <= recompute_s:
            self.recheck.chosen()
            return "restore"
        return "restore" if self.recheck.take_anyway() else "recompute"

    def restore(self, saved: SavedRow, cache: RowCache, row: int) -> torch.Tensor | None:
        """Put `saved` into row `row`; returns its logits on the device (None if it was
        saved mid-prefill). The entry is released. RestoreFailed (the entry released, its
        file gone, the figures put right) when it cannot be: the caller prefills again."""
        t0 = time.perf_counter()
        try:
            tensors, logits = self._read(saved)
            with torch.inference_mode():
                cache.load_row(row, saved.length, tensors)
                out = logits.to(self.device, non_blocking=True) if logits is not None else None
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        except Exception as err:
            # Whatever a row file can do to a restore is this sequence's alone: it is let
            # go here and prefilled again by the caller.
            with self._lock:
                self.counts["restore_failed"] += 1
            logger.warning("KV offload: a paused sequence's row cannot be restored (%s); prefilling it again", err)
            self.release(saved)
            if isinstance(err, RestoreFailed):
                raise
            raise RestoreFailed(f"{type(err).__name__}: {err}") from err
        seconds = time.perf_counter() - t0
        self._measured("restore_bytes_per_s", saved.nbytes / max(seconds, 1e-9))
        with self._lock:
            self.counts["restored"] += 1
        self.release(saved)
        return out

    def _read(self, saved: SavedRow) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        with self._lock:
            tensors, logits, path = saved.tensors, saved.logits, saved.path
        if tensors is not None:
            if saved.copied is not None:
                saved.copied.synchronize()
            return tensors, logits
        if path is None:
            raise RestoreFailed("the row was neither held nor written (its write failed)")
        parts = read_row_file(path, saved.length)
        if {name: (tuple(t.shape), t.dtype) for name, t in parts.items()} != saved.shapes:
            raise RestoreFailed(f"{path.name} does not hold the row that was saved")
        logits = parts.pop("__logits__", None)
        return parts, logits

    def recomputed(self, saved: SavedRow) -> None:
        with self._lock:
            self.counts["recomputed"] += 1
        self.release(saved)

    def release(self, saved: SavedRow) -> None:
        """Let go of an entry (its sequence resumed, or ended while paused)."""
        if saved.written is not None:
            try:
                saved.written.result()
            except Exception:  # a failed write leaves the row in memory, or nowhere
                logger.exception("KV offload: writing a row failed")
        with self._lock:
            if saved.tensors is not None:
                self._let_go(saved)
            if saved.path is not None:
                saved.path.unlink(missing_ok=True)
                self.disk_bytes -= saved.stored_bytes
                saved.path = None

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill's measured rate: what recomputing a row would cost."""
        if tokens >= 16 and seconds > 0:  # short ones measure launch overhead, not the rate
            self._measured("prefill_tokens_per_s", tokens / seconds)

    def _measured(self, name: str, value: float) -> None:
        with self._lock:
            old = getattr(self, name)
            setattr(self, name, value if old is None else (1 - EMA) * old + EMA * value)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "where": self.where,
                "memory_bytes": self.memory_bytes,
                "disk_bytes": self.disk_bytes,
                "pinned_idle_bytes": self.pinned.idle_bytes if self.pinned is not None else 0,
                "restore_mb_s": None if self.restore_bytes_per_s is None else self.restore_bytes_per_s / 1e6,
                "prefill_tok_s": self.prefill_tokens_per_s,
                **self.counts,
                "rechecked": self.recheck.taken,
            }

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
