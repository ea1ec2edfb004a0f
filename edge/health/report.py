"""Sections of the status document (`edgectl status --json`), each from the part of the
daemon that owns the figures."""

from __future__ import annotations

from typing import Any

from edge.memory import peak_rss_bytes, rss_bytes
from edge.scheduler.branch import Worker
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager
from edge.scheduler.text_worker import TextWorker
from edge.text.kv.kv_cache import KVCacheManager


def memory_section(ledger: MemoryLedger, probe: Any, kv: KVCacheManager | None) -> dict[str, Any]:
    """The ledger's figures beside what the process really holds, host and device.
    `scope` says what the budget covers: host (no GPU model), device (a discrete GPU:
    its memory), unified (a Jetson: one DRAM, both sides count)."""
    doc: dict[str, Any] = {
        **ledger.snapshot(),
        "scope": getattr(probe, "scope", "host"),
        "rss_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    peak = getattr(probe, "peak", None)
    use = getattr(probe, "use", None)
    if getattr(probe, "scope", "host") != "host" and callable(peak) and callable(use):
        now, top = use(), peak()
        doc["device_bytes"] = now.device
        doc["device_peak_bytes"] = top.device
        # What the process has held at most of what the budget covers.
        doc["process_peak_bytes"] = probe.counted(top)
    else:
        doc["process_peak_bytes"] = doc["peak_rss_bytes"]
    available = getattr(probe, "available_bytes", None)
    doc["available_bytes"] = available() if callable(available) else None
    if kv is not None:
        doc["kv"] = kv.snapshot()
    return doc


def models_section(manager: ModelManager) -> list[dict[str, Any]]:
    return [
        {
            "name": m.name,
            "branch": m.branch,
            "backend": m.backend,
            "device": m.device,
            "memory_bytes": m.memory_bytes,
            "host_bytes": m.host_bytes,
            "device_bytes": m.device_bytes,
            "working_bytes": m.working_bytes,
            "load_ms": round(m.load_ms, 1),
            "loaded": m.obj is not None,
            "loads": m.loads,
            "keep_alive_s": None if m.keep_alive_s == float("inf") else m.keep_alive_s,
        }
        for m in manager.models()
    ]


BRANCH_TASKS = {"vision": ("ocr", "inspect"), "text": ("qa", "embed")}


def branches_section(
    workers: dict[str, Worker], task_errors: dict[str, str], extra: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per branch its queue and batches; a task whose model did not load is named with
    the reason (`unavailable_tasks`), and a branch none of whose tasks loaded is
    unavailable: either is a WARNING, never a silent OK."""
    branches: dict[str, Any] = {}
    for name in ("vision", "text"):
        worker = workers.get(name)
        errors = {t: task_errors[t] for t in BRANCH_TASKS[name] if t in task_errors}
        if worker is not None:
            branches[name] = {
                "available": True,
                "depth": len(worker.queue),
                "max": worker.queue.max_size,
                "running": worker.running,
                "batch_sizes": {str(k): v for k, v in sorted(worker.batch_sizes.items())},
                **extra.get(name, {}),
            }
            if errors:
                branches[name]["unavailable_tasks"] = errors
            if isinstance(worker, TextWorker):
                branches[name]["paused"] = worker.paused
                branches[name]["over_budget"] = worker.over_budget
                branches[name]["stopped"] = worker.stopped
        elif errors:
            reason = "; ".join(f"{t}: {why}" for t, why in errors.items())
            branches[name] = {"available": False, "reason": reason, "depth": 0, "max": 0}
    return branches
