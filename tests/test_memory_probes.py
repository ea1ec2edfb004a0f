"""What the budget covers on each kind of box, with the hardware faked at its seam (a
fake torch.cuda module, fake /proc and device-tree files): host only on a CPU box, the
GPU's memory on a discrete GPU, both on a Jetson's unified memory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edge.health.report import memory_section
from edge.memory import CudaProbe, HostProbe, MemoryUse, is_unified_memory_box, mem_available_bytes, rss_bytes
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager

GIB = 2**30


class FakeCuda:
    """torch.cuda as far as the probe uses it."""

    def __init__(self, total: int) -> None:
        self.reserved = 0
        self.max_reserved = 0
        self.total = total
        self.fraction: float | None = None

    def memory_reserved(self, index: int) -> int:
        return self.reserved

    def max_memory_reserved(self, index: int) -> int:
        return self.max_reserved

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None:
        self.fraction = fraction

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self.total - self.reserved, self.total


def _probe(unified: bool, context: int = GIB // 2) -> tuple[CudaProbe, FakeCuda]:
    cuda = FakeCuda(total=64 * GIB)
    probe = CudaProbe(0, unified, SimpleNamespace(cuda=cuda), nvml=None)
    probe.context_bytes = context
    return probe, cuda


def test_a_jetson_is_known_by_its_release_file_or_device_tree(tmp_path: Path) -> None:
    release, model = tmp_path / "nv_tegra_release", tmp_path / "model"
    assert not is_unified_memory_box(release, model)
    model.write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\x00")
    assert is_unified_memory_box(release, model)
    model.write_bytes(b"Supermicro X13\x00")
    assert not is_unified_memory_box(release, model)
    release.write_text("# R36 (release), REVISION: 4.0")
    assert is_unified_memory_box(release, model)


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536 kB\nMemFree:          100 kB\nMemAvailable:   40000 kB\n")
    assert mem_available_bytes(meminfo) == 40000 * 1024  # not MemFree, which page cache makes tiny


def test_a_discrete_gpu_counts_its_device_memory_and_reports_the_host() -> None:
    probe, cuda = _probe(unified=False)
    cuda.reserved = 3 * GIB
    use = probe.use()
    assert use.device == 3 * GIB + GIB // 2 and use.host > 0
    assert probe.used_bytes() == use.device  # host memory is another memory there
    assert probe.counted(MemoryUse(host=5 * GIB, device=GIB)) == GIB
    assert probe.available_bytes() == 61 * GIB


def test_unified_memory_counts_both_sides_and_caps_the_allocator_for_both() -> None:
    probe, cuda = _probe(unified=True)
    cuda.reserved = GIB
    assert probe.counted(MemoryUse(host=2 * GIB, device=GIB)) == 3 * GIB
    assert probe.used_bytes() == rss_bytes() + GIB + GIB // 2
    fraction = probe.cap_allocator(8 * GIB)
    # The allocator may take what the budget leaves once the context and the resident
    # host memory are counted.
    assert cuda.fraction == fraction
    assert abs(fraction * 64 * GIB - (8 * GIB - GIB // 2 - rss_bytes())) < 4096


def test_the_device_peak_is_the_allocators_peak_plus_what_is_held_outside_it() -> None:
    probe, cuda = _probe(unified=False)
    cuda.reserved, cuda.max_reserved = GIB, 5 * GIB
    assert probe.peak().device == 5 * GIB + GIB // 2
    doc = memory_section(MemoryLedger(8 * GIB, 0), probe, None)
    assert doc["scope"] == "device" and doc["device_bytes"] == GIB + GIB // 2
    assert doc["process_peak_bytes"] == 5 * GIB + GIB // 2


def test_models_are_recorded_with_host_and_device_bytes() -> None:
    probe, cuda = _probe(unified=False, context=0)
    manager = ModelManager(MemoryLedger(8 * GIB, 0), probe)

    def load() -> object:
        cuda.reserved += 2 * GIB  # what a model's weights take on the GPU
        return object()

    manager.register("llm", "text", "torch-cuda", load, float("inf"), "cuda")
    manager.load("llm")
    (model,) = manager.models()
    assert model.device_bytes == 2 * GIB and model.memory_bytes == 2 * GIB and model.device == "cuda"
    assert manager.ledger.snapshot()["models"]["llm"]["bytes"] == 2 * GIB


def test_a_cpu_box_counts_the_resident_set() -> None:
    probe = HostProbe()
    assert probe.counted(MemoryUse(host=7, device=99)) == 7
    assert memory_section(MemoryLedger(8 * GIB, 0), probe, None)["scope"] == "host"
