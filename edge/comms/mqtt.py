"""The daemon's MQTT v5 session: subscriptions, availability, results, reconnects.

paho runs its network loop in its own thread and reconnects by itself with
exponential backoff; this class only keeps what the rest of the daemon needs to know
(connected or not, since when) and routes job messages to one intake callback, through
a pump that takes what arrives together as one batch (edge/comms/pump.py).

Durability: the session is persistent (Clean Start false, a session expiry), so the
broker keeps jobs for us while the daemon restarts, and jobs are acknowledged by hand:
the PUBACK goes out only once the intake callback says the job is kept (journalled or
answered). A job the intake does not take (while stopping) stays unacknowledged and
the broker delivers it again in the next session. The subscriptions stay in the session
across a stop, except the shared stream's when another box is online on it
(edge/comms/peers.py). Connected is not subscribed: `subscribed` turns true at the SUBACK.
Results are QoS 1; the broker's PUBACK for each is reported to `on_delivered`, which marks
the job answered.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge.comms.identity import TAKEOVER_REASON, IdentityWatch
from edge.comms.message import NOTIFY_ACCEPTED, NOTIFY_PROPERTY, BatchIntakeCallback, DeliveredCallback, IncomingJob
from edge.comms.peers import StreamPeers
from edge.comms.pump import IntakePump
from edge.config.profile import Profile

logger = logging.getLogger(__name__)

_EARLY_TTL_S = 5.0
ONLINE = b"online"
OFFLINE = b"offline"
INSTANCE_PROPERTY = "instance"  # user property on availability notices: which daemon sent it
GROUP_PROPERTY = "group"  # and the shared job stream it takes from (topics.shared_group), if any
# The subscription identifier of the other boxes' availability notices: Mosquitto delivers
# our own notice once per matching subscription, and only the copy without it is ours to read.
PEERS_SUBSCRIPTION = 1


__all__ = ["DaemonLink", "IncomingJob", "make_client"]


def _read_password(profile: Profile) -> str | None:
    broker = profile.broker
    if broker.password_file is not None:
        return broker.password_file.read_text(encoding="utf-8").splitlines()[0]
    return broker.password


def make_client(client_id: str, profile: Profile, manual_ack: bool = False) -> mqtt.Client:
    """A paho v5 client with the profile's credentials and TLS; not yet connected."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5, manual_ack=manual_ack)
    broker = profile.broker
    if broker.username is not None:
        client.username_pw_set(broker.username, _read_password(profile))
    if broker.tls is not None:
        tls = broker.tls
        client.tls_set(
            ca_certs=str(tls.ca_file) if tls.ca_file else None,
            certfile=str(tls.cert_file) if tls.cert_file else None,
            keyfile=str(tls.key_file) if tls.key_file else None,
            cert_reqs=ssl.CERT_REQUIRED,
        )
        client.tls_insecure_set(tls.insecure)
    client.reconnect_delay_set(
        min_delay=max(1, int(broker.reconnect_min_s)), max_delay=max(1, int(broker.reconnect_max_s))
    )
    return client


class DaemonLink:
    def __init__(
        self, profile: Profile, on_jobs: BatchIntakeCallback, on_delivered: DeliveredCallback | None = None
    ) -> None:
        self._profile = profile
        self._on_delivered = on_delivered
        self._client = make_client(profile.client_id, profile, manual_ack=True)
        self._pump = IntakePump(on_jobs, self._client.ack)
        # Each daemon announces itself with a nonce of its own: a notice on our topic with
        # another one is a second box using this device id.
        self.instance = uuid.uuid4().hex
        self.identity = IdentityWatch(profile.device_id, profile.client_id)
        self._backed_off = False
        will = self._notice_props(PacketTypes.WILLMESSAGE)
        self._client.will_set(profile.available_topic, OFFLINE, qos=1, retain=True, properties=will)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish
        self._client.on_subscribe = self._on_subscribe
        group = profile.topics.shared_group
        self.peers = (
            StreamPeers(profile.topics.prefix, profile.device_id, (GROUP_PROPERTY, group), ONLINE)
            if group is not None
            else None
        )
        self._lock = threading.Lock()
        # Results awaiting the broker's PUBACK: message id -> job id. A PUBACK can beat
        # publish() back to us (paho calls on_publish under its own lock, so ours cannot
        # be held across publish()); such ids wait in _early, with the time they came,
        # until the mapping arrives. Ids are reused only after 65,535 messages, so an
        # entry older than a few seconds belongs to an untracked message and is pruned.
        self._awaiting: dict[int, str] = {}
        self._early: dict[int, float] = {}
        self._connected = False
        # Connected is not yet subscribed: until the broker's SUBACK, a job published to our
        # topics, or to the shared stream, is not ours (the stream's goes to the other members).
        self._subscribed = False
        self._subscribe_mid: int | None = None
        self._changed_at = time.time()
        self._accepting = True
        self.connects = 0

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    @property
    def subscribed(self) -> bool:
        """The broker acknowledged this connection's job subscriptions at QoS 1."""
        with self._lock:
            return self._subscribed

    @property
    def changed_at(self) -> float:
        with self._lock:
            return self._changed_at

    def start(self) -> None:
        broker = self._profile.broker
        logger.info("connecting to broker %s:%s as %s", broker.host, broker.port, self._profile.client_id)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = broker.session_expiry_s
        self._pump.start()
        self._client.connect_async(
            broker.host, broker.port, keepalive=broker.keepalive_s, clean_start=False, properties=props
        )
        self._client.loop_start()

    def submit(self, job: IncomingJob) -> None:
        """A job from inside this process (the HTTP API), taken by the same intake thread
        as the broker's messages, in the same batches."""
        self._pump.put(job, None, 0)

    def stop_intake(self) -> None:
        """Stop taking new jobs while results can still be published. The subscriptions
        stay in the session (unsubscribing would make the broker drop the jobs that
        arrive while we restart); what arrives now is left unacknowledged for the next.
        The shared stream's is the exception when another box is online on it: we leave it,
        or the broker would keep giving us our turn of its jobs while we are stopped."""
        self._accepting = False
        self._leave_stream()

    def _leave_stream(self) -> None:
        shared = self._profile.shared_jobs_filter
        if shared is None or self.peers is None or not self.connected:
            return  # disconnected: the session keeps the subscription whatever we do
        others = self.peers.online()
        if not others:
            logger.info(
                "staying on shared job stream %s while stopped: no other box is online on it, so the broker "
                "keeps its jobs for our return",
                self._profile.topics.shared_group,
            )
            return
        logger.info(
            "leaving shared job stream %s while stopped: %s online on it take its jobs",
            self._profile.topics.shared_group,
            ", ".join(others),
        )
        # Sent before the offline notice that close() waits for: the broker has it by then.
        self._client.unsubscribe(shared)

    @property
    def awaiting_puback(self) -> int:
        with self._lock:
            return len(self._awaiting)

    def _notice_props(self, packet: int = PacketTypes.PUBLISH) -> Properties:
        props = Properties(packet)
        props.UserProperty = (INSTANCE_PROPERTY, self.instance)
        if self._profile.topics.shared_group is not None:
            props.UserProperty = (GROUP_PROPERTY, self._profile.topics.shared_group)
        return props

    def _announce(self, payload: bytes) -> mqtt.MQTTMessageInfo:
        return self._client.publish(
            self._profile.available_topic, payload, qos=1, retain=True, properties=self._notice_props()
        )

    def close(self, timeout: float = 2.0) -> None:
        if self.connected:
            info = self._announce(OFFLINE)
            try:
                info.wait_for_publish(timeout)
            except (RuntimeError, ValueError):
                logger.warning("offline notice not delivered before shutdown")
        self._pump.stop()
        self._client.disconnect()
        self._client.loop_stop()

    def publish(self, topic: str, payload: bytes, correlation: bytes | None, job_id: str | None = None) -> bool:
        """Publish at QoS 1; with a job id, on_delivered(job_id) follows the broker's PUBACK.
        False, never an exception, for a message that cannot be published at all."""
        props = None
        if correlation is not None:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation
        try:
            info = self._client.publish(topic, payload, qos=1, properties=props)
        except (ValueError, TypeError, UnicodeError) as err:
            # Intake refuses such topics; one from an older journal must not stop anything.
            logger.error("cannot publish to topic %r: %s", topic[:200], err)
            return False
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            # paho keeps QoS 1 messages queued while disconnected (NO_CONN) and sends
            # them on reconnect; anything else is a bug worth a log line, not a crash.
            logger.warning("publish to %s returned %s", topic, mqtt.error_string(info.rc))
        if job_id is None or self._on_delivered is None:
            return True
        with self._lock:
            early = self._early.pop(info.mid, None) is not None
            if not early:
                self._awaiting[info.mid] = job_id
        if early:
            self._on_delivered(job_id)
        return True

    # paho callbacks (network thread) -------------------------------------------------

    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            logger.error("broker refused connection: %s", reason_code)
            return
        with self._lock:
            self._connected = True
            self._subscribed = False
            self._changed_at = time.time()
        self.connects += 1
        logger.info("connected to broker (session present: %s)", flags.session_present)
        if self._backed_off and self.identity.problem() is None:
            broker = self._profile.broker
            client.reconnect_delay_set(max(1, int(broker.reconnect_min_s)), max(1, int(broker.reconnect_max_s)))
            self._backed_off = False
        subs = [(self._profile.available_topic, SubscribeOptions(qos=1))]
        if self._accepting:
            # Retained messages only when the subscription is new: a retained job is refused
            # once, not again at every reconnect and restart that finds the session there.
            new_only = SubscribeOptions.RETAIN_SEND_IF_NEW_SUB
            subs.append((self._profile.jobs_filter, SubscribeOptions(qos=1, retainHandling=new_only)))
            if self._profile.shared_jobs_filter:
                subs.append((self._profile.shared_jobs_filter, SubscribeOptions(qos=1)))
        # The SUBACK comes to this (network) thread after this callback returns: the mid is set in time.
        _, mid = client.subscribe(subs)
        with self._lock:
            self._subscribe_mid = mid
        # A broker without subscription identifiers (its CONNACK says so) would take one
        # for a protocol error: there the peers stay unknown, and a clean stop keeps our turn.
        ids = getattr(properties, "SubscriptionIdentifierAvailable", 1)
        if self.peers is not None and self._accepting and ids:
            props = Properties(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = PEERS_SUBSCRIPTION
            client.subscribe(self.peers.topic_filter, options=SubscribeOptions(qos=1), properties=props)
        self._announce(ONLINE)

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        # Granted QoS 0 is a refusal too: such jobs would come without redelivery.
        refused = [str(rc) for rc in reason_codes if rc.is_failure or rc.value != 1]
        with self._lock:
            if mid != self._subscribe_mid:
                return  # the other boxes' notices: a refusal (an ACL) only leaves them unknown
            self._subscribed = not refused
        if refused:
            logger.error("broker did not grant the job subscriptions at QoS 1: %s", ", ".join(refused))
        else:
            logger.info("subscribed to jobs")

    def _on_publish(
        self, client: mqtt.Client, userdata: object, mid: int, reason_code: ReasonCode, properties: Properties | None
    ) -> None:
        with self._lock:
            job_id = self._awaiting.pop(mid, None)
            if job_id is None:
                now = time.monotonic()
                self._early[mid] = now
                for stale in [m for m, t in self._early.items() if now - t > _EARLY_TTL_S]:
                    del self._early[stale]
        if job_id is not None and self._on_delivered is not None:
            try:
                self._on_delivered(job_id)
            except Exception:
                logger.exception("could not record the delivery of %s", job_id)

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None,
    ) -> None:
        with self._lock:
            was = self._connected
            self._connected = False
            self._subscribed = False
            self._subscribe_mid = None
            self._changed_at = time.time()
        if was:
            logger.warning("disconnected from broker: %s; reconnecting with backoff", reason_code)
        if reason_code.value == TAKEOVER_REASON:  # brokers that say so (Mosquitto 2.0 only closes)
            self._taken_over()

    def _taken_over(self) -> None:
        wait = self.identity.taken_over()
        if wait is not None:
            self._client.reconnect_delay_set(int(wait), int(wait))
            self._backed_off = True

    def _notice(self, msg: mqtt.MQTTMessage) -> None:
        """An availability notice on our own topic. A live "online" from another instance
        is a second daemon with our device id. A retained one found on reconnecting says
        another instance announced itself while we were away: it took our session (the
        client id is the same). A retained one at our first connect may be our own last
        run's, and tells nothing."""
        if bytes(msg.payload) != ONLINE:
            return
        instances = [v for k, v in (getattr(msg.properties, "UserProperty", None) or []) if k == INSTANCE_PROPERTY]
        if not instances or instances[0] == self.instance:
            return
        if not msg.retain:
            self.identity.foreign_notice(instances[0])
        elif self.connects > 1:
            self._taken_over()

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        if PEERS_SUBSCRIPTION in (getattr(msg.properties, "SubscriptionIdentifier", None) or []):
            if self.peers is not None:
                user = getattr(msg.properties, "UserProperty", None) or []
                self.peers.notice(msg.topic, bytes(msg.payload), [(str(k), str(v)) for k, v in user])
            client.ack(msg.mid, msg.qos)
            return
        if msg.topic == self._profile.available_topic:
            try:
                self._notice(msg)
            except Exception:  # a malformed notice must not stop the network thread
                logger.exception("could not read an availability notice")
            client.ack(msg.mid, msg.qos)
            return
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        user = dict(getattr(props, "UserProperty", None) or []) if props else {}
        job = IncomingJob(
            topic=msg.topic,
            payload=bytes(msg.payload),
            response_topic=response_topic if response_topic is not None else None,
            correlation=bytes(correlation) if correlation is not None else None,
            retained=bool(msg.retain),
            traceparent=user.get("traceparent"),
            notify_accepted=user.get(NOTIFY_PROPERTY) == NOTIFY_ACCEPTED,
            redelivered=bool(msg.dup),
        )
        self._pump.put(job, msg.mid, msg.qos)
