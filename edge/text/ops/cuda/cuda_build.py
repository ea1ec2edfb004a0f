"""Our CUDA C sources (cuda_int4.cu, decode_ops.cu, kv_ops.cu) built on the box by nvcc and loaded
through ctypes: one library per source, nvcc version, flags and GPU architecture, in the
kernel cache the CPU kernels use (cpu_int4.cache_dir).

nvcc is looked for in $CUDA_HOME/bin, on PATH and in /usr/local/cuda/bin (where JetPack
puts it). A library is built for the device's own architecture (sm_87 on an Orin, sm_90
on Hopper), unless EDGE_CUDA_ARCH names a virtual one (e.g. `compute_80`): then nvcc
writes PTX for it alone and the driver compiles that for the device at load, so a newer
GPU runs only the instructions the older architecture has (the Jetson-proxy
measurements run Ampere's code on a Hopper GPU this way).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from edge.text.ops.cpu import cpu_int4

logger = logging.getLogger(__name__)

ARCH_ENV = "EDGE_CUDA_ARCH"
MIN_ARCH = (8, 0)  # bfloat16 conversions and mma.sync with bfloat16 operands


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for candidate in (f"{home}/bin/nvcc" if home else None, shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def target(arch: str) -> str:
    """nvcc's -arch for a device of compute capability `arch` ("87"): sm_87, or the
    virtual architecture EDGE_CUDA_ARCH names."""
    return os.environ.get(ARCH_ENV) or f"sm_{arch}"


def flags(arch: str) -> list[str]:
    return ["-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch={target(arch)}"]


def library_path(compiler: str, source: Path, arch: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.cuh"))]  # what a source may include
    for part in (source.read_bytes(), *headers, version.encode(), " ".join(flags(arch)).encode()):
        key.update(part)
        key.update(b"\0")
    return cpu_int4.cache_dir() / f"{source.stem}-{target(arch).replace('_', '')}-{key.hexdigest()[:16]}.so"


def build(source: Path, arch: str) -> Path:
    """Compile `source` for compute capability `arch` into the cache unless it is there;
    returns the library's path. Concurrent builders each write a temporary file and
    rename it into place."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("no nvcc (install the CUDA toolkit, or set CUDA_HOME)")
    path = library_path(compiler, source, arch)
    if path.exists():
        return path
    logger.info("building %s for %s (about a minute, once per machine)", source.name, target(arch))
    cpu_int4.compile_into(path, [compiler, *flags(arch)], source, timeout=600)
    logger.info("built %s: %s", source.name, path)
    return path


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


class CudaLibrary:
    """A CUDA source of ours, built for each GPU architecture the first time a device of
    it asks (build()) and loaded once; `declare` sets the entry points' ctypes
    signatures. A failure is remembered and given again, so a box without nvcc asks once."""

    def __init__(self, source: Path, what: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.what, self.declare = source, what, declare
        self._lock = threading.Lock()
        self._libs: dict[str, ctypes.CDLL] = {}
        self._errors: dict[str, str] = {}

    def load(self, device: torch.device) -> ctypes.CDLL:
        """The library for `device` (raises RuntimeError where it cannot be built)."""
        arch = device_arch(device)
        with self._lock:
            if arch in self._libs:
                return self._libs[arch]
            if arch in self._errors:
                raise RuntimeError(self._errors[arch])
            try:
                if (int(arch[:-1]), int(arch[-1])) < MIN_ARCH:
                    raise RuntimeError(f"sm_{arch} is older than the sm_80 our CUDA kernels need")
                lib = ctypes.CDLL(str(build(self.source, arch)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                self._errors[arch] = f"{self.what} is unavailable: {exc}"
                raise RuntimeError(self._errors[arch]) from exc
            self.declare(lib)
            self._libs[arch] = lib
            return lib

    def available(self, device: torch.device | str = "cuda") -> bool:
        """Whether the library builds (building it now if needed) and loads for `device`."""
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        try:
            self.load(device)
        except RuntimeError:
            return False
        return True


def stream() -> int:
    """Torch's current stream, where our kernels launch (so CUDA graphs capture them)."""
    return int(torch.cuda.current_stream().cuda_stream)


# The attention's split counters (attention_common.cuh's merge_if_last), per device and
# stream: kernels on one stream run one after another, so one buffer serves them all and
# each call leaves it zeros; two streams must not share one. Every buffer made is kept:
# a graph captured with one replays on its address for the life of the process.
DONE_MIN = 4096
_done: dict[tuple[int, int], torch.Tensor] = {}
_done_kept: list[torch.Tensor] = []
_done_lock = threading.Lock()


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` int32 zeros on `device` for the split counters of a launch on the current
    stream. Made outside any graph capture (the capture helpers warm up on the capture's
    stream first); one missing inside a capture is an error, not a buffer from the graph's
    pool that the next replay would zero behind another launch's back."""
    key = (torch.device(device).index or 0, stream())
    with _done_lock:
        done = _done.get(key)
        if done is None or done.numel() < n:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the attention's split counters must be made before a CUDA graph capture")
            done = torch.zeros(max(n, DONE_MIN), dtype=torch.int32, device=device)
            _done[key] = done
            _done_kept.append(done)
        return done


def main() -> None:
    """Build every CUDA source of ours for this machine's GPU now (scripts/setup.sh calls
    this where torch sees a CUDA device) rather than at the daemon's first start."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to build")
    arch = device_arch(torch.device("cuda"))
    for source in sorted(Path(__file__).parent.glob("*.cu")):
        print(build(source, arch))


if __name__ == "__main__":
    main()
