"""The requester's side: MQTT v5 jobs with a reply topic of their own, answered once.

`JobClient` sends jobs with ResponseTopic and CorrelationData and resolves each with the
first result carrying its correlation. With `resend_after_s`, a job still unanswered that
long after it was sent is sent again, same id and same correlation: a box that has the job
answers it once (a repeat of a job it finished gets the stored result, byte for byte; a
repeat of one in progress gets nothing more), a box that never had it runs it.

That is how a fleet on one shared job stream loses nothing when a box dies for good.
Mosquitto keeps the jobs the shared subscription had given a dead box in that box's
session until it returns or the session expires, and keeps giving it its share of new
ones meanwhile. So in fleet mode a resend goes not to the stream but straight to a box
that announces itself online on that stream (`<prefix>/<box>/available`, whose notice
names the shared group), one after another; with none known, to the stream again.
Brokers that hand a dead member's jobs to the others (EMQX does, for shared
subscriptions) need the resend only for jobs already running there.

Resending only what a dead box held: in fleet mode each job asks its box for an
`accepted` notice (user property notify=accepted), which the box sends once the job is in
its journal. A job accepted by a box that is online is that box's to answer, however
long its queue: it is not resent (a box working through a burst would otherwise get
its whole queue again every resend period). A job no box has accepted, or one accepted
by a box whose availability went offline, is resent once `resend_after_s` has passed.
And while a box of the stream is offline, new jobs go straight to the online boxes in
turn rather than to the stream, where Mosquitto would queue the dead box's share for it.

What a box holds when it dies is bounded too: in fleet mode `submit` waits while `window`
jobs (16 by default) are unanswered, so a burst of jobs published at once is not split by
the broker into two long queues, one of which dies with its box and must all be resent; the
boxes' own queues stay about a window deep, which keeps them busy.

`request()` is the one-shot form `edgectl submit` uses.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge.comms.message import NOTIFY_ACCEPTED, NOTIFY_PROPERTY
from edge.comms.mqtt import GROUP_PROPERTY, ONLINE, make_client
from edge.config.base import TOPIC_SEGMENT
from edge.config.profile import Profile

logger = logging.getLogger(__name__)

_TICK_S = 0.1
FLEET_WINDOW = 16  # jobs unanswered at once in fleet mode, unless told otherwise


class RequestTimeout(Exception):
    pass


@dataclass
class Pending:
    """One job as the requester sees it: where it went, how often, and its answer."""

    job_id: str
    task: str
    payload: bytes
    correlation: bytes
    topic: str
    sent_at: float = 0.0
    sends: int = 0
    copies: list[bytes] = field(default_factory=list)  # every answer that came, in order
    accepted_by: str | None = None  # the box whose `accepted` notice came last
    answered: threading.Event = field(default_factory=threading.Event)

    @property
    def result(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.copies[0])
        return doc

    def wait(self, timeout: float) -> dict[str, Any]:
        if not self.answered.wait(timeout):
            raise RequestTimeout(f"job {self.job_id!r}: no reply within {timeout:.0f} s (sent {self.sends} times)")
        return self.result


class JobClient:
    """Jobs to one device (`fleet=False`) or to the fleet's shared stream (`fleet=True`),
    resent after `resend_after_s` (None: never) up to `max_sends` sends in all. `window`:
    the most jobs unanswered at once, `submit` waiting for room (0: no limit; None: FLEET_WINDOW
    in fleet mode, no limit otherwise)."""

    def __init__(
        self,
        profile: Profile,
        fleet: bool = False,
        resend_after_s: float | None = None,
        max_sends: int = 10,
        client_id: str | None = None,
        window: int | None = None,
    ) -> None:
        if resend_after_s is not None and resend_after_s <= 0:
            raise ValueError("resend_after_s must be positive")
        if max_sends < 1:
            raise ValueError("max_sends must be at least 1")
        if window is not None and window < 0:
            raise ValueError("window must be 0 (no limit) or more")
        if fleet and profile.topics.shared_group is None:
            raise ValueError("fleet mode sends to a shared job stream: the profile needs topics.shared_group")
        self._profile = profile
        self._fleet = fleet
        self._resend_after_s = resend_after_s
        self._max_sends = max_sends
        self.client_id = client_id or f"edgectl-{uuid.uuid4().hex[:12]}"
        # Outside every device's own topics (the daemon sends results nowhere in there but
        # its results topic), where docs/mosquitto-acl.example lets boxes write replies; under
        # the broker user's own level, which that file lets each requester read.
        user = profile.broker.username
        self.reply_topic = (
            f"replies/{user}/{self.client_id}" if user and TOPIC_SEGMENT.match(user) else f"replies/{self.client_id}"
        )
        self._window = (FLEET_WINDOW if fleet else 0) if window is None else window
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified as jobs are answered
        self._unanswered = 0
        self._pending: dict[bytes, Pending] = {}
        self._online: list[str] = []  # boxes announcing themselves online, in order seen
        self._offline: set[str] = set()  # boxes of our stream whose availability says offline
        self._next_box = 0
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._errors: list[str] = []
        self.resends = 0
        self._client = make_client(self.client_id, profile)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._resender = threading.Thread(target=self._resend_loop, name="resend", daemon=True)

    # lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> JobClient:
        broker = self._profile.broker
        try:
            self._client.connect(broker.host, broker.port, keepalive=broker.keepalive_s)
        except OSError as err:
            raise RequestTimeout(f"cannot reach broker {broker.host}:{broker.port}: {err}") from err
        self._client.loop_start()
        if not self._ready.wait(timeout):
            self.close()
            why = self._errors[0] if self._errors else f"no reply within {timeout:.0f} s (waiting for the broker)"
            raise RequestTimeout(why)
        if self._resend_after_s is not None:
            self._resender.start()
        return self

    def close(self) -> None:
        self._closed.set()
        with self._room:
            self._room.notify_all()
        self._client.disconnect()
        self._client.loop_stop()

    def __enter__(self) -> JobClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # jobs -----------------------------------------------------------------------------

    def submit(self, task: str, job: dict[str, Any]) -> Pending:
        """Send a job (its `id` is given one if it has none), once fewer than `window` are
        unanswered; the answer comes to the returned Pending."""
        job = dict(job)
        job.setdefault("id", uuid.uuid4().hex)
        prefix = self._profile.topics.prefix
        topic = f"{prefix}/jobs/{task}" if self._fleet else self._profile.topic("jobs", task)
        pending = Pending(str(job["id"]), task, json.dumps(job).encode(), uuid.uuid4().bytes, topic)
        with self._room:
            while self._window and self._unanswered >= self._window and not self._closed.is_set():
                self._room.wait(_TICK_S)
            self._unanswered += 1
            self._pending[pending.correlation] = pending
            # A box of the stream is down: Mosquitto would queue its share of the stream
            # for it, so the jobs go to the live boxes themselves until it is back.
            direct = self._fleet and bool(self._offline) and bool(self._online)
            target = self._next_box_topic(task) if direct else topic
        self._send(pending, target)
        return pending

    @property
    def online_boxes(self) -> list[str]:
        with self._lock:
            return list(self._online)

    def _send(self, pending: Pending, topic: str) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = pending.correlation
        if self._fleet:
            props.UserProperty = (NOTIFY_PROPERTY, NOTIFY_ACCEPTED)
        with self._lock:
            pending.sends += 1
            pending.sent_at = time.monotonic()
        self._client.publish(topic, pending.payload, qos=1, properties=props)

    def _next_box_topic(self, task: str) -> str:
        """The job topic of the next online box of the stream, in turn; with the lock held."""
        box = self._online[self._next_box % len(self._online)]
        self._next_box += 1
        return self._profile.topics.prefix + f"/{box}/jobs/{task}"

    def _resend_target(self, pending: Pending) -> str:
        if not self._fleet:
            return pending.topic
        with self._lock:
            if not self._online:
                return pending.topic
            return self._next_box_topic(pending.task)

    def _due(self, pending: Pending, now: float) -> bool:
        """Unanswered, sends left, quiet for the resend period, and no live box holds it;
        with the lock held."""
        assert self._resend_after_s is not None
        if pending.answered.is_set() or pending.sends >= self._max_sends:
            return False
        if now - pending.sent_at < self._resend_after_s:
            return False
        return pending.accepted_by is None or pending.accepted_by not in self._online

    def _resend_loop(self) -> None:
        assert self._resend_after_s is not None
        while not self._closed.wait(_TICK_S):
            now = time.monotonic()
            with self._lock:
                due = [p for p in self._pending.values() if self._due(p, now)]
            for pending in due:
                topic = self._resend_target(pending)
                self.resends += 1
                waited = now - pending.sent_at
                logger.info("job %s unanswered after %.1f s: sending it again to %s", pending.job_id, waited, topic)
                self._send(pending, topic)

    # paho callbacks (network thread) -------------------------------------------------

    def _on_connect(self, client: mqtt.Client, userdata: object, flags: object, rc: Any, props: object) -> None:
        if rc.is_failure:
            self._errors.append(f"broker refused connection: {rc}")
            return
        subs = [(self.reply_topic, SubscribeOptions(qos=1))]
        if self._fleet:
            subs.append((f"{self._profile.topics.prefix}/+/available", SubscribeOptions(qos=1)))
        client.subscribe(subs)

    def _on_subscribe(self, client: mqtt.Client, userdata: object, mid: int, rcs: list[Any], props: object) -> None:
        failed = [str(rc) for rc in rcs if rc.is_failure]
        if failed:
            self._errors.append(f"broker refused the reply subscription: {failed[0]}")
            return
        self._ready.set()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if msg.topic != self.reply_topic:
            self._availability(msg)
            return
        got = getattr(msg.properties, "CorrelationData", None)
        if got is None:
            return
        kind, device = _notice_kind(bytes(msg.payload))
        with self._lock:
            pending = self._pending.get(bytes(got))
            if pending is None:
                return
            if kind == "accepted":
                pending.accepted_by = device
                return
            if kind == "partial":
                return  # a streamed piece: the final result follows
            pending.copies.append(bytes(msg.payload))
            if len(pending.copies) == 1:
                self._unanswered -= 1
                self._room.notify()
        pending.answered.set()

    def _availability(self, msg: mqtt.MQTTMessage) -> None:
        """A box's availability: one online that takes from our stream (its notice names
        the same shared group) is a resend target; any other box never is."""
        levels = msg.topic.split("/")
        if len(levels) < 3 or levels[-1] != "available":
            return
        box = levels[-2]
        props = getattr(msg.properties, "UserProperty", None) or []
        ours = (GROUP_PROPERTY, self._profile.topics.shared_group) in [tuple(p) for p in props]
        online = bytes(msg.payload) == ONLINE
        with self._lock:
            if online and ours and box not in self._online:
                self._online.append(box)
            elif (not online or not ours) and box in self._online:
                self._online.remove(box)
            # Offline (a clean stop, or its will): its session may still take the stream's
            # jobs. An empty retained notice (cleared by an operator) means it is gone.
            if ours and bytes(msg.payload) and not online:
                self._offline.add(box)
            else:
                self._offline.discard(box)


def _notice_kind(payload: bytes) -> tuple[str | None, str | None]:
    """The status and device of a reply, for the notices that are not an answer
    (`accepted`, `partial`); (None, None) for anything else, a final result included."""
    if b'"accepted"' not in payload and b'"partial"' not in payload:
        return None, None  # most replies are final results: no need to parse them here
    try:
        doc = json.loads(payload)
    except ValueError:
        return None, None
    if not isinstance(doc, dict) or doc.get("status") not in ("accepted", "partial"):
        return None, None
    device = doc.get("device")
    return str(doc["status"]), device if isinstance(device, str) else None


def request(
    profile: Profile,
    task: str,
    job: dict[str, Any],
    timeout: float,
    fleet: bool = False,
    resend_after_s: float | None = None,
) -> dict[str, Any]:
    """Send `job` to this profile's device (or to the fleet's shared stream) and return
    the decoded result document."""
    client = JobClient(profile, fleet=fleet, resend_after_s=resend_after_s).start(timeout)
    try:
        pending = client.submit(task, job)
        if not pending.answered.wait(timeout):
            raise RequestTimeout(f"no reply within {timeout:.0f} s (waiting for an answer)")
        try:
            return pending.result
        except ValueError as err:
            raise RequestTimeout("daemon sent a result that is not JSON") from err
    finally:
        client.close()
