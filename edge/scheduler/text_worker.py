"""The text branch's worker: continuous batching under the memory ledger.

Between decode steps it admits queued jobs, most urgent first, while the KV cache
manager grants the job a row with its KV (prompt plus max_new_tokens) and, on a GPU, the
ledger grants the activations of its prefill (measured at warm-up), all or nothing. When
a job does not fit:

  1. it waits (stays queued, retried between steps) for up to `memory_wait_s`;
  2. then a running sequence of lower priority is paused: its row is offloaded (to host
     memory or the state directory, models.qa.kv_offload) or dropped, the row given
     back, and it goes back in the queue with its tokens; when it is admitted again its
     row is restored or prefilled again, whichever the measured figures say is faster
     (edge/text/kv/kv_offload.py);
  3. if nothing can be paused it keeps waiting, and is answered `over_budget`, with the
     figures, if its deadline passes first.

A job's image is made into the rows its prompt reads (the vision tower and projector)
only once its KV row is granted, inside that admission (Sequence.make_splices), and a
pause drops them with the row: a queued job holds none, as it holds no KV.

A job whose own preparation would be slow (a schema new to the box, compiled for the
model's tokenizer) is not prepared on this thread: the task starts that work elsewhere
(`ready`) and the job stays queued, the running sequences decoding, until it is done.

Models are not evicted for the text branch: its KV comes from the cache the model
allocated at load, which evicting another model would not enlarge. A job can never
outgrow a row (the engine caps max_new_tokens to the context window), so none is
refused for size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from edge.logs import job_fields
from edge.protocol.errors import ErrorCode, JobError, internal_error
from edge.scheduler.branch import Completion, Outcome, Worker, expired_error
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.work import WorkItem
from edge.text.kv.kv_cache import KVSlot
from edge.text.runtime.continuous import ContinuousBatcher, Sequence

logger = logging.getLogger(__name__)

ADMIT_QUICK = 16  # one-call jobs answered between two steps while the queue's head waits
READY_WAIT_S = 0.05  # how long an idle worker waits for a queued job's own slow work at once


class SequenceRunner(Protocol):
    """What the text worker runs: a task that makes sequences (edge/tasks/base.py)."""

    name: str

    def ready(self, item: WorkItem, wait_s: float) -> bool:
        """Whether `prepare` would not wait for slow work of the job's own (a grammar to
        compile): if not, that work starts elsewhere, waited for up to `wait_s`, and the
        job waits in the queue meanwhile, the running sequences decoding on."""
        ...

    def prepare(self, item: WorkItem) -> Sequence | dict[str, Any]:
        """The job's sequence, or its output where it is answered without generating."""
        ...

    def kv_tokens(self, seq: Sequence) -> int: ...

    def output(self, seq: Sequence) -> dict[str, Any]: ...


@dataclass
class _Running:
    item: WorkItem
    seq: Sequence
    slot: KVSlot
    started: float


@dataclass(frozen=True)
class TextMemory:
    """What the text branch draws on besides its KV rows: the ledger, for the prefill's
    activations (`prefill_bytes`, 0 where they are inside the model's footprint)."""

    ledger: MemoryLedger
    model: str
    memory_wait_s: float
    prefill_bytes: int = 0


class TextWorker(Worker):
    def __init__(
        self,
        name: str,
        queue: PriorityDeadlineQueue,
        task: SequenceRunner,
        batcher: ContinuousBatcher,
        memory: TextMemory,
        complete: Completion,
        answers: Mapping[str, Callable[[WorkItem], dict[str, Any]]] | None = None,
    ) -> None:
        """`answers`: tasks of this queue answered in one call, no sequence (an embed
        job), by task name."""
        super().__init__(name, queue, complete)
        self.batcher = batcher
        self._answers = dict(answers or {})
        self._prepare = task.prepare
        self._ready = task.ready
        self._output = task.output
        self._kv_tokens = task.kv_tokens
        self._memory = memory
        self._running: dict[int, _Running] = {}  # id(sequence) ->
        self.paused = 0
        self.over_budget = 0
        self.stopped = 0
        # Stop requests from other threads (stop_running), taken before each decode step.
        self._stop_lock = threading.Lock()
        self._stops: dict[str, tuple[Callable[[WorkItem], bool], str]] = {}

    def stop_running(self, job_id: str, allowed: Callable[[WorkItem], bool], why: str) -> bool:
        """Job `job_id`, if it is decoding here and `allowed`, is ended before the next
        decode step and answered `cancelled` (`why`): its row given back, its tokens
        dropped. A request for a job not running then is dropped (a queued job is
        withdrawn from the queue instead, by the intake)."""
        with self._stop_lock:
            self._stops[job_id] = (allowed, why)
        return True

    def _apply_stops(self) -> None:
        with self._stop_lock:
            stops, self._stops = self._stops, {}
        if not stops:
            return
        for run in list(self._running.values()):
            stop = stops.get(run.item.job.id)
            if stop is None or not stop[0](run.item) or run.seq not in self.batcher.running:
                continue
            del self._running[id(run.seq)]
            self.batcher.pause(run.seq, keep=False)
            self.batcher.kv.free(run.slot)
            self.stopped += 1
            logger.info(
                "stopped job %s after %d tokens: %s", run.item.job.id, len(run.seq.tokens), stop[1],
                extra=job_fields(run.item.job.id, "qa"),
            )  # fmt: skip
            error = JobError(ErrorCode.CANCELLED, stop[1])
            self._deliver(run.item, Outcome(None, error, run.started, time.monotonic()))

    def _run(self) -> None:
        while not self._stop.is_set() or self.batcher.running:
            self.last_progress = time.monotonic()
            if not self._stop.is_set():
                self._admit()
            self._apply_stops()
            if not self.batcher.running:
                if self._stop.is_set():
                    break
                self._wait_for_work()
                continue
            self.running_since = time.monotonic()
            try:
                done = self.batcher.step()
            except Exception as err:  # a model bug costs the sequences in this step, not the worker
                logger.exception("decode step failed on %s", self.name)
                self._fail_running(internal_error(err))
                done = []
            finally:
                self.running_since = None
            self.batch_sizes = dict(self.batcher.batch_sizes)
            for seq in done:
                self._finish(seq)

    def _wait_for_work(self) -> None:
        item = self.queue.get(timeout=0.2)
        if item is not None:
            self._try_admit(item)

    def _admit(self) -> None:
        while True:
            item = self.queue.get(timeout=0)
            if item is None:
                return
            if not self._try_admit(item):
                # The most urgent job waits for memory; jobs answered in one call need
                # none (no KV row): they do not wait behind it.
                for quick in self.queue.take_matching(lambda i: i.job.task in self._answers, ADMIT_QUICK):
                    self._try_admit(quick)
                return

    def set_memory_wait(self, seconds: float) -> None:
        """How long a job may wait for memory from now on (a reload)."""
        self._memory = dataclasses.replace(self._memory, memory_wait_s=seconds)

    def _try_admit(self, item: WorkItem) -> bool:
        """Admit the job, or answer it (an error), and return True; or put it back in the
        queue to wait for memory and return False."""
        now = time.monotonic()
        # A paused job already ran once: its deadline was met, it finishes.
        resumed = isinstance(item.progress, Sequence) and item.progress.pauses > 0
        if item.expired(now) and not resumed:
            error = self._over_budget(item, now) if item.waiting_since is not None else expired_error(item, now)
            self._answer_now(item, error)
            return True
        answer = self._answers.get(item.job.task)
        if answer is not None:
            self._answer_whole(item, answer, now)
            return True
        seq = item.progress
        if not isinstance(seq, Sequence):
            # Slow work of the job's own (a schema to compile) is done off this thread: the
            # job goes back to the queue (behind others of its priority and deadline) while
            # the running sequences decode; with none running, a short wait here, not a spin.
            try:
                ready = self._ready(item, 0.0 if self.batcher.running else READY_WAIT_S)
            except Exception:  # prepare meets the same fault and answers it: the job is not lost
                logger.exception("could not tell whether job %s is ready", item.job.id)
                ready = True
            if not ready:
                self.queue.put(item, force=True)
                return False
            try:
                seq = self._prepare(item)
            except JobError as err:
                self._answer_now(item, err)
                return True
            except Exception as err:
                logger.exception(
                    "could not prepare job %s", item.job.id, extra=job_fields(item.job.id, "qa", "internal")
                )
                self._answer_now(item, internal_error(err))
                return True
            if not isinstance(seq, Sequence):  # answered without generating (an abstention)
                self._take([item])
                self._deliver(item, Outcome(seq, None, now, time.monotonic()))
                return True
        mem = self._memory
        kv = self.batcher.kv
        tokens = self._kv_tokens(seq)
        while True:
            slot = kv.allocate_slots(item.job.id, tokens)
            if slot is not None:
                if self._start(item, seq, slot, now):
                    return True
                kv.free(slot)  # the prefill's activations do not fit now: wait like for KV
            if item.waiting_since is None:
                item.waiting_since = now
            if now - item.waiting_since < mem.memory_wait_s or not self._pause_one_below(item):
                break
        item.progress = seq
        self.queue.put(item, force=True)
        return False

    def _answer_whole(self, item: WorkItem, answer: Callable[[WorkItem], dict[str, Any]], started: float) -> None:
        """A job answered in one call between decode steps (no sequence, no KV row); its
        failure is its own."""
        self._take([item])
        self.running_since = time.monotonic()
        try:
            outcome = Outcome(answer(item), None, started, time.monotonic())
        except JobError as err:
            outcome = Outcome(None, err, started, time.monotonic())
        except Exception as err:
            task = item.job.task
            logger.exception("job %s failed", item.job.id, extra=job_fields(item.job.id, task, "internal"))
            outcome = Outcome(None, internal_error(err), started, time.monotonic())
        finally:
            self.running_since = None
        self._deliver(item, outcome)

    def _start(self, item: WorkItem, seq: Sequence, slot: KVSlot, attempt: float) -> bool:
        """Prefill the job into its row; False (nothing changed) if the ledger cannot
        hold the prefill's activations now. `attempt`: when this admission attempt took
        the job from the queue (before its prompt was tokenized, where it was now)."""
        mem = self._memory
        res = None
        if mem.prefill_bytes:
            res = mem.ledger.reserve(item.job.id, item.job.task, mem.prefill_bytes, mem.model)
            if res is None:
                return False
        item.waiting_since = None
        item.progress = None
        self._take([item])
        try:
            self.batcher.admit(seq, slot)
        except JobError as err:  # what the sequence makes once admitted (an image's rows) failed: its own fault
            self.batcher.kv.free(slot)
            fields = job_fields(item.job.id, "qa", err.code.value)
            logger.info("job %s failed at admission: %s", item.job.id, err.message, extra=fields)
            now = time.monotonic()
            self._deliver(item, Outcome(None, err, now, now))
            return True
        except Exception as err:
            self.batcher.kv.free(slot)
            logger.exception("could not start job %s", item.job.id, extra=job_fields(item.job.id, "qa", "internal"))
            now = time.monotonic()
            failed = internal_error(err)
            self._deliver(item, Outcome(None, failed, now, now))
            return True
        finally:
            if res is not None:
                mem.ledger.release(res)
        # Its run began at its first admission: a paused job's wait and its prefill again
        # are part of its run, as its stages count them.
        if item.started_at is None:
            item.started_at = attempt
        self._running[id(seq)] = _Running(item, seq, slot, item.started_at)
        return True

    def _pause_one_below(self, item: WorkItem) -> bool:
        """Pause the least urgent running sequence of lower priority than `item` (a
        larger number). Deadlines order the queue but never preempt: a sequence of the
        same priority runs to its end."""

        def urgency(run: _Running) -> tuple[int, float]:
            deadline = run.item.deadline_at if run.item.deadline_at is not None else math.inf
            return (run.item.job.priority, deadline)

        lower = [(seq, run) for seq in self.batcher.running if (run := self._running[id(seq)])]
        lower = [(s, r) for s, r in lower if r.item.job.priority > item.job.priority]
        if not lower:
            return False
        seq, run = max(lower, key=lambda pair: urgency(pair[1]))
        self.batcher.pause(seq)
        self.batcher.kv.free(run.slot)
        del self._running[id(seq)]
        with self._hand_lock:
            self._in_hand = [held for held in self._in_hand if held is not run.item]
        run.item.progress = seq
        self.queue.put(run.item, force=True)
        self.paused += 1
        logger.info(
            "paused job %s (priority %d, %d tokens so far) for job %s (priority %d)",
            run.item.job.id,
            run.item.job.priority,
            len(seq.tokens),
            item.job.id,
            item.job.priority,
        )
        return True

    def _over_budget(self, item: WorkItem, now: float) -> JobError:
        self.over_budget += 1
        kv = self.batcher.kv
        seq = item.progress
        need = self._kv_tokens(seq) * kv.bytes_per_token if isinstance(seq, Sequence) else 0
        free = (kv.capacity_tokens - kv.reserved_tokens()) * kv.bytes_per_token
        return JobError(
            ErrorCode.OVER_BUDGET,
            f"deadline passed waiting for memory: needs {need} bytes of KV, {free} of "
            f"{kv.capacity_bytes} free, {kv.rows_free} of {kv.rows} sequence rows free, "
            f"after {(now - item.received_at) * 1000:.0f} ms",
            "deadline_ms",
        )

    def _finish(self, seq: Sequence) -> None:
        run = self._running.pop(id(seq))
        self.batcher.kv.free(run.slot)
        seq.kv = None
        if seq.error is not None:  # this sequence's state failed, in a batch that went on
            logger.error(
                "job %s failed: %s", run.item.job.id, seq.error, extra=job_fields(run.item.job.id, "qa", "internal")
            )
            failed = JobError(ErrorCode.INTERNAL, f"the answer's generation failed: {seq.error}")
            self._deliver(run.item, Outcome(None, failed, run.started, time.monotonic()))
            return
        try:
            output = self._output(seq)
            outcome = Outcome(output, None, run.started, time.monotonic())
        except Exception as err:
            logger.exception(
                "could not finish job %s", run.item.job.id, extra=job_fields(run.item.job.id, "qa", "internal")
            )
            failed = internal_error(err)
            outcome = Outcome(None, failed, run.started, time.monotonic())
        self._deliver(run.item, outcome)

    def _fail_running(self, error: JobError) -> None:
        """A step failed: sequences that had already finished in it are answered as
        usual; the ones still decoding get `error` (their rows given back)."""
        for run in list(self._running.values()):
            if run.seq.finish is not None and run.seq not in self.batcher.running:
                self._finish(run.seq)
                continue
            del self._running[id(run.seq)]
            if run.seq in self.batcher.running:
                self.batcher.pause(run.seq, keep=False)
            self.batcher.kv.free(run.slot)
            self._deliver(run.item, Outcome(None, error, run.started, time.monotonic()))
