"""What a SIGHUP's new profile changes: the fields that take effect while the daemon
runs, and the others, which wait for a restart.

The daemon reads the profile file again, validates it whole (a bad one is refused and
the running profile kept), and `plan` compares it with the running one. The running
profile then takes the new values of the run-time fields only (`ReloadPlan.profile`): a
field that needs a restart keeps its running value until then, so nothing in the daemon
works from a value it does not serve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge import logs
from edge.config.loader import ProfileError, load_profile
from edge.config.profile import Profile
from edge.health.metrics import MetricsServer
from edge.scheduler.branch import Worker
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.text_worker import TextWorker
from edge.tasks.inspect import INSPECT_MODEL
from edge.tasks.ocr import OCR_MODEL

logger = logging.getLogger(__name__)

# Dotted profile fields a running daemon applies at once.
RUNTIME_FIELDS = (
    "log_level",
    "log_format",
    "queue.max_size",
    "queue.default_deadline_ms",
    "queue.memory_wait_ms",
    "queue.drain_timeout_s",
    "models.ocr.keep_alive_s",
    "models.inspect.keep_alive_s",
    "metrics.listen",
    "watchdog.stall_s",
)


@dataclass
class ReloadPlan:
    profile: Profile  # the running profile with the run-time changes in it
    applied: list[str] = field(default_factory=list)  # run-time fields that changed
    restart: list[str] = field(default_factory=list)  # other fields that changed


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value


def _runtime(path: str) -> bool:
    return any(path == f or path.startswith(f + ".") for f in RUNTIME_FIELDS)


def plan(running: Profile, new: Profile) -> ReloadPlan:
    old_flat = _flatten(running.model_dump(mode="python"))
    new_flat = _flatten(new.model_dump(mode="python"))
    changed = sorted(k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k))
    applied = [k for k in changed if _runtime(k)]
    restart = [k for k in changed if not _runtime(k)]
    doc = running.model_dump(mode="python")
    for key in applied:
        _set(doc, key, new_flat[key])
    return ReloadPlan(Profile.model_validate(doc), applied, restart)


class Reloader:
    """The daemon's SIGHUP: `__call__` reads the profile file again and applies what can
    change while running to the subsystems given; `last` says how the last one went (the
    status shows it)."""

    def __init__(
        self,
        path: Path | None,
        running: Callable[[], Profile],
        adopt: Callable[[Profile], None],
        queues: dict[str, PriorityDeadlineQueue],
        workers: dict[str, Worker],
        manager: ModelManager,
        metrics: MetricsServer,
    ) -> None:
        self._path = path
        self._running = running
        self._adopt = adopt
        self._queues = queues
        self._workers = workers
        self._manager = manager
        self._metrics = metrics
        self.last: dict[str, Any] | None = None

    def __call__(self) -> bool:
        """True once applied; False, the running profile kept, when the new one is refused."""
        now = time.time()
        if self._path is None:
            logger.warning("reload: this daemon was not started from a profile file; nothing to read")
            return False
        try:
            new = load_profile(self._path)
        except ProfileError as err:
            logger.error("reload refused, the running profile stays: %s", err)
            self.last = {"at": now, "ok": False, "error": str(err), "applied": [], "restart": []}
            return False
        change = plan(self._running(), new)
        try:
            self._apply(change.profile, change.applied)
        except Exception as err:  # a value the schema took but the box could not apply
            logger.exception("reload refused, the running profile stays: applying it failed")
            why = f"applying it failed: {type(err).__name__}: {err}"
            self.last = {"at": now, "ok": False, "error": why, "applied": [], "restart": []}
            return False
        self._adopt(change.profile)
        self.last = {"at": now, "ok": True, "error": None, "applied": change.applied, "restart": change.restart}
        restart = ", ".join(change.restart)
        logger.info(
            "reload: applied %s; %s",
            ", ".join(change.applied) or "nothing (no run-time field changed)",
            f"these need a restart to take effect: {restart}" if restart else "nothing needs a restart",
        )
        return True

    def _apply(self, new: Profile, changed: list[str]) -> None:
        if {"log_level", "log_format"} & set(changed):
            logs.setup(new.log_level, new.log_format)
        if "queue.max_size" in changed:
            for queue in self._queues.values():
                queue.set_max_size(new.queue.max_size)
        text = self._workers.get("text")
        if "queue.memory_wait_ms" in changed and isinstance(text, TextWorker):
            text.set_memory_wait(new.queue.memory_wait_ms / 1000.0)
        for key, model in (("ocr", OCR_MODEL), ("inspect", INSPECT_MODEL)):
            if f"models.{key}.keep_alive_s" in changed and self._manager.known(model):
                keep = getattr(new.models, key).keep_alive_s
                self._manager.set_keep_alive(model, float("inf") if keep is None else keep)
        if "metrics.listen" in changed:
            self._metrics.stop()
            if new.metrics.address is not None and not self._metrics.start(new.metrics.address):
                why = self._metrics.error
                self._metrics.start(self._running().metrics.address)  # the old listener back
                raise RuntimeError(f"metrics.listen: {why}")
        # default_deadline_ms, drain_timeout_s and watchdog.stall_s are read from the
        # running profile where they are used: adopting it is enough.
