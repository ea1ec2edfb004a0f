"""The daemon's MQTT v5 session: subscriptions, availability, results, reconnects.

paho runs its network loop in its own thread and reconnects by itself with
exponential backoff; this class only keeps what the rest of the daemon needs to know
(connected or not, since when) and routes messages to one intake callback.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge.config.schema import Profile

logger = logging.getLogger(__name__)

ONLINE = b"online"
OFFLINE = b"offline"


@dataclass(frozen=True)
class IncomingJob:
    topic: str
    payload: bytes
    response_topic: str | None
    correlation: bytes | None


IntakeCallback = Callable[[IncomingJob], None]


def _read_password(profile: Profile) -> str | None:
    broker = profile.broker
    if broker.password_file is not None:
        return broker.password_file.read_text(encoding="utf-8").splitlines()[0]
    return broker.password


def make_client(client_id: str, profile: Profile) -> mqtt.Client:
    """A paho v5 client with the profile's credentials and TLS; not yet connected."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
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
    def __init__(self, profile: Profile, on_job: IntakeCallback) -> None:
        self._profile = profile
        self._on_job = on_job
        self._client = make_client(profile.client_id, profile)
        self._client.will_set(profile.available_topic, OFFLINE, qos=1, retain=True)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._lock = threading.Lock()
        self._connected = False
        self._changed_at = time.time()
        self._accepting = True
        self.connects = 0

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    @property
    def changed_at(self) -> float:
        with self._lock:
            return self._changed_at

    def start(self) -> None:
        broker = self._profile.broker
        logger.info("connecting to broker %s:%s as %s", broker.host, broker.port, self._profile.client_id)
        self._client.connect_async(broker.host, broker.port, keepalive=broker.keepalive_s, clean_start=True)
        self._client.loop_start()

    def stop_intake(self) -> None:
        """Stop taking new jobs (unsubscribe) while results can still be published."""
        self._accepting = False
        filters = [self._profile.jobs_filter]
        if self._profile.shared_jobs_filter:
            filters.append(self._profile.shared_jobs_filter)
        if self.connected:
            self._client.unsubscribe(filters)

    def close(self, timeout: float = 2.0) -> None:
        if self.connected:
            info = self._client.publish(self._profile.available_topic, OFFLINE, qos=1, retain=True)
            try:
                info.wait_for_publish(timeout)
            except (RuntimeError, ValueError):
                logger.warning("offline notice not delivered before shutdown")
        self._client.disconnect()
        self._client.loop_stop()

    def publish(self, topic: str, payload: bytes, correlation: bytes | None) -> None:
        props = None
        if correlation is not None:
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation
        info = self._client.publish(topic, payload, qos=1, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            # paho keeps QoS 1 messages queued while disconnected; anything else is a bug
            # worth a log line, not a crash.
            logger.warning("publish to %s returned %s", topic, mqtt.error_string(info.rc))

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
            self._changed_at = time.time()
        self.connects += 1
        logger.info("connected to broker (session present: %s)", flags.session_present)
        if self._accepting:
            subs = [(self._profile.jobs_filter, SubscribeOptions(qos=1))]
            if self._profile.shared_jobs_filter:
                subs.append((self._profile.shared_jobs_filter, SubscribeOptions(qos=1)))
            client.subscribe(subs)
        client.publish(self._profile.available_topic, ONLINE, qos=1, retain=True)

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
            self._changed_at = time.time()
        if was:
            logger.warning("disconnected from broker: %s; reconnecting with backoff", reason_code)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        job = IncomingJob(
            topic=msg.topic,
            payload=bytes(msg.payload),
            response_topic=response_topic or None,
            correlation=bytes(correlation) if correlation is not None else None,
        )
        try:
            self._on_job(job)
        except Exception:  # never let one message kill paho's network thread
            logger.exception("intake failed for a message on %s", msg.topic)
