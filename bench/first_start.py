#!/usr/bin/env python3
"""A fresh box's first start: `edgectl serve` with the demo's profile and an empty engine
directory, timed to ready and to its first answers.

What a fresh clone's first start does, after `scripts/setup.sh`: build the text engine
(import, the shipped clinic adapter merged, AWQ INT4), install the shipped inspection
student, measure the OCR working memory, load every model. A real Mosquitto on a free
loopback port, the daemon as its own process, one inspect and one qa job from an
outside client. Writes bench/results/first_start.json and prints a table.

    .venv/bin/python -m bench.first_start
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import REPO, RESULTS, Broker, write_json
from bench.daemon import start_daemon
from edge.comms.client import request
from edge.config.loader import load_profile

TARGET_S = 300.0
# Log lines that mark the first start's stages, with the stage they end.
STAGES = {
    "text engine (import, adapter merge, AWQ INT4)": re.compile(r"built the text engine in ([0-9.]+) s"),
    "inspection student (the shipped one installed)": re.compile(r"built the inspection model in ([0-9.]+) s"),
}


def profile_for(workdir: Path, port: int, source: Path) -> Path:
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    data["broker"] = {**data.get("broker", {}), "host": "127.0.0.1", "port": port}
    data["paths"] = {
        **data.get("paths", {}),
        "state_dir": str(workdir / "state"),
        "runtime_dir": str(workdir / "run"),
        "engine_dir": str(workdir / "engines"),  # nothing built: a fresh clone's first start
        "media_dir": str(REPO / "samples"),
    }
    out = workdir / "first-start.yaml"
    out.write_text(yaml.safe_dump(data), encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=REPO / "profiles" / "cpu-dev.yaml")
    parser.add_argument("--mosquitto-root", type=Path, default=None, help="where mosquitto's .debs were unpacked")
    parser.add_argument("--out", type=Path, default=RESULTS / "first_start.json")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="edge-first-start-"))
    broker = Broker(workdir, root=args.mosquitto_root, log=workdir / "mosquitto.log")
    broker.start()
    profile_path = profile_for(workdir, broker.port, args.profile)
    profile = load_profile(profile_path)
    t0 = time.monotonic()
    daemon, _ = start_daemon(profile_path, workdir, timeout=3600)
    ready_s = time.monotonic() - t0
    try:
        answers: dict[str, float] = {}
        part = {"id": "first-inspect", "image": {"path": "parts/part_01_scratch.png"}}
        inspect = request(profile, "inspect", part, timeout=120)
        answers["inspect"] = time.monotonic() - t0
        qa = request(profile, "qa", {"id": "first-qa", "question": "What is a fever?", "max_new_tokens": 16}, 300)
        answers["qa"] = time.monotonic() - t0
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        broker.stop()
    log = (workdir / "daemon.log").read_text(encoding="utf-8", errors="replace")
    stages = {name: float(m.group(1)) for name, rx in STAGES.items() if (m := rx.search(log))}
    result: dict[str, Any] = {
        "profile": str(args.profile.relative_to(REPO) if args.profile.is_relative_to(REPO) else args.profile),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "first_start_s": round(ready_s, 1),
        "first_answer_s": {task: round(s, 1) for task, s in answers.items()},
        "stages_s": stages,
        "target_s": TARGET_S,
        "inspect_class": inspect.get("output", {}).get("class"),
        "statuses": {"inspect": inspect.get("status"), "qa": qa.get("status")},
    }
    write_json(args.out, result)
    print("| stage | seconds |\n|---|---:|")
    for name, s in stages.items():
        print(f"| {name} | {s:.0f} |")
    print(f"| ready (start to ready) | {ready_s:.0f} |")
    for task, s in answers.items():
        print(f"| first {task} answer | {s:.0f} |")
    met = "met" if ready_s <= TARGET_S else "NOT met"
    print(f"first start {ready_s:.0f} s on {os.cpu_count()} CPUs: target <= {TARGET_S:.0f} s {met}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
