"""Intake, responder and pipeline in-process: a fake link instead of the broker, a real
journal, real queues and workers. (The same paths through a real Mosquitto are in
tests/test_integration.py and tests/test_durability.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from edge.comms.local import LocalDeliveries
from edge.comms.message import IncomingJob
from edge.config.profile import Profile
from edge.config.service import PathsConfig
from edge.intake import Intake
from edge.journal.store import ANSWERED, QUEUED, SENT, Journal
from edge.protocol.errors import ErrorCode, JobError
from edge.responder import Responder
from edge.scheduler.branch import BranchWorker, Outcome
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.work import WorkItem
from edge.stats import JobStats
from edge.tasks.pipeline import Pipeline, context_of
from tests import fakes


def _profile(tmp_path: Path) -> Profile:
    return Profile(device_id="u1", paths=PathsConfig(state_dir=tmp_path, runtime_dir=tmp_path, engine_dir=tmp_path))


def _msg(task: str, payload: dict[str, Any] | bytes, corr: bytes = b"c1") -> IncomingJob:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return IncomingJob(f"edge/u1/jobs/{task}", body, "req/replies", corr)


def test_a_job_is_journalled_queued_answered_and_marked(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    assert intake(_msg("ocr", {"id": "j1", "image": {"path": "labels/label_00.png"}}))
    entry = journal.lookup("j1")
    assert entry is not None and entry.state == QUEUED  # on disk before the broker hears of it
    item = queues["vision"].get(timeout=1)
    assert item is not None and item.reply.topic == "req/replies" and item.reply.correlation == b"c1"
    responder.finish(item, Outcome({"text": "SN-1"}, None, time.monotonic(), time.monotonic()))
    (sent,) = link.sent
    assert sent.topic == "req/replies" and sent.correlation == b"c1" and sent.job_id == "j1"
    assert sent.doc["status"] == "ok" and sent.doc["output"] == {"text": "SN-1"} and sent.doc["device"] == "u1"
    entry = journal.lookup("j1")
    assert entry is not None and entry.state == SENT and entry.result == sent.payload
    link.puback_all()
    entry = journal.lookup("j1")
    assert entry is not None and entry.state == ANSWERED
    assert responder.stats.snapshot()["ok_by_task"] == {"ocr": 1}


@pytest.mark.parametrize(
    ("task", "payload", "code", "field"),
    [
        ("ocr", b"{not json", "bad_json", None),
        ("ocr", {"id": "x"}, "missing_field", "image"),
        ("qa", {"id": "x", "question": "hi", "max_new_tokens": "5"}, "invalid_field", "max_new_tokens"),
        ("qa", {"id": "x", "question": "hi"}, "unavailable", "task"),  # no text branch here
        ("bogus", {"id": "x"}, "unknown_task", "task"),
    ],
)
def test_bad_input_gets_one_error_naming_the_field(
    tmp_path: Path, task: str, payload: dict[str, Any] | bytes, code: str, field: str | None
) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    assert intake(_msg(task, payload))  # answered, so acknowledged to the broker
    (sent,) = link.sent
    assert sent.doc["status"] == "error" and sent.doc["error"]["code"] == code
    assert sent.doc["error"]["field"] == field
    assert len(queues["vision"]) == 0


def test_a_repeated_id_is_answered_from_the_journal_byte_for_byte(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    job = {"id": "same", "image": {"path": "labels/label_00.png"}}
    intake(_msg("ocr", job))
    item = queues["vision"].get(timeout=1)
    assert item is not None
    responder.finish(item, Outcome({"text": "A"}, None, time.monotonic(), time.monotonic()))
    intake(_msg("ocr", job, corr=b"c2"))  # a requester resending
    assert len(queues["vision"]) == 0 and intake.duplicates == 1
    first, again = link.sent
    assert again.payload == first.payload and again.correlation == b"c2"


def test_start_takes_up_the_journal(tmp_path: Path) -> None:
    """What a restart finds: a stored result not confirmed is sent again as stored; a job
    without a result is queued again with its age."""
    responder, link, journal = fakes.responder(tmp_path, "u1")
    journal.accept("done", "edge/u1/jobs/ocr", b"{}", "r", b"c")
    journal.store_result("done", "r", b"c", b"stored-bytes")
    todo = json.dumps({"id": "todo", "image": {"path": "a.png"}}).encode()
    journal.accept("todo", "edge/u1/jobs/ocr", todo, "r", None)
    queues = {"vision": PriorityDeadlineQueue(8)}
    counts = Intake(_profile(tmp_path), queues, responder, journal).replay()
    assert counts == {"jobs": 1, "results": 1, "given_up": 0, "refused": 0}
    assert [(m.payload, m.job_id) for m in link.sent] == [(b"stored-bytes", "done")]
    item = queues["vision"].get(timeout=1)
    assert item is not None and item.job.id == "todo"


class _Stub:
    """A stand-in vision task for the worker's own logic (its real tasks are tested in
    tests/test_tasks.py): answers each job with its id, fails jobs named 'bad'."""

    name = "inspect"
    policy = BatchPolicy(max_batch=4, max_delay_s=0.05)

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, items: list[WorkItem]) -> list[dict[str, Any] | JobError]:
        self.batches.append(len(items))
        out: list[dict[str, Any] | JobError] = []
        for it in items:
            if it.job.id == "bad":
                out.append(JobError(ErrorCode.IMAGE_INVALID, "not an image", "image.data"))
            else:
                out.append({"class": "clean", "score": 0.9, "defect_score": 0.1, "id": it.job.id})
        return out


def test_a_pipeline_job_goes_on_to_the_text_queue_and_is_answered_once(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(8), "text": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    pipeline = Pipeline(responder, queues)
    stub = _Stub()
    worker = BranchWorker("vision", queues["vision"], {"inspect": stub}, pipeline.complete)
    intake(_msg("inspect", {"id": "p1", "image": {"path": "x.png"}, "ask": {"question": "Rework note?"}}, b"cp"))
    intake(_msg("inspect", {"id": "plain", "image": {"path": "x.png"}}, b"cq"))
    intake(_msg("inspect", {"id": "bad", "image": {"path": "x.png"}}, b"cr"))
    worker.start()
    try:
        link.wait_for(2)
        stage = queues["text"].get(timeout=5)
    finally:
        worker.stop(5)
    assert stub.batches == [3]  # one batch for the three
    by_id = {m.doc["id"]: m.doc for m in link.sent}
    assert set(by_id) == {"plain", "bad"}  # p1 is not answered until its text stage is
    assert by_id["bad"]["error"] == {"code": "image_invalid", "message": "not an image", "field": "image.data"}
    assert stage is not None and stage.job.task == "qa" and stage.carry is not None
    inspected = stage.carry["output"]
    assert stage.job.request.context == context_of(inspected, False)  # type: ignore[attr-defined]
    now = time.monotonic()
    pipeline.complete(stage, Outcome({"answer": "Replace the label."}, None, now, now))
    final = link.sent[-1].doc
    assert final["id"] == "p1" and final["task"] == "inspect" and final["status"] == "ok"
    assert final["output"]["class"] == "clean" and final["output"]["answer"] == {"answer": "Replace the label."}
    assert link.sent[-1].correlation == b"cp"


def test_messages_taken_together_are_journalled_in_one_commit_before_any_is_queued(tmp_path: Path) -> None:
    """A burst: the jobs among it cost one journal commit. A repeat of an id in the same
    burst and a cancel of a job in it are judged against the journalled jobs, as they
    would be had the messages come one at a time."""
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(16)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    assert journal._db is not None
    statements: list[str] = []
    journal._db.set_trace_callback(statements.append)
    burst = [_msg("ocr", {"id": f"f{i}", "image": {"path": "x.png"}}, f"c{i}".encode()) for i in range(6)]
    burst.append(_msg("ocr", {"id": "bad"}, b"cb"))  # refused: no image
    assert intake.take_many(burst) == [True] * 7
    assert sum(s == "COMMIT" for s in statements) == 1
    assert [m.doc["error"]["field"] for m in link.sent] == ["image"]
    assert [e.id for e in journal.pending()] == [f"f{i}" for i in range(6)]
    assert [it.job.id for it in queues["vision"].drain()] == [f"f{i}" for i in range(6)]

    statements.clear()
    again = [
        _msg("ocr", {"id": "g0", "image": {"path": "x.png"}}, b"g0"),
        _msg("ocr", {"id": "g0", "image": {"path": "x.png"}}, b"other"),  # the same id, another requester
        _msg("ocr", {"id": "g1", "image": {"path": "x.png"}}, b"g1"),
        _msg("cancel", {"id": "k", "job": "g1"}, b"k"),
    ]
    assert intake.take_many(again) == [True] * 4
    docs = [m.doc for m in link.sent[1:]]
    assert docs[0]["id"] == "g0" and docs[0]["error"]["code"] == "duplicate"
    assert {(d["id"], d["status"]) for d in docs[1:]} == {("g1", "error"), ("k", "ok")}
    assert next(d for d in docs if d["id"] == "k")["output"] == {"job": "g1", "cancelled": True}
    assert [it.job.id for it in queues["vision"].drain()] == ["g0"]


def test_a_stopping_intake_keeps_nothing_of_a_batch(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    intake = Intake(_profile(tmp_path), {"vision": PriorityDeadlineQueue(8)}, responder, journal)
    intake.accepting = False
    assert intake.take_many([_msg("ocr", {"id": "a", "image": {"path": "x.png"}})] * 2) == [False, False]
    assert journal.lookup("a") is None and link.sent == []


def test_the_pump_takes_what_arrived_meanwhile_as_one_batch_and_acks_in_order() -> None:
    """paho's thread only queues; while the intake is busy with one batch, what arrives
    waits and is taken as the next. Messages the intake does not keep are not acked."""
    import threading

    from edge.comms.pump import IntakePump

    busy = threading.Event()
    release = threading.Event()
    batches: list[list[str]] = []
    acks: list[int] = []

    def take(msgs: list[IncomingJob]) -> list[bool]:
        batches.append([m.topic for m in msgs])
        busy.set()
        release.wait(5)
        return [not m.topic.endswith("left") for m in msgs]

    pump = IntakePump(take, lambda mid, qos: acks.append(mid))
    pump.start()
    pump.put(IncomingJob("t/0", b"", None, None), 100, 1)
    assert busy.wait(5)
    for i in range(1, 6):
        pump.put(IncomingJob("t/left" if i == 3 else f"t/{i}", b"", None, None), 100 + i, 1)
    release.set()
    pump.stop()
    assert batches == [["t/0"], ["t/1", "t/2", "t/left", "t/4", "t/5"]]
    assert acks == [100, 101, 102, 104, 105]


def test_every_job_of_a_batch_the_journal_cannot_keep_is_answered_storage_full(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    queues = {"vision": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    journal.close()  # as a journal that could not be opened
    burst = [_msg("ocr", {"id": f"f{i}", "image": {"path": "x.png"}}, f"c{i}".encode()) for i in range(3)]
    assert intake.take_many(burst) == [True] * 3  # answered, so acknowledged
    assert sorted((m.doc["id"], m.doc["error"]["code"]) for m in link.sent) == [
        (f"f{i}", "storage_full") for i in range(3)
    ]
    assert len(queues["vision"]) == 0


def test_a_local_job_is_journalled_and_answered_in_process_never_through_the_broker(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3", 64 * 2**20, 3600.0)
    link = fakes.FakeLink(journal)
    local = LocalDeliveries(on_delivered=journal.mark_answered)
    responder = Responder(link, journal, JobStats(), "u1", local=local)
    queues = {"text": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    got: list[dict[str, Any]] = []
    local.open("$local/h1", lambda payload: got.append(json.loads(payload)))
    body = json.dumps({"id": "h1", "task": "qa", "question": "Hi?"}).encode()
    assert intake(IncomingJob("edge/u1/jobs/qa", body, "$local/h1", None, local=True))
    entry = journal.lookup("h1")
    assert entry is not None and entry.state == QUEUED and entry.reply_topic == "$local/h1"
    item = queues["text"].get(timeout=1)
    assert item is not None
    responder.finish(item, Outcome({"answer": "Hello."}, None, time.monotonic(), time.monotonic()))
    assert [d["status"] for d in got] == ["ok"] and got[0]["output"] == {"answer": "Hello."}
    assert link.sent == []  # nothing went to the broker
    entry = journal.lookup("h1")
    assert entry is not None and entry.state == ANSWERED  # handed over: the local PUBACK
    # A refusal takes the same way back.
    local.open("$local/h2", lambda payload: got.append(json.loads(payload)))
    bad = json.dumps({"id": "h2", "task": "qa", "question": "Hi?", "temperature": "hot"}).encode()
    assert intake(IncomingJob("edge/u1/jobs/qa", bad, "$local/h2", None, local=True))
    assert got[-1]["status"] == "error" and got[-1]["error"]["field"] == "temperature"
    assert link.sent == []


def test_a_broker_message_cannot_name_a_local_reply_topic(tmp_path: Path) -> None:
    responder, link, journal = fakes.responder(tmp_path, "u1")
    intake = Intake(_profile(tmp_path), {"text": PriorityDeadlineQueue(8)}, responder, journal)
    body = json.dumps({"id": "m1", "task": "qa", "question": "Hi?"}).encode()
    # Not marked local: the $ topic is the broker's, refused as any other would be.
    assert intake(IncomingJob("edge/u1/jobs/qa", body, "$local/h1", b"c"))
    (sent,) = link.sent
    assert sent.topic == "edge/u1/results" and sent.doc["error"]["field"] == "response_topic"
    assert journal.lookup("m1") is None


def test_local_jobs_left_in_the_journal_are_taken_up_at_start_and_their_results_handed_over(tmp_path: Path) -> None:
    """After a restart nobody waits on a `$local/` topic: a stored result is handed over
    (marked answered, kept for an Idempotency-Key retry) and an unfinished job runs again."""
    journal = Journal(tmp_path / "journal.sqlite3", 64 * 2**20, 3600.0)
    body = json.dumps({"id": "h1", "task": "qa", "question": "Hi?"}).encode()
    journal.accept_many([("h1", "edge/u1/jobs/qa", body, "$local/h1", None)])
    journal.accept_many([("h2", "edge/u1/jobs/qa", body.replace(b"h1", b"h2"), "$local/h2", None)])
    journal.store_result("h2", "$local/h2", None, b'{"id": "h2", "status": "ok"}')
    link = fakes.FakeLink(journal)
    local = LocalDeliveries(on_delivered=journal.mark_answered)
    responder = Responder(link, journal, JobStats(), "u1", local=local)
    queues = {"text": PriorityDeadlineQueue(8)}
    intake = Intake(_profile(tmp_path), queues, responder, journal)
    assert intake.replay() == {"jobs": 1, "results": 1, "given_up": 0, "refused": 0}
    item = queues["text"].get(timeout=1)
    assert item is not None and item.job.id == "h1" and item.reply.topic == "$local/h1"
    done = journal.lookup("h2")
    assert done is not None and done.state == ANSWERED and done.result is not None
    assert link.sent == []


def _local_intake(tmp_path: Path, size: int = 8) -> tuple[Intake, PriorityDeadlineQueue, list[dict[str, Any]], Any]:
    """An intake with a text queue and an in-process delivery target; what the `$local/`
    topics get is collected, and the link (what the broker would have got) returned."""
    journal = Journal(tmp_path / "journal.sqlite3", 64 * 2**20, 3600.0)
    link = fakes.FakeLink(journal)
    local = LocalDeliveries(on_delivered=journal.mark_answered)
    queue = PriorityDeadlineQueue(size)
    intake = Intake(
        _profile(tmp_path), {"text": queue}, Responder(link, journal, JobStats(), "u1", local=local), journal
    )
    got: list[dict[str, Any]] = []
    local.open("$local/h1", lambda payload: got.append(json.loads(payload)))
    return intake, queue, got, link


def _local(job_id: str, payload: dict[str, Any]) -> IncomingJob:
    task = str(payload.get("task", "qa"))
    return IncomingJob(f"edge/u1/jobs/{task}", json.dumps(payload).encode(), f"$local/{job_id}", None, local=True)


def test_a_local_job_refused_busy_or_cancelled_runs_again_when_sent_again(tmp_path: Path) -> None:
    intake, queue, got, _ = _local_intake(tmp_path, size=1)
    ask = {"id": "h1", "task": "qa", "question": "Hi?"}
    assert intake(_msg("qa", {"id": "m1", "question": "Hi?"}))  # fills the queue
    assert intake(_local("h1", ask))
    assert got[-1]["error"]["code"] == "busy"
    assert queue.get(timeout=1) is not None  # room again
    assert intake(_local("h1", ask))  # the same key again: run, not the stored 429
    assert len(queue) == 1 and len(got) == 1
    assert intake(_local("c1", {"id": "c1", "task": "cancel", "job": "h1"}))
    assert got[-1]["error"]["code"] == "cancelled" and len(queue) == 0
    assert intake(_local("h1", ask))  # and after a withdrawal
    assert len(queue) == 1 and got[-1]["error"]["code"] == "cancelled"
    # A result that is the request's answer still answers a repeat from the journal.
    item = queue.get(timeout=1)
    assert item is not None
    intake._responder.finish(item, Outcome({"answer": "Hello."}, None, time.monotonic(), time.monotonic()))
    assert intake(_local("h1", ask))
    assert got[-1]["status"] == got[-2]["status"] == "ok" and len(queue) == 0


def test_a_cancel_withdraws_only_a_job_of_its_own_path(tmp_path: Path) -> None:
    intake, queue, got, link = _local_intake(tmp_path)
    assert intake(_msg("qa", {"id": "same", "question": "Hi?"}))  # a camera's MQTT job
    assert intake(_local("c1", {"id": "c1", "task": "cancel", "job": "same"}))
    assert len(queue) == 1 and [m.doc["status"] for m in link.sent] == []  # the MQTT job still queued
    # Nor can an HTTP job with that id answer it: it is told the id is in progress elsewhere.
    assert intake(_local("same", {"id": "same", "task": "qa", "question": "Hi?"}))
    assert len(queue) == 1 and link.sent == []
    # The other way round: a broker's cancel does not withdraw an HTTP job.
    assert intake(_local("h1", {"id": "h1", "task": "qa", "question": "Hi?"}))
    assert intake(_msg("cancel", {"id": "c2", "job": "h1"}))
    assert len(queue) == 2 and link.sent[-1].doc["output"] == {"job": "h1", "cancelled": False}
    assert got == []
