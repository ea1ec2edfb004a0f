"""A one-shot MQTT v5 request/response client (what `edgectl submit` uses).

It subscribes to a reply topic of its own, sends the job with ResponseTopic and
CorrelationData, and waits for the result carrying the same correlation.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge.comms.mqtt import make_client
from edge.config.schema import Profile

logger = logging.getLogger(__name__)


class RequestTimeout(Exception):
    pass


def request(profile: Profile, task: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send `job` to this profile's device and return the decoded result document."""
    correlation = uuid.uuid4().bytes
    client_id = f"edgectl-{uuid.uuid4().hex[:12]}"
    # Outside every device's own topics (the daemon sends results nowhere in there but its
    # results topic), where docs/mosquitto-acl.example lets boxes write replies.
    reply_topic = f"replies/{client_id}"
    job_topic = profile.topic("jobs", task)
    done = threading.Event()
    subscribed = threading.Event()
    result: dict[str, Any] = {}
    errors: list[str] = []

    def on_connect(client: mqtt.Client, userdata: object, flags: object, rc: Any, props: object) -> None:
        if rc.is_failure:
            errors.append(f"broker refused connection: {rc}")
            done.set()
            return
        client.subscribe([(reply_topic, SubscribeOptions(qos=1))])

    def on_subscribe(client: mqtt.Client, userdata: object, mid: int, rcs: list[Any], props: object) -> None:
        subscribed.set()
        props_out = Properties(PacketTypes.PUBLISH)
        props_out.ResponseTopic = reply_topic
        props_out.CorrelationData = correlation
        client.publish(job_topic, json.dumps(job).encode(), qos=1, properties=props_out)

    def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        got = getattr(msg.properties, "CorrelationData", None)
        if got is not None and bytes(got) == correlation:
            try:
                result.update(json.loads(msg.payload))
            except ValueError:
                errors.append("daemon sent a result that is not JSON")
            done.set()

    client = make_client(client_id, profile)
    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    try:
        client.connect(profile.broker.host, profile.broker.port, keepalive=profile.broker.keepalive_s)
    except OSError as err:
        raise RequestTimeout(f"cannot reach broker {profile.broker.host}:{profile.broker.port}: {err}") from err
    client.loop_start()
    try:
        if not done.wait(timeout):
            stage = "an answer" if subscribed.is_set() else "the broker"
            raise RequestTimeout(f"no reply within {timeout:.0f} s (waiting for {stage})")
    finally:
        client.disconnect()
        client.loop_stop()
    if errors:
        raise RequestTimeout(errors[0])
    return result
