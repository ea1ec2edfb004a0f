"""Loaded models under the ledger: measured loads, eviction of idle ones, reloads.

A model enters the ledger at the size the probe saw its load add. When a job's
reservation does not fit, idle models are evicted, least recently used first and only
once their keep-alive has run out (the ledger picks them; a model a job is using is never
a candidate), until the shortfall is covered. What unloading gives back is measured too:
an allocator that keeps freed pages means the process still holds them, and the ledger
keeps counting that part (its "retained" entry) instead of believing the model's whole
size came back. An evicted model is loaded again, measured again, when a job needs it;
if it cannot fit even after evicting what may go, the job is answered over_budget.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge.memory import MemoryUse, counted_of, return_free_memory, use_of
from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.ledger import MemoryLedger, MemoryProbe, Reservation

logger = logging.getLogger(__name__)


@dataclass
class ManagedModel:
    name: str
    branch: str
    backend: str
    load: Callable[[], Any]
    keep_alive_s: float
    device: str = "cpu"
    # On the CPU, the bytes the model's files put in memory: a load that measures less
    # reused pages an earlier owner freed, and the model is counted at least this.
    host_floor_bytes: int = 0
    # The most one job's work on it takes beyond its input (what each such job reserves),
    # where the task measured one.
    working_bytes: int = 0
    obj: Any = None
    memory_bytes: int = 0  # what the budget counts (the ledger's figure)
    host_bytes: int = 0  # measured at the last load, on the host and on the GPU
    device_bytes: int = 0
    load_ms: float = 0.0
    loads: int = 0


class ModelManager:
    def __init__(self, ledger: MemoryLedger, probe: MemoryProbe) -> None:
        self.ledger = ledger
        self.probe = probe
        self._models: dict[str, ManagedModel] = {}
        self._lock = threading.RLock()

    def register(
        self,
        name: str,
        branch: str,
        backend: str,
        load: Callable[[], Any],
        keep_alive_s: float,
        device: str = "cpu",
        host_floor_bytes: int = 0,
    ) -> None:
        with self._lock:
            floor = host_floor_bytes if device == "cpu" else 0
            self._models[name] = ManagedModel(name, branch, backend, load, keep_alive_s, device, floor)

    def describe(self, name: str, backend: str) -> None:
        """Say what a loaded model actually runs on (known only once it has loaded)."""
        with self._lock:
            self._models[name].backend = backend

    def set_working(self, name: str, nbytes: int) -> None:
        """Record what one job's work on a model takes at most (for status)."""
        with self._lock:
            self._models[name].working_bytes = nbytes

    def counted(self, use: MemoryUse) -> int:
        """Of host and device bytes, what the budget covers on this box."""
        return counted_of(self.probe, use)

    def models(self) -> list[ManagedModel]:
        with self._lock:
            return list(self._models.values())

    def known(self, name: str) -> bool:
        with self._lock:
            return name in self._models

    def set_keep_alive(self, name: str, keep_alive_s: float) -> None:
        """A new keep-alive for a registered model (a reload), in the ledger too if it
        is loaded: its idle time is counted against the new figure from now on."""
        with self._lock:
            self._models[name].keep_alive_s = keep_alive_s
        self.ledger.set_keep_alive(name, keep_alive_s)

    def loaded(self, name: str) -> bool:
        with self._lock:
            return self._models[name].obj is not None

    def get(self, name: str, keep: frozenset[str] | set[str] = frozenset()) -> Any:
        """The model, loaded again first if it was evicted (JobError over_budget if it
        cannot be made to fit). Making room never evicts a model in `keep` (the others a
        job is about to use)."""
        with self._lock:
            model = self._models[name]
            if model.obj is None:
                self._load(model, evict=True, keep=frozenset(keep))
            return model.obj

    def load(self, name: str) -> Any:
        """The first load at start: MemoryError with the figures if it does not fit."""
        with self._lock:
            model = self._models[name]
            try:
                self._load(model, evict=False)
            except JobError as err:
                raise MemoryError(err.message) from None
            return model.obj

    def _load(self, model: ManagedModel, evict: bool, keep: frozenset[str] = frozenset()) -> None:
        # A reload's size is known from the first load: room is made before loading, so
        # the load itself never takes the process past the budget.
        known = model.memory_bytes if model.loads else 0
        if known and self.ledger.shortfall(known) and not (evict and self.make_room(known, keep=keep | {model.name})):
            raise self._over_budget(model.name, known)
        t0 = time.perf_counter()
        before = use_of(self.probe)
        obj = model.load()
        grown = use_of(self.probe).minus(before)
        used = self.counted(grown)
        floor = self.counted(MemoryUse(host=model.host_floor_bytes))
        # A runtime that says what it holds on the device (a TensorRT engine's context
        # memory) is counted at least at that, whatever the probe saw grow.
        reported = int(getattr(obj, "device_floor_bytes", 0) or 0)
        if reported:
            floor = max(floor, self.counted(MemoryUse(device=reported)))
        if used < floor:
            logger.info(
                "%s measured %.1f MiB, less than its files or its runtime's own figure (%.1f MiB): counted at that",
                model.name,
                used / 2**20,
                floor / 2**20,
            )
            used = floor
        # The first load ran alone, so its figure stands unless a reload measures more. A
        # reload that took less from the system reused what the last unload left behind
        # (the allocator's free pages), which the ledger counts as retained: that part
        # moves back into the model's entry instead of being counted twice.
        reused = max(0, known - used)
        used = max(used, known)
        while not self.ledger.add_model(model.name, model.branch, used, model.keep_alive_s):
            if not (evict and self.make_room(used, keep=keep | {model.name})):
                del obj
                gc.collect()
                return_free_memory()
                raise self._over_budget(model.name, used)
        if reused:
            self.ledger.reclaim_retained(reused)
        model.obj, model.memory_bytes = obj, used
        model.host_bytes, model.device_bytes = grown.host, grown.device
        model.load_ms = (time.perf_counter() - t0) * 1000.0
        model.loads += 1
        logger.info(
            "loaded %s (%s on %s) in %.0f ms: %.1f MiB counted (%.1f MiB host, %.1f MiB device)",
            model.name,
            model.backend,
            model.device,
            model.load_ms,
            used / 2**20,
            grown.host / 2**20,
            grown.device / 2**20,
            extra={"MODEL": model.name},
        )

    def _over_budget(self, name: str, nbytes: int) -> JobError:
        snap = self.ledger.snapshot()
        return JobError(
            ErrorCode.OVER_BUDGET,
            f"{name} needs {nbytes} bytes; the ledger holds {snap['used_bytes']} of "
            f"{self.ledger.capacity_bytes} usable ({snap['budget_bytes']} budget - "
            f"{snap['headroom_bytes']} headroom) and nothing idle can be evicted",
        )

    def make_room(self, nbytes: int, keep: frozenset[str] | set[str] = frozenset()) -> bool:
        """Evict idle models (least recently used, keep-alive over) until nbytes fits;
        True if it does now."""
        with self._lock:
            for name in self.ledger.eviction_candidates():
                if self.ledger.shortfall(nbytes) == 0:
                    return True
                if name in keep or name not in self._models:
                    continue
                self.evict(name)
            return self.ledger.shortfall(nbytes) == 0

    def reserve(self, owner: str, job_class: str, nbytes: int, keep: set[str], model: str) -> Reservation:
        """A job's own buffers, all or nothing, before it runs. Waiting cannot cure a
        refusal on the vision branch (it runs one batch at a time); evicting idle models
        (not those the job `keep`s) can. If that is not enough: JobError over_budget at
        once, with the figures. `model` counts as in use while the reservation is held:
        nothing evicts it."""
        res = self.ledger.reserve(owner, job_class, nbytes, model=model)
        if res is None and self.make_room(nbytes, keep=keep):
            res = self.ledger.reserve(owner, job_class, nbytes, model=model)
        if res is None:
            snap = self.ledger.snapshot()
            raise JobError(
                ErrorCode.OVER_BUDGET,
                f"needs {nbytes} bytes; the ledger holds {snap['used_bytes']} of {self.ledger.capacity_bytes} "
                f"usable ({snap['budget_bytes']} budget - {snap['headroom_bytes']} headroom)",
            )
        return res

    def release(self, res: Reservation, used: set[str]) -> None:
        """Give a job's buffers back; the models it used count as used now, so their
        keep-alive (before they may be evicted) starts from here."""
        self.ledger.release(res)
        self.ledger.touch(*used)

    def evict(self, name: str) -> int:
        """Unload a model; returns the bytes the ledger freed (what the probe saw go)."""
        with self._lock:
            model = self._models[name]
            before = self.probe.used_bytes()
            model.obj = None
            gc.collect()
            return_free_memory()
            if model.device == "cuda":
                import torch  # only reached where a model runs on CUDA

                torch.cuda.empty_cache()  # the allocator's cached blocks go back too
            given_back = max(0, before - self.probe.used_bytes())
            freed = self.ledger.evict(name, model.memory_bytes - given_back)
            logger.info(
                "evicted idle %s: %.1f MiB freed of %.1f MiB measured at load",
                name,
                freed / 2**20,
                model.memory_bytes / 2**20,
                extra={"MODEL": name},
            )
            return freed
