"""A GGUF file's metadata and tensor list, read in one pass over its header.

gguf-py's GGUFReader (the format's maintained reader) builds a numpy view for every part of
every field: for a tokenizer of 262,144 entries (Gemma 3's) that is a million views, 26 s
of CPU before the first weight is read, for a 270M model. Here the header is read with
`struct` from a mapping of the file, strings decoded as they come (0.5 s for the same file); the
tensors' data stay in the file, mapped only when one is asked for. The constants (value
types, quantization block sizes) are gguf-py's: the format is its, not ours. What the
import uses of a GGUFReader is what this gives: `fields[key].contents()` and `tensors`
with `name`, `shape`, `tensor_type`, `data` and `data_offset`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUFValueType: the struct format of each scalar type.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class Field:
    value: Any  # a scalar, a str, or a list of them

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: np.ndarray  # the file's order: the row length first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    path: Path

    @property
    def raw_dtype(self) -> np.dtype[Any]:
        """The stored array's element type, as GGUFReader gives it: the type itself for a
        plain one, bytes for a quantized one."""
        import gguf

        kind: type[np.generic] = _plain_types(gguf).get(self.tensor_type, np.uint8)
        return np.dtype(kind)

    @property
    def raw_shape(self) -> tuple[int, ...]:
        """The stored array's shape (outermost dimension first): rows of bytes for a
        quantized type, as GGUFReader gives it."""
        import gguf

        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        if self.tensor_type in _plain_types(gguf):
            return dims
        return tuple(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))

    @property
    def data(self) -> np.ndarray:
        """The stored array, mapped from the file (read-only)."""
        return np.memmap(self.path, dtype=self.raw_dtype, mode="r", offset=self.data_offset, shape=self.raw_shape)


def _plain_types(gguf: Any) -> dict[Any, type[np.generic]]:
    q = gguf.GGMLQuantizationType
    return {q.F16: np.float16, q.F32: np.float32, q.F64: np.float64, q.I8: np.int8, q.I16: np.int16,
            q.I32: np.int32, q.I64: np.int64}  # fmt: skip


class _Cursor:
    def __init__(self, raw: mmap.mmap, path: Path) -> None:
        self.raw, self.at, self.path = raw, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.raw):
            raise GgufFormatError(f"{self.path.name}: the header runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.raw, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.raw):
            raise GgufFormatError(f"{self.path.name}: a string runs past the end of the file")
        text = self.raw[self.at : self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt)
                if self.at + size * count > len(self.raw):
                    raise GgufFormatError(f"{self.path.name}: an array runs past the end of the file")
                values = list(struct.unpack_from(f"<{count}{fmt}", self.raw, self.at))
                self.at += size * count
                return values
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise GgufFormatError(f"{self.path.name}: unknown value type {kind}")
        return self.take("<" + _SCALARS[kind])


class GgufHeader:
    """`fields` (key -> Field) and `tensors` (in the file's order) of a GGUF file."""

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.path = Path(path)
        with self.path.open("rb") as fh:
            if self.path.stat().st_size == 0:
                raise ValueError(f"{self.path.name} is not a GGUF file (it is empty)")
            # Mapped, not read: only the header's pages are touched, however large the
            # file, and a damaged header is found past the file's end, not read into memory.
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as raw:
                self.fields, self.tensors = self._parse(raw, gguf)

    def _parse(self, raw: mmap.mmap, gguf: Any) -> tuple[dict[str, Field], list[TensorInfo]]:
        cur = _Cursor(raw, self.path)
        if raw[:4] != MAGIC:
            raise ValueError(f"{self.path.name} is not a GGUF file")
        cur.at = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path.name}: GGUF version {version} is not supported")
        n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
        fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = Field(cur.value(cur.take("<I")))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            kind, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, kind, offset))
        alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else DEFAULT_ALIGNMENT
        start = -(-cur.at // alignment) * alignment
        tensors = [
            TensorInfo(name, np.array(dims, dtype=np.uint64), gguf.GGMLQuantizationType(kind), start + off, self.path)
            for name, dims, kind, off in infos
        ]
        return fields, tensors
