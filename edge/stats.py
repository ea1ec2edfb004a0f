"""Job counters and latency percentiles for `edgectl status`."""

from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np

WINDOW = 2048


class JobStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._codes: Counter[str] = Counter()
        self._latency: dict[str, deque[float]] = {}
        self._grounding: Counter[str] = Counter()

    def record_ok(self, task: str, total_ms: float) -> None:
        with self._lock:
            self._ok[task] += 1
            self._latency.setdefault(task, deque(maxlen=WINDOW)).append(total_ms)

    def record_grounding(self, verdict: str) -> None:
        """A qa answer's grounding verdict (edge/tasks/grounding.py)."""
        with self._lock:
            self._grounding[verdict] += 1

    def record_error(self, task: str | None, code: str) -> None:
        with self._lock:
            self._failed[task or "unknown"] += 1
            self._codes[code] += 1

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            latency = {}
            for task, values in self._latency.items():
                arr = np.fromiter(values, dtype=np.float64)
                latency[task] = {
                    "count": int(arr.size),
                    "p50_ms": round(float(np.percentile(arr, 50)), 3),
                    "p99_ms": round(float(np.percentile(arr, 99)), 3),
                }
            return {
                "ok": sum(self._ok.values()),
                "failed": sum(self._failed.values()),
                "ok_by_task": dict(self._ok),
                "failed_by_task": dict(self._failed),
                "errors_by_code": dict(self._codes),
                "qa_grounding": dict(self._grounding),
                "latency": latency,
            }
