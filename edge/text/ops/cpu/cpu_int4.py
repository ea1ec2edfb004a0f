"""Our float32 INT4 kernel for the CPU (cpu_int4.c): built on the box, called through ctypes.

Torch's tiled CPU kernel rounds each product's inputs, scales and outputs to bfloat16;
on SmolLM2 that alone changes about one greedy answer in ten against the quantized
model computed exactly. This one multiplies the checkpoint's own codes, scales and zero
points in float32, so the CPU answers are the quantized model's (and the GPU's, up to
its own float16 activations).

The C source is compiled once per machine, compiler and source version, with
`-march=native` (the box runs what it built), into the kernel cache: EDGE_KERNEL_CACHE,
else $XDG_CACHE_HOME/edge/kernels, else ~/.cache/edge/kernels. Without a C compiler the
kernel is unavailable, and checkpoint loading falls back to torch's tiled kernel (and
says so in the log and in `edgectl status`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_int4.c")
LANES = 16  # cpu_int4.c's vector width in floats: a group must hold two vectors of codes


def supports(in_features: int, group_size: int) -> bool:
    return group_size % (2 * LANES) == 0 and in_features % group_size == 0


def cache_dir() -> Path:
    if os.environ.get("EDGE_KERNEL_CACHE"):
        return Path(os.environ["EDGE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edge" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _flags() -> list[str]:
    common = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
    if platform.machine() in ("aarch64", "arm64"):
        return [*common, "-mcpu=native"]  # aarch64's GCC tunes for the host with -mcpu
    # GCC keeps to 256-bit vectors on AVX-512 CPUs unless asked: the kernel's tiles are
    # written for 512 (1.2-1.5x faster there); elsewhere the preference is moot.
    return [*common, "-march=native", "-mprefer-vector-width=512"]


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def _included(source: Path) -> list[Path]:
    """The files of ours a source includes (`#include "name"`, beside it), so that a change
    to one builds its includers again."""
    names = re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [source.with_name(name) for name in names]


def library_path(cc: str, source: Path | None = None) -> Path:
    """The built library's path: one per source, compiler, flags and CPU."""
    source = source if source is not None else SOURCE
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    sources = [source.read_bytes(), *(f.read_bytes() for f in _included(source))]
    for part in (*sources, version.encode(), " ".join(_flags()).encode(), _cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{source.stem}-{platform.machine()}-{key.hexdigest()[:16]}.so"


def build(source: Path | None = None) -> Path:
    """Compile a C kernel (this one unless told) into the cache unless it is there;
    returns the library's path. Concurrent builders each write a temporary file and
    rename it into place."""
    source = source if source is not None else SOURCE
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc; install gcc, or set CC)")
    path = library_path(cc, source)
    if path.exists():
        return path
    compile_into(path, [cc, *_flags()], source, timeout=300)
    logger.info("built the CPU kernel %s: %s", source.name, path)
    return path


def compile_into(path: Path, command: list[str], source: Path, timeout: float) -> None:
    """Run `command -o TMP source` and rename TMP to `path`: concurrent builders each
    write their own temporary file, and a reader never sees a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*command, "-o", tmp, str(source)], capture_output=True, text=True, check=False, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class CKernel:
    """A C kernel of ours, built on the box the first time it is asked for (build(), into
    the kernel cache) and loaded through ctypes once; a failure is remembered and given
    again, so a box without a compiler asks only once."""

    def __init__(self, source: Path, symbol: str, argtypes: list[Any], what: str) -> None:
        self.source, self.symbol, self.argtypes, self.what = source, symbol, argtypes, what
        self._lock = threading.Lock()
        self._fn: Any = None
        self._error: str | None = None

    def function(self) -> Any:
        """The kernel's entry point (raises RuntimeError where it cannot be built)."""
        with self._lock:
            if self._fn is not None:
                return self._fn
            if self._error is not None:
                raise RuntimeError(self._error)
            try:
                lib = ctypes.CDLL(str(build(self.source)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                self._error = f"{self.what} is unavailable: {exc}"
                raise RuntimeError(self._error) from exc
            fn = getattr(lib, self.symbol)
            fn.restype = ctypes.c_int
            fn.argtypes = self.argtypes
            self._fn = fn
            return fn

    def available(self) -> bool:
        """Whether the kernel builds (building it now if needed) and loads here."""
        try:
            self.function()
        except RuntimeError:
            return False
        return True


_ARGS: list[Any] = [
    ctypes.c_void_p,  # x [M, K] float32
    ctypes.c_int64,  # M
    ctypes.c_int64,  # K
    ctypes.c_void_p,  # qweight [N, K/2] uint8
    ctypes.c_void_p,  # scales [N, K/G] float32
    ctypes.c_void_p,  # zeros [N, K/G] uint8
    ctypes.c_int64,  # N
    ctypes.c_int64,  # G
    ctypes.c_void_p,  # y [M, N] float32
    ctypes.c_int,  # threads
]
_KERNEL = CKernel(SOURCE, "edge_int4_linear", _ARGS, "the float32 CPU INT4 kernel")
# The same products with each activation row rounded to int8 in blocks of 32 (cpu_int4.c).
_INT8_KERNEL = CKernel(SOURCE, "edge_int4_linear_int8", _ARGS, "the int8-activation CPU INT4 kernel")


_TOP_K = CKernel(
    SOURCE,
    "edge_top_k",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p],
    "the CPU top-k selection",
)


def top_k(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [M, k] of each row's k largest entries of y [M, N] float32 (k at most 64
    and N), largest first, of equal values the lower index first; a row with fewer than k
    numbers (NaNs) pads with -1."""
    y = y.detach().to(torch.float32).contiguous()
    m, n = y.shape
    idx = torch.empty(m, k, dtype=torch.int64)
    rc = _TOP_K.function()(y.data_ptr(), m, n, k, idx.data_ptr())
    if rc != 0:
        raise ValueError(f"top {k} of rows of {n} (at most 64 and the row)")
    return idx


def supports_int8(in_features: int, group_size: int) -> bool:
    """Whether the int8-activation kernel takes these: groups a power of two of at least 32."""
    return group_size >= 32 and group_size & (group_size - 1) == 0 and in_features % group_size == 0


def available(int8: bool = False) -> bool:
    """Whether the kernel is built (building it now if needed) and loadable here."""
    try:
        (_INT8_KERNEL if int8 else _KERNEL).function()
    except RuntimeError as exc:
        logger.warning("%s; torch's bfloat16 kernel serves instead", exc)
        return False
    return True


def linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    int8: bool = False,
) -> torch.Tensor:
    """x [M, K] -> [M, N] float32 for weights in the checkpoint's layout (scales float32);
    `int8`: the activations rounded to int8 in blocks of 32 (the int8 kernel)."""
    fn = (_INT8_KERNEL if int8 else _KERNEL).function()
    m, k = x.shape
    n = qweight.shape[0]
    if int8 and not supports_int8(k, group):
        raise ValueError(f"the int8 CPU INT4 kernel takes groups of a power of two from 32 dividing K ({group}, {k})")
    if not int8 and not supports(k, group):
        raise ValueError(f"the CPU INT4 kernel takes groups of a multiple of {2 * LANES} dividing K ({group}, {k})")
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    rc = fn(
        x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, group, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the CPU INT4 kernel failed (code {rc}) on [{m}, {k}] x [{n}, {k}] group {group}")
    return out
