#!/usr/bin/env python3
"""A camera host's first client: send one image to an edge box over MQTT v5 and print
the result. Start from it; it needs only paho-mqtt (`pip install paho-mqtt`).

    python samples/send_job.py --device line-2 --task inspect --image part.jpg
    python samples/send_job.py --device line-2 --task ocr --image label.png --host broker.plant

What a requester must do (docs/protocol.md): publish the job at QoS 1 to
`<prefix>/<device>/jobs/<task>` with a Response Topic of its own and Correlation Data
unique per job, subscribe to that topic first, and match the result on the correlation
(results are not ordered). If no answer comes in time, send the same job again with the
same `id`: here the reply topic and the correlation follow from the id, so the resend is
the same request, and a box answers it once (a finished job with its stored result, one
still running when it is done).
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def job(task: str, image: Path, job_id: str, heatmap: bool, read_labels: bool) -> dict[str, Any]:
    """The job document: the image travels in the message as base64."""
    doc: dict[str, Any] = {"id": job_id, "image": {"data": base64.b64encode(image.read_bytes()).decode()}}
    if task == "inspect":
        doc["heatmap"] = heatmap
        doc["ocr"] = read_labels
    return doc


def send(args: argparse.Namespace) -> dict[str, Any]:
    job_id = args.id or f"{args.requester}-{uuid.uuid4().hex[:12]}"
    correlation = job_id.encode()  # the same for a resend of this id: the same request
    reply_topic = f"replies/{args.requester}/{job_id}"  # docs/mosquitto-acl.example's layout
    answers: queue.Queue[dict[str, Any]] = queue.Queue()
    subscribed: queue.Queue[bool] = queue.Queue()

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{args.requester}-{job_id}",
                         protocol=mqtt.MQTTv5)  # fmt: skip
    if args.username:
        client.username_pw_set(args.username, args.password)
    if args.tls:
        client.tls_set(ca_certs=args.ca_file)

    def on_connect(c: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            answers.put({"status": "error", "error": {"code": "connect", "message": str(reason)}})
            return
        c.subscribe(reply_topic, qos=1)

    def on_subscribe(c: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        subscribed.put(all(not r.is_failure for r in reasons))

    def on_message(c: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if getattr(msg.properties, "CorrelationData", None) != correlation:
            return  # another job's answer
        doc = json.loads(msg.payload)
        if doc.get("status") != "accepted":  # a notice, only for jobs that ask for one
            answers.put(doc)

    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    client.connect(args.host, args.port, keepalive=30)
    client.loop_start()
    try:
        try:
            if not subscribed.get(timeout=args.timeout):
                raise SystemExit(f"the broker refused the subscription to {reply_topic}")
        except queue.Empty:
            raise SystemExit(f"no answer from the broker at {args.host}:{args.port}") from None
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]  # paho leaves it unannotated
        props.ResponseTopic = reply_topic
        props.CorrelationData = correlation
        payload = json.dumps(job(args.task, args.image, job_id, args.heatmap, args.read_labels))
        topic = f"{args.prefix}/{args.device}/jobs/{args.task}"
        client.publish(topic, payload, qos=1, properties=props).wait_for_publish(timeout=args.timeout)
        try:
            return answers.get(timeout=args.timeout)
        except queue.Empty:
            raise SystemExit(f"no result for {job_id} in time; send it again with --id {job_id}") from None
    finally:
        client.loop_stop()
        client.disconnect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Send one image job to an edge box and print its result.")
    parser.add_argument("--device", required=True, help="the box's device_id")
    parser.add_argument("--task", choices=["inspect", "ocr"], default="inspect")
    parser.add_argument("--image", type=Path, required=True, help="a JPEG or PNG file")
    parser.add_argument("--heatmap", action="store_true", help="inspect: also return the defect heat map")
    parser.add_argument("--read-labels", action="store_true", help="inspect: also read the part's label")
    parser.add_argument("--id", help="the job id (default: a new one); reuse it to resend a job")
    parser.add_argument("--requester", default="camera-1", help="this client's name, in its reply topic")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--prefix", default="edge", help="the profile's topics.prefix")
    parser.add_argument("--username")
    parser.add_argument("--password")
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--ca-file")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the result")
    args = parser.parse_args(argv)
    result = send(args)
    print(json.dumps(result, indent=2))
    return 0 if result.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
