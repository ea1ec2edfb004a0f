"""Which Response Topics a job may name.

A result is published to the topic the requester names. A topic the broker would refuse
for publishing (empty, a wildcard, a `$` topic, too long, a NUL) must be refused when the
job arrives, with an error the requester can see on the device's results topic: found
only when the result is published, it would fail the job after its work was done (and,
journalled, again at every start). A topic inside this device's own namespace (its job
topics, its availability topic) or any other box's job topic would let a requester make
the box publish where it must not; those are refused too. The device's results topic and
the levels below it are the one part of its namespace results may go to.
"""

from __future__ import annotations

import logging

from edge.protocol.errors import ErrorCode, JobError

logger = logging.getLogger(__name__)

MAX_TOPIC_BYTES = 65535  # MQTT's limit for a UTF-8 string
FIELD = "response_topic"


def reply_topic_error(topic: str, device_namespace: str, results_topic: str) -> JobError | None:
    """Why results cannot go to `topic`, or None if they can."""

    def refused(why: str) -> JobError:
        return JobError(ErrorCode.INVALID_FIELD, f"Response Topic {why}", FIELD)

    if not topic:
        return refused("is empty")
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        return refused("is not valid UTF-8")
    if size > MAX_TOPIC_BYTES:
        return refused(f"is {size} bytes, over MQTT's {MAX_TOPIC_BYTES}")
    if "\x00" in topic:
        return refused("contains a NUL character")
    if "+" in topic or "#" in topic:
        return refused("contains a wildcard (+ or #): results go to one topic")
    if topic.startswith("$"):
        return refused("starts with '$': those topics are the broker's")
    if topic == results_topic or topic.startswith(results_topic + "/"):
        return None
    if topic == device_namespace or topic.startswith(device_namespace + "/"):
        return refused(f"is inside this device's own topics ({device_namespace}/...)")
    if "jobs" in topic.split("/"):
        return refused("is a job topic: results never go to job topics")
    return None
