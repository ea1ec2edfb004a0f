"""What the broker link hands the rest of the daemon, and what it takes back: plain
types, so intake and the responder can be built and tested without a broker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class IncomingJob:
    topic: str
    payload: bytes
    response_topic: str | None
    correlation: bytes | None
    retained: bool = False  # delivered as the topic's retained message (at subscribe)
    traceparent: str | None = None  # the requester's W3C trace context (an MQTT v5 user property)
    # The requester asks to hear when the job is journalled (user property notify=accepted).
    notify_accepted: bool = False
    # The broker's DUP flag: this copy is a redelivery of one it sent us before.
    redelivered: bool = False
    # Submitted inside this process (the HTTP API): response_topic is a `$local/` topic
    # (edge/comms/local.py), not an MQTT one, and nothing is acknowledged to a broker.
    local: bool = False


# MQTT v5 user property a requester sets on a job to get an `accepted` notice for it.
NOTIFY_PROPERTY = "notify"
NOTIFY_ACCEPTED = "accepted"


# Returns whether the job is kept (acknowledge it to the broker) or left with the broker.
IntakeCallback = Callable[[IncomingJob], bool]
# The same for messages taken together, one answer per message in order.
BatchIntakeCallback = Callable[[list[IncomingJob]], list[bool]]
DeliveredCallback = Callable[[str], None]


class Publisher(Protocol):
    """Publishes at QoS 1; with a job id, the broker's PUBACK is reported for that id.
    False if the message could not be published at all (a topic no broker accepts)."""

    def publish(self, topic: str, payload: bytes, correlation: bytes | None, job_id: str | None = None) -> bool: ...
