"""A safetensors file written a tensor at a time, in any order, never held whole.

`safetensors.torch.save_file` takes every tensor at once and copies each to bytes before
writing: for an 8B model's float32 import that is 32 GB held twice. Here the header is
written first from the tensors' names, types and shapes, known before any is read
(the model's config says them), and each tensor's bytes go straight to their place in
the file as they are made. The format is safetensors' own (a little-endian header length,
the JSON header padded with spaces to 8 bytes, then the tensors back to back); the tensors
are ordered by element size, largest first, so each starts aligned to its element size,
and `safe_open` reads the file as one of its own.

A file with a tensor never written is refused at `close()`: a build that stops part way
raises, and its scratch directory is never published (engines/cache.py).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# os.pwrite writes at most this much per call on Linux.
_MAX_WRITE = 1 << 30

Spec = tuple[torch.dtype, Sequence[int]]


class SafetensorsWriter:
    """`specs`: every tensor the file will hold, by name: (dtype, shape)."""

    def __init__(self, path: Path, specs: Mapping[str, Spec]) -> None:
        order = sorted(specs, key=lambda name: (-specs[name][0].itemsize, name))
        header: dict[str, dict[str, object]] = {}
        self._places: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        end = 0
        for name in order:
            dtype, shape = specs[name]
            if dtype not in DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
            size = dtype.itemsize
            for dim in shape:
                size *= int(dim)
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [end, end + size]}
            self._places[name] = (end, dtype, tuple(int(d) for d in shape))
            end += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._base = 8 + len(blob)
        self.nbytes = end
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(self._fd, struct.pack("<Q", len(blob)) + blob)
            os.ftruncate(self._fd, self._base + end)
        except BaseException:
            os.close(self._fd)
            raise
        self._pending = set(specs)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._pending:
            raise ValueError(f"{name} is not a tensor of this file, or was written already")
        offset, dtype, shape = self._places[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} is {tensor.dtype} {list(tensor.shape)}, the file expects {dtype} {list(shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view = data.data  # the tensor's own bytes, not a copy
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done : done + _MAX_WRITE], self._base + offset + done)
        self._pending.discard(name)

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self._pending:
            missing = sorted(self._pending)
            raise ValueError(f"{len(missing)} tensors never written: {', '.join(missing[:5])}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        elif self._fd >= 0:
            os.close(self._fd)  # the build failed already: that error is the one to see
            self._fd = -1
