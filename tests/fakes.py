"""In-process stand-ins for the broker link: intake, responder and handlers built in a
unit test, with a real journal, and no broker (the integration tests keep the real one)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.journal.store import Journal
from edge.responder import Responder
from edge.stats import JobStats


@dataclass
class Published:
    topic: str
    payload: bytes
    correlation: bytes | None
    job_id: str | None

    @property
    def doc(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.payload)
        return out


@dataclass
class FakeLink:
    """Records what would have gone to the broker; `puback` plays the broker's
    acknowledgement of a result (what marks a job answered in the journal)."""

    journal: Journal | None = None
    sent: list[Published] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def publish(self, topic: str, payload: bytes, correlation: bytes | None, job_id: str | None = None) -> bool:
        with self.cond:
            self.sent.append(Published(topic, payload, correlation, job_id))
            self.cond.notify_all()
        return True

    def puback_all(self) -> None:
        assert self.journal is not None
        for msg in self.sent:
            if msg.job_id is not None:
                self.journal.mark_answered(msg.job_id)

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Published]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.sent) >= count, timeout), [m.doc for m in self.sent]
            return list(self.sent)

    def finals(self) -> list[dict[str, Any]]:
        return [m.doc for m in self.sent if m.doc.get("status") != "partial"]


def responder(tmp_path: Path, device_id: str = "t") -> tuple[Responder, FakeLink, Journal]:
    journal = Journal(tmp_path / "journal.sqlite3", 64 * 2**20, 3600.0)
    link = FakeLink(journal)
    return Responder(link, journal, JobStats(), device_id), link, journal
