"""Measured memory figures (never estimates): what this process holds, on the host and on
the GPU, and which of it the memory budget covers.

Three kinds of box, three probes:

- `HostProbe` (no model on a GPU): the process's resident set; the budget covers it.
- `CudaProbe` on a discrete GPU: the budget covers the GPU's memory as this process holds
  it (the CUDA context, library workspaces and the caching allocator's reserved bytes);
  host memory is measured and reported beside it, but it is another memory.
- `CudaProbe` on a unified-memory box (a Jetson: CPU and GPU share one DRAM): one pool,
  so host and device allocations both count, and the free figure is the kernel's
  MemAvailable. `cuMemGetInfo` there reports MemFree, which page cache makes far too low
  (and other processes' allocations make meaningless), so it is never used.

The GPU figure comes from NVML's per-process accounting where the driver offers it (it
includes the context and everything the driver hands out); elsewhere from the caching
allocator's reserved bytes plus the context's own footprint, measured once when the
context is created.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
TEGRA_RELEASE = Path("/etc/nv_tegra_release")
DEVICE_TREE_MODEL = Path("/proc/device-tree/model")


def _libc_call(symbol: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        call: Callable[..., int] = getattr(ctypes.CDLL(name), symbol)  # glibc only
    except (OSError, AttributeError):
        return None
    return call


_TRIM = _libc_call("malloc_trim")
_MALLOPT = _libc_call("mallopt")
M_MMAP_THRESHOLD = -3
# Buffers at least this large (a decoded camera frame is 15 MB) get pages of their own,
# given back to the system the moment they are freed.
LARGE_BUFFER_BYTES = 1 << 20


def bound_heap() -> bool:
    """Keep the C heap from holding freed job buffers. glibc raises its mmap threshold
    each time a large mapped block is freed (up to 32 MiB), after which camera frames
    come from per-thread arenas that keep the pages when the frame is freed: the process
    then holds hundreds of MB no reservation covers (a 5 MP burst took it 540 MB past
    its budget). A fixed threshold turns that off. False where the C library has no
    mallopt."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES))


def return_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). An unloaded
    model's buffers go back to the heap, not to the system: without this the process
    keeps them resident and an eviction frees memory only on paper. False where the
    C library has no such call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux, including Jetson)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE


# The process peak from before the last reset of the kernel's high-water mark (a
# working-memory measurement resets it): the peak since start is the larger of the two.
_HWM_BEFORE_RESET = 0


def _vm_hwm() -> int | None:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started (VmHWM), model loads'
    transient peaks included: what the budget must hold, not only the settled figure."""
    hwm = _vm_hwm()
    # Kernels without the field: the current figure is the best known.
    return max(_HWM_BEFORE_RESET, rss_bytes() if hwm is None else hwm)


def host_working_bytes(run: Callable[[], object]) -> int:
    """Bytes this process took at most while `run` ran, beyond what it held before: a
    job's working memory on the host, measured (at warm-up, with nothing else running).
    Free heap pages go back to the system first, so what `run` allocates shows as growth
    instead of reusing them unseen. Where the high-water mark cannot be reset the
    figure is the process's peak since start less what it holds now: larger, never
    smaller, than the truth."""
    global _HWM_BEFORE_RESET
    return_free_memory()
    _HWM_BEFORE_RESET = peak_rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # resets VmHWM to the current resident set (Linux 4.0+)
    except OSError:
        logger.debug("cannot reset the resident high-water mark; working memory is over-estimated")
    before = rss_bytes()
    run()
    hwm = _vm_hwm()
    return max(0, (rss_bytes() if hwm is None else hwm) - before)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory a new allocation can have without swapping."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def is_unified_memory_box(tegra_release: Path = TEGRA_RELEASE, model_file: Path = DEVICE_TREE_MODEL) -> bool:
    """A Jetson (CPU and GPU share one DRAM), known by JetPack's release file or the
    device tree's model name. The GPU's own `is_integrated` flag is checked as well
    where a device is open (CudaProbe)."""
    if tegra_release.exists():
        return True
    try:
        model = model_file.read_bytes().decode("ascii", "replace").lower()
    except OSError:
        return False
    return "jetson" in model or "tegra" in model


@dataclass(frozen=True)
class MemoryUse:
    """Bytes held on the host (resident set) and on the GPU."""

    host: int = 0
    device: int = 0

    def minus(self, before: MemoryUse) -> MemoryUse:
        """What was added since `before` (never negative: an allocator that gives a little
        back during a load does not make the load free)."""
        return MemoryUse(max(0, self.host - before.host), max(0, self.device - before.device))

    def plus(self, other: MemoryUse) -> MemoryUse:
        return MemoryUse(self.host + other.host, self.device + other.device)


class MemoryProbe(Protocol):
    """The ledger's view of the process: `used_bytes` is what the budget covers."""

    def used_bytes(self) -> int: ...


class HostProbe:
    """A box whose models all run on the CPU: the budget covers the resident set."""

    scope = "host"

    def use(self) -> MemoryUse:
        return MemoryUse(host=rss_bytes())

    def counted(self, use: MemoryUse) -> int:
        return use.host

    def used_bytes(self) -> int:
        return rss_bytes()

    def peak(self) -> MemoryUse:
        return MemoryUse(host=peak_rss_bytes())

    def available_bytes(self) -> int | None:
        return mem_available_bytes()


def use_of(probe: MemoryProbe) -> MemoryUse:
    """A probe's host/device breakdown (a probe that has none counts only the host)."""
    use = getattr(probe, "use", None)
    return use() if callable(use) else MemoryUse(host=probe.used_bytes())


def counted_of(probe: MemoryProbe, use: MemoryUse) -> int:
    counted = getattr(probe, "counted", None)
    return int(counted(use)) if callable(counted) else use.host


class _Nvml:
    """This process's bytes on one GPU through NVML (nvidia-ml-py), where it answers."""

    def __init__(self, uuid: str | None, index: int) -> None:
        import pynvml  # guarded by the caller

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        if uuid:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        else:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._pid = os.getpid()

    def process_bytes(self) -> int | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # NVML_ERROR_NOT_SUPPORTED on some boards and VMs
            return None
        for proc in procs:
            if proc.pid == self._pid:
                used = proc.usedGpuMemory
                return int(used) if isinstance(used, int) and used >= 0 else None
        return None

    def temperature_c(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTemperature(self._handle, 0))
        except Exception:
            return None


# The allocator's peak reserved bytes per device before each reset that a working-memory
# measurement made: the process's true peak is the larger of this and the current peak.
_RESERVED_FLOOR: dict[int, int] = {}


def device_working_bytes(run: Callable[[], object], device_index: int) -> int:
    """Bytes the caching allocator handed out at most while `run` ran, beyond what was
    allocated before it: a job's activations on the GPU, measured (at warm-up)."""
    import torch

    torch.cuda.synchronize(device_index)
    _RESERVED_FLOOR[device_index] = max(
        _RESERVED_FLOOR.get(device_index, 0), int(torch.cuda.max_memory_reserved(device_index))
    )
    before = int(torch.cuda.memory_allocated(device_index))
    torch.cuda.reset_peak_memory_stats(device_index)
    run()
    torch.cuda.synchronize(device_index)
    return max(0, int(torch.cuda.max_memory_allocated(device_index)) - before)


class CudaProbe:
    """The GPU side of the process (and its host side), on one CUDA device.

    Built by `open_cuda`, which creates the CUDA context and the cuBLAS handle first, so
    that what they take is measured once, as the runtime's share, before any model."""

    def __init__(self, device_index: int, unified: bool, torch_module: Any, nvml: _Nvml | None) -> None:
        self._torch = torch_module
        self.index = device_index
        self.unified = unified
        self.scope = "unified" if unified else "device"
        self._nvml = nvml
        # Bytes the driver holds for us outside the caching allocator (context, module
        # images, cuBLAS handles), measured at open where NVML does not report them.
        self.context_bytes = 0

    def _reserved(self) -> int:
        return int(self._torch.cuda.memory_reserved(self.index))

    def device_bytes(self) -> int:
        if self._nvml is not None:
            used = self._nvml.process_bytes()
            if used is not None:
                return used
        return self._reserved() + self.context_bytes

    def use(self) -> MemoryUse:
        return MemoryUse(host=rss_bytes(), device=self.device_bytes())

    def counted(self, use: MemoryUse) -> int:
        return use.host + use.device if self.unified else use.device

    def used_bytes(self) -> int:
        return self.counted(self.use())

    def peak(self) -> MemoryUse:
        """The device peak is the allocator's peak reserved plus what the driver holds
        outside it now (context and modules grow, they are not freed while serving)."""
        outside = max(0, self.device_bytes() - self._reserved())
        top = max(_RESERVED_FLOOR.get(self.index, 0), int(self._torch.cuda.max_memory_reserved(self.index)))
        return MemoryUse(host=peak_rss_bytes(), device=top + outside)

    def available_bytes(self) -> int | None:
        if self.unified:
            return mem_available_bytes()
        free, _total = self._torch.cuda.mem_get_info(self.index)
        return int(free)

    def total_bytes(self) -> int:
        return int(self._torch.cuda.get_device_properties(self.index).total_memory)

    def cap_allocator(self, budget_bytes: int) -> float:
        """Cap the caching allocator so that it alone can never take the process past
        the budget (what is already held outside it counts against the budget); returns
        the fraction of the device set."""
        outside = max(0, self.device_bytes() - self._reserved())
        if self.unified:
            outside += rss_bytes()
        allowed = max(0, budget_bytes - outside)
        fraction = min(1.0, allowed / self.total_bytes())
        self._torch.cuda.set_per_process_memory_fraction(fraction, self.index)
        return fraction

    def name(self) -> str:
        return str(self._torch.cuda.get_device_name(self.index))


def open_cuda(device_index: int = 0, unified: bool | None = None) -> tuple[CudaProbe, MemoryUse]:
    """Create the CUDA context (and a cuBLAS handle, with its workspace) on a device and
    return its probe with what that took, host and device, measured: the runtime's share
    of the budget. RuntimeError with the reason when there is no usable device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("a model is set to device 'cuda' but torch sees no CUDA device here")
    before_host = rss_bytes()
    before_avail = mem_available_bytes()
    props = torch.cuda.get_device_properties(device_index)
    if unified is None:
        unified = bool(getattr(props, "is_integrated", False)) or is_unified_memory_box()
    nvml: _Nvml | None = None
    if not unified:
        try:
            uuid = getattr(props, "uuid", None)
            nvml = _Nvml(f"GPU-{uuid}" if uuid else None, device_index)
        except Exception as err:  # no nvidia-ml-py, or NVML absent (containers, Jetson)
            logger.info("NVML unavailable (%s); device memory is the allocator's figure plus the context", err)
    torch.cuda.set_device(device_index)
    a = torch.ones(64, 64, device=f"cuda:{device_index}")
    (a @ a).sum().item()  # context, cuBLAS handle and workspace
    del a
    probe = CudaProbe(device_index, unified, torch, nvml)
    if nvml is None or nvml.process_bytes() is None:
        probe._nvml = None
        after_avail = mem_available_bytes()
        if unified and before_avail is not None and after_avail is not None:
            # On one DRAM the context is what MemAvailable lost beyond our resident growth.
            grown = rss_bytes() - before_host
            probe.context_bytes = max(0, before_avail - after_avail - grown - probe._reserved())
        elif not unified:
            free, total = torch.cuda.mem_get_info(device_index)
            # Without NVML the driver's figure counts every process on the GPU: taken
            # once here, it is the best measure of our context this box offers.
            probe.context_bytes = max(0, int(total - free) - probe._reserved())
    runtime = probe.use().minus(MemoryUse(host=before_host, device=0))
    logger.info(
        "CUDA device %d (%s, %s memory): runtime holds %.0f MiB on the device, %.0f MiB more on the host",
        device_index,
        props.name,
        "unified" if unified else "discrete",
        runtime.device / 2**20,
        runtime.host / 2**20,
    )
    return probe, runtime
