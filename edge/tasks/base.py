"""The interfaces the branch workers call.

The vision branch runs batches: a `BatchTask` takes the jobs the worker's dynamic batcher
gathered for it (up to its policy's size; OCR takes one at a time) and returns one
output or one error per job, in order, so a bad image fails its own job and not the
batch. The text branch decodes continuously: a `SequenceTask` turns a job into a
sequence the batcher steps (all checks done), says how much KV it may occupy, and makes
the output once it finishes.
"""

from __future__ import annotations

from typing import Any, Protocol

from edge.protocol.errors import JobError
from edge.scheduler.queue import BatchPolicy
from edge.scheduler.work import WorkItem
from edge.text.continuous import Sequence

Output = dict[str, Any]


class BatchTask(Protocol):
    name: str
    policy: BatchPolicy

    def run(self, items: list[WorkItem]) -> list[Output | JobError]: ...


class SequenceTask(Protocol):
    name: str

    def prepare(self, item: WorkItem) -> Sequence: ...

    def kv_tokens(self, seq: Sequence) -> int: ...

    def output(self, seq: Sequence) -> Output: ...
