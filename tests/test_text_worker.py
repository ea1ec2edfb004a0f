"""The text branch's worker on the real SmolLM2 weights, with real ledger and queue
objects (no broker, no GPU): continuous batching, pausing a lower-priority sequence for an
urgent one, over_budget when a deadline passes waiting for KV, the pool never exceeded."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edge.config.text import QAModelConfig
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import EmbedJob, ParsedJob, QAJob
from edge.scheduler.branch import Outcome
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.text_worker import TextMemory, TextWorker
from edge.scheduler.work import Reply, WorkItem
from edge.tasks import qa
from edge.tasks.qa import QATask
from edge.text.engine import TextEngine
from edge.text.model.checkpoint import load_checkpoint
from engines.text.import_gguf import import_smollm2
from tests import fakes


def _engine(engine_dir: Path, sequences: int) -> TextEngine:
    ckpt = load_checkpoint(import_smollm2(engine_dir, progress=False))
    return TextEngine(
        ckpt,
        QAModelConfig(
            max_context_tokens=192, max_new_tokens=16, max_sequences=sequences, kv_offload="off", prefix_cache_mib=0
        ),
    )


def _item(job_id: str, question: str, priority: int = 5, new: int = 16, deadline_ms: int | None = None) -> WorkItem:
    job = ParsedJob(job_id, "qa", priority, deadline_ms, QAJob(id=job_id, question=question, max_new_tokens=new))
    received = time.monotonic()
    return WorkItem(job, Reply("r"), received, received + deadline_ms / 1000 if deadline_ms else None)


def _ledger(engine: TextEngine) -> MemoryLedger:
    ledger = MemoryLedger(2**34)
    assert ledger.add_model("llm", "text", engine.kv_cache_bytes)
    return ledger


def _wait_decoding(engine: TextEngine, tokens: int) -> None:
    """Until the engine's first running sequence has `tokens` tokens."""
    deadline = time.monotonic() + 30
    while not (engine.batcher.running and len(engine.batcher.running[0].tokens) >= tokens):
        assert time.monotonic() < deadline
        time.sleep(0.005)


@dataclass
class _Outcomes:
    """The worker's outcomes by job id (`complete` is its completion), and a condition
    to wait on them."""

    got: dict[str, Outcome] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def complete(self, item: WorkItem, outcome: Outcome) -> None:
        with self.cond:
            self.got[item.job.id] = outcome
            self.cond.notify_all()


@dataclass
class Harness:
    engine: TextEngine
    ledger: MemoryLedger
    queue: PriorityDeadlineQueue
    worker: TextWorker
    done: _Outcomes

    @property
    def outcomes(self) -> dict[str, Outcome]:
        return self.done.got

    def wait(self, count: int, timeout: float = 120) -> None:
        with self.done.cond:
            assert self.done.cond.wait_for(lambda: len(self.outcomes) >= count, timeout), self.outcomes.keys()


@pytest.fixture
def harness(request: pytest.FixtureRequest, engine_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    sequences, wait_s = request.param
    engine = _engine(engine_dir, sequences)
    ledger = MemoryLedger(2**34)
    assert ledger.add_model("llm", "text", engine.kv_cache_bytes)
    queue = PriorityDeadlineQueue(64)
    done = _Outcomes()
    memory = TextMemory(ledger, "llm", wait_s)
    task = QATask(engine, fakes.responder(tmp_path)[0])
    worker = TextWorker("text", queue, task, engine.batcher, memory, done.complete)
    h = Harness(engine, ledger, queue, worker, done)
    yield h
    worker.stop(30)


def _alone(engine: TextEngine, question: str, new: int) -> str:
    return str(qa.answer(engine, QAJob(id="ref", question=question, max_new_tokens=new))["answer"])


@pytest.mark.parametrize("harness", [(1, 0.05)], indirect=True)
def test_an_urgent_job_pauses_a_lower_priority_one(harness: Harness) -> None:
    h = harness
    low_q, urgent_q = "List the bones of the human arm.", "Is 38.5 C a fever?"
    low_ref, urgent_ref = _alone(h.engine, low_q, 40), _alone(h.engine, urgent_q, 8)
    h.worker.start()
    h.queue.put(_item("low", low_q, priority=8, new=40))
    _wait_decoding(h.engine, 3)
    h.queue.put(_item("urgent", urgent_q, priority=0, new=8))
    h.wait(2)
    low, urgent = h.outcomes["low"], h.outcomes["urgent"]
    assert urgent.error is None and low.error is None
    assert urgent.finished_at < low.finished_at, "the urgent job waited for the long one"
    assert h.worker.paused == 1
    # Paused and resumed (its KV recomputed), the low job still says what it says alone.
    assert low.output is not None and low.output["answer"] == low_ref
    assert urgent.output is not None and urgent.output["answer"] == urgent_ref
    snap = h.engine.batcher.kv.snapshot()
    assert snap["reserved_tokens"] == 0 and snap["rows_free"] == 1 and snap["peak_tokens"] <= snap["row_tokens"]


@pytest.mark.parametrize("harness", [(1, 0.01)], indirect=True)
def test_over_budget_when_the_deadline_passes_waiting_for_kv(harness: Harness) -> None:
    h = harness
    h.worker.start()
    h.queue.put(_item("long", "Count from 1 to 200, separated by commas.", priority=5, new=120))
    while not h.engine.batcher.running:
        time.sleep(0.005)
    # Same priority: nothing may be paused for it, so it waits, and its deadline passes.
    h.queue.put(_item("late", "Hello?", priority=5, new=4, deadline_ms=400))
    h.wait(2)
    late = h.outcomes["late"]
    assert late.error is not None and late.error.code == ErrorCode.OVER_BUDGET
    assert "bytes of KV" in late.error.message and "sequence rows free" in late.error.message
    assert h.outcomes["long"].error is None and h.worker.paused == 0
    assert h.outcomes["long"].finished_at > late.finished_at, "the long job ended first: nothing was tested"


@pytest.mark.parametrize("harness", [(3, 0.02)], indirect=True)
def test_mixed_jobs_all_finish_within_the_pool(harness: Harness) -> None:
    h = harness
    rng = random.Random(7)
    questions = ["What is insulin?", "Name a vitamin.", "What does a nurse do?", "Why sleep?"]
    items = [
        _item(f"m{i}", rng.choice(questions), priority=rng.randrange(10), new=rng.randrange(2, 20)) for i in range(24)
    ]
    h.worker.start()
    for item in items:
        h.queue.put(item)
        time.sleep(rng.random() * 0.02)
    h.wait(len(items))
    assert all(o.error is None and o.output is not None for o in h.outcomes.values())
    assert max(h.worker.batch_sizes) >= 2  # sequences really decoded together
    snap = h.engine.batcher.kv.snapshot()
    assert snap["reserved_bytes"] == 0 and 0 < snap["peak_bytes"] <= snap["capacity_bytes"]
    assert snap["rows_free"] == 3 and snap["peak_rows"] >= 2  # several rows held at once


def test_jobs_answered_in_one_call_run_between_decode_steps_and_fail_alone(engine_dir: Path, tmp_path: Path) -> None:
    """An `embed` job's kind (answers=): taken from the same queue, answered between the
    decode steps of a running sequence, which goes on undisturbed, and not held behind a
    question waiting for a KV row; a failure (a JobError, or anything else: `internal`)
    is that job's alone."""
    engine = _engine(engine_dir, 1)
    ledger, queue = _ledger(engine), PriorityDeadlineQueue(64)
    done = _Outcomes()
    outcomes, cond, complete = done.got, done.cond, done.complete

    decoding: list[int] = []

    def answer(item: WorkItem) -> dict[str, object]:
        job = item.job.request
        assert isinstance(job, EmbedJob)
        decoding.append(len(engine.batcher.running))
        if job.input[0] == "boom":
            raise RuntimeError("the encoder broke")
        if job.input[0] == "gone":
            raise JobError(ErrorCode.UNAVAILABLE, "no encoder here", "task")
        return {"texts": len(job.input)}

    task = QATask(engine, fakes.responder(tmp_path)[0])
    worker = TextWorker(
        "text", queue, task, engine.batcher, TextMemory(ledger, "llm", 0.05), complete, {"embed": answer}
    )
    question = "Count from 1 to 200, separated by commas."
    reference = _alone(engine, question, 60)
    worker.start()
    try:
        queue.put(_item("long", question, new=60))
        _wait_decoding(engine, 3)
        # A question that waits for the one KV row, ahead of them in the queue: they need
        # no row, and do not wait behind it.
        queue.put(_item("waiter", "Hello?", new=4))
        time.sleep(0.2)
        for name, texts in (("ok", ["a pump", "a dressing"]), ("boom", ["boom"]), ("gone", ["gone"])):
            job = ParsedJob(name, "embed", 6, None, EmbedJob(id=name, input=texts))
            queue.put(WorkItem(job, Reply("r"), time.monotonic(), None))
        with cond:
            assert cond.wait_for(lambda: len(outcomes) == 5, 120), outcomes.keys()
    finally:
        worker.stop(30)
    assert outcomes["ok"].output == {"texts": 2} and outcomes["ok"].error is None
    boom, gone = outcomes["boom"].error, outcomes["gone"].error
    assert boom is not None and boom.code == ErrorCode.INTERNAL
    assert gone is not None and gone.code == ErrorCode.UNAVAILABLE and gone.field == "task"
    assert decoding == [1, 1, 1]  # each answered while the long sequence was decoding
    long = outcomes["long"]
    assert long.error is None and long.output is not None and long.output["answer"] == reference
    assert outcomes["ok"].finished_at < long.finished_at < outcomes["waiter"].finished_at


def test_a_schema_compiles_off_the_worker_thread_while_the_running_sequence_decodes(
    engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A qa job with a schema new to the box waits in the queue while its grammar compiles
    on the grammar engine's thread (here held up until the running sequence is done:
    the real compile, started late), and the running sequence decodes to its end
    meanwhile; then the job is admitted and answers JSON valid for its schema. Compiled
    on the worker's thread, the running sequence would stop until the compile ended."""
    from edge.protocol.jobs import ResponseFormat
    from edge.text.runtime import grammar

    engine = _engine(engine_dir, 2)
    ledger, queue = _ledger(engine), PriorityDeadlineQueue(64)
    done = _Outcomes()
    outcomes, cond, complete = done.got, done.cond, done.complete

    release = threading.Event()
    compiling: list[str] = []
    real_compile = grammar.Grammars._compile

    def held_compile(self: grammar.Grammars, text: str) -> object:
        compiling.append(threading.current_thread().name)
        assert release.wait(120)
        return real_compile(self, text)

    monkeypatch.setattr(grammar.Grammars, "_compile", held_compile)
    task = QATask(engine, fakes.responder(tmp_path)[0])
    worker = TextWorker("text", queue, task, engine.batcher, TextMemory(ledger, "llm", 0.05), complete)
    question = "Count from 1 to 200, separated by commas."
    reference = _alone(engine, question, 40)
    schema = {"type": "object", "properties": {"serial": {"type": "string", "maxLength": 12}}, "required": ["serial"]}
    fmt = ResponseFormat.model_validate({"type": "json_schema", "schema": schema})
    structured = QAJob(id="json", question="Give the serial of part AX-991 as JSON.", max_new_tokens=24)
    structured = structured.model_copy(update={"response_format": fmt})
    worker.start()
    try:
        queue.put(_item("long", question, new=40))
        _wait_decoding(engine, 2)
        queue.put(WorkItem(ParsedJob("json", "qa", 5, None, structured), Reply("r"), time.monotonic(), None))
        deadline = time.monotonic() + 30
        while not compiling:  # its compile begun (and held) while "long" decodes
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with cond:
            assert cond.wait_for(lambda: "long" in outcomes, 120), "the running sequence waited for the compile"
        assert "json" not in outcomes and compiling[0].startswith("grammar")
        release.set()
        with cond:
            assert cond.wait_for(lambda: "json" in outcomes, 120)
    finally:
        release.set()
        worker.stop(30)
    long = outcomes["long"]
    assert long.error is None and long.output is not None and long.output["answer"] == reference
    answer = outcomes["json"]
    assert answer.error is None and answer.output is not None, answer.error
    assert isinstance(answer.output["json"], dict) and isinstance(answer.output["json"]["serial"], str)
