"""Short chats through the HTTP API beside the same jobs through MQTT, in one run against
one daemon: a real Mosquitto, `edgectl serve` with the shipped CPU profile
(profiles/cpu-dev.yaml, bench/daemon.py's changes plus the HTTP listener), SmolLM2-135M
AWQ INT4 with real weights.

    python -m bench.http

Each round sends the same burst of short questions (one per request, greedy, a few new
tokens) through each path, HTTP then MQTT then the other way round, a burst at a time:
the queue, journal and text branch are shared, so the difference between the two rows is
what each transport adds. Reported per path: requests per second (the burst over the
time from its first send to its last answer) and p50/p99 of each request's latency as
its client sees it. Writes bench/results/http.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench.common import REPO, RESULTS, Broker, free_port, percentile, write_json
from bench.daemon import Client, prepare_engines, profile_origin, start_daemon, status, write_profile
from bench.text_engines import is_served

QUESTION = "Say hello."
NEW_TOKENS = 8


def _http_chat(base: str, model: str, timeout: float) -> float:
    """One chat completion; its latency in seconds."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": NEW_TOKENS}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        doc = json.loads(resp.read())
    if not doc.get("choices"):
        raise RuntimeError(f"no answer: {doc}")
    return time.monotonic() - t0


def http_burst(base: str, model: str, n: int, timeout: float) -> tuple[float, list[float]]:
    """(wall seconds for the burst, latency of each request)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        latencies = list(pool.map(lambda _: _http_chat(base, model, timeout), range(n)))
    return time.monotonic() - t0, latencies


def mqtt_burst(client: Client, n: int, timeout: float) -> tuple[float, list[float]]:
    t0 = time.monotonic()
    corrs = [
        client.send("qa", {"id": f"mq-{uuid.uuid4().hex}", "question": QUESTION, "max_new_tokens": NEW_TOKENS})
        for _ in range(n)
    ]
    client.wait(corrs, timeout)
    sent = [client.sent[c] for c in corrs]
    if any(s.doc is None or s.doc.get("status") != "ok" for s in sent):
        raise RuntimeError(f"jobs failed: {[s.doc for s in sent if s.doc and s.doc.get('status') != 'ok'][:3]}")
    latencies = [s.got_at - s.at for s in sent if s.got_at is not None]
    return max(s.got_at or t0 for s in sent) - t0, latencies


def _row(walls: list[float], latencies: list[float], n: int) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "requests_per_s": n * len(walls) / sum(walls),
        "p50_ms": percentile([x * 1000 for x in latencies], 0.50),
        "p99_ms": percentile([x * 1000 for x in latencies], 0.99),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-http-"))
    broker = Broker(workdir, root=args.mosquitto_root, log=workdir / "mosquitto.log")
    broker.start()
    daemon = None
    try:
        text, student, models = prepare_engines("cpu", workdir, args.engine_dir, "quick")
        profile, changes = write_profile(workdir, "cpu", broker.port, text, student)
        port = free_port()
        doc = yaml.safe_load(profile.read_text(encoding="utf-8"))
        doc["http"] = {"listen": f"127.0.0.1:{port}"}
        profile.write_text(yaml.safe_dump(doc), encoding="utf-8")
        changes["changed"]["http.listen"] = "127.0.0.1:<free port>"
        daemon, sock = start_daemon(profile, workdir)
        loaded = status(sock)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
            listed = [m["id"] for m in json.loads(resp.read())["data"]]
        model = next(m for m in listed if not m.startswith("all-MiniLM"))
        client = Client(broker.port)
        # Warm both paths (first-request costs: connections, caches) before measuring.
        http_burst(base, model, 2, args.timeout)
        mqtt_burst(client, 2, args.timeout)
        load_before = os.getloadavg()[0]
        walls: dict[str, list[float]] = {"http": [], "mqtt": []}
        lat: dict[str, list[float]] = {"http": [], "mqtt": []}
        for i in range(args.rounds):
            order = ("http", "mqtt") if i % 2 == 0 else ("mqtt", "http")
            for path in order:
                if path == "http":
                    wall, got = http_burst(base, model, args.burst, args.timeout)
                else:
                    wall, got = mqtt_burst(client, args.burst, args.timeout)
                walls[path].append(wall)
                lat[path].extend(got)
                print(f"round {i} {path}: {args.burst / wall:.2f} req/s", flush=True)
        load_after = os.getloadavg()[0]
        final = status(sock)
        client.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        daemon = None
    finally:
        if daemon is not None:
            daemon.kill()
        broker.stop()
    result: dict[str, Any] = {
        "device": platform.processor() or platform.machine(),
        "models": models,
        "question": QUESTION,
        "new_tokens": NEW_TOKENS,
        "burst": args.burst,
        "rounds": args.rounds,
        # The machine's 1-minute load average around the measured rounds, and its cores:
        # the two paths share whatever else ran, so their ratio holds better than either figure.
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "cpus": os.cpu_count(),
        "http": _row(walls["http"], lat["http"], args.burst),
        "mqtt": _row(walls["mqtt"], lat["mqtt"], args.burst),
        "engine_config": {**loaded["text_engine"], "origin": profile_origin(changes, "cpu")},
        "profile": changes,
        "jobs": final["jobs"],
    }
    result["served"] = is_served(result["engine_config"])
    result["http_over_mqtt_rps"] = result["http"]["requests_per_s"] / result["mqtt"]["requests_per_s"]
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines", help="built engines")
    parser.add_argument("--mosquitto-root", type=Path, default=None)
    parser.add_argument("--burst", type=int, default=16, help="requests sent together per path and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    result = run(args)
    write_json(RESULTS / "http.json", result)
    for path in ("http", "mqtt"):
        row = result[path]
        print(f"{path:5s} {row['requests_per_s']:7.2f} req/s  p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
