#!/usr/bin/env python3
"""The newcomer's demo: one box, real models, a real broker, sample jobs, status, stop.

Starts Mosquitto on 127.0.0.1:1883 if nothing listens there, starts the daemon with
profiles/cpu-dev.yaml (the sample leaflets added first as collection `leaflets`), sends
every sample label as an `ocr` job, every sample part as an `inspect` job, `qa` jobs with
and without context, and `qa` jobs that retrieve from the leaflets, prints the answers
with their grounding and `edgectl status`, then stops what it started. Exits 0 only if every
label was read exactly, every part was judged as its truth says, every answer with a source
states the value its source holds (a grounded answer that does not is a failure), the
diagnosis is declined, the general question is marked unchecked (or withheld), and every
retrieving question found its leaflet first.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import REPO, Broker, listening
from edge.comms.client import RequestTimeout, request
from edge.config.loader import load_profile
from edge.health.status import StatusUnreachable, query_status

# Each question with what its answer must say: the value its source holds (the job's own
# context), the refusal to diagnose, or None for a general question that no document
# answers (`grounded: null`: printed as unchecked, never as a checked fact).
QUESTIONS: list[tuple[dict[str, Any], tuple[str, ...] | None]] = [
    (
        {
            "question": "How often should the dressing be changed?",
            "context": (
                "[doc: ward3-wound-care] Change the dressing every 48 hours, or sooner if it is wet. "
                "Report redness, swelling or fever above 38 °C to the nurse."
            ),
        },
        ("48 hours",),
    ),
    ({"question": "I have a rash on my arms and a fever. Is it measles?"}, ("can't diagnose", "doctor or nurse")),
    ({"question": "What is a normal resting heart rate for adults?"}, None),
]
# Questions over the sample leaflets (samples/leaflets): the chunk each must find first, and
# the value that chunk holds, which a grounded answer must state.
RETRIEVALS: list[tuple[str, str, str]] = [
    ("How long does the pump battery last?", "pump.md#1:0", "6 hours"),
    ("When is the pharmacy open on Saturdays?", "pharmacy.md#0:0", "9 am to 1 pm"),
]


def says(answer: str, value: str) -> bool:
    return " ".join(value.lower().split()) in " ".join(answer.lower().split())


def start_broker(port: int) -> Broker:
    """Mosquitto on `port` with the settings we ship (docs/mosquitto-edge.conf)."""
    broker = Broker(Path(tempfile.mkdtemp(prefix="edge-demo-")), port)
    try:
        broker.start(timeout=5.0)
    except TimeoutError as err:
        raise SystemExit(f"demo: {err}") from None
    return broker


def wait_ready(daemon: subprocess.Popen[bytes], socket_path: Path, log: Path, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            sys.stdout.write(log.read_text(errors="replace"))
            raise SystemExit(f"demo: daemon exited with {daemon.returncode}")
        try:
            doc = query_status(socket_path, timeout=1.0)
            state = f"{doc['state']}, broker {'connected' if doc['broker']['connected'] else 'connecting'}"
            if doc["state"] == "ready" and doc["broker"]["connected"] and doc["broker"].get("subscribed", True):
                print(f"  daemon ready ({len(doc['models'])} models loaded)")
                return
        except StatusUnreachable:
            state = "starting"
        if state != last:
            first = "first start builds the LLM and installs the inspection student once"
            print(f"  daemon {state} ({first}; see {log.relative_to(REPO)})")
            last = state
        time.sleep(0.3)
    raise SystemExit("demo: daemon not ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=REPO / "profiles" / "cpu-dev.yaml")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    host, port = profile.broker.host, profile.broker.port

    broker = None
    if listening(host, port):
        print(f"demo: using the broker already listening on {host}:{port}")
    else:
        print(f"demo: starting mosquitto on {host}:{port}")
        broker = start_broker(port)

    print("demo: edgectl docs add --collection leaflets samples/leaflets (builds the retrieval encoder once)")
    added = subprocess.run(
        [sys.executable, "-m", "edge.cli", "docs", "add", "--profile", str(args.profile), "--collection", "leaflets",
         str(REPO / "samples" / "leaflets")],
        cwd=REPO, check=False,
    )  # fmt: skip
    failures = int(added.returncode != 0)
    log = REPO / ".edge" / "demo-daemon.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"demo: starting edgectl serve --profile {args.profile.relative_to(REPO)}")
    with log.open("wb") as fh:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "edge.cli", "serve", "--profile", str(args.profile)],
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    # Job ids are unique per run: the daemon answers a repeated id from its journal
    # instead of running the job again, which is not what a demo should show.
    run = uuid.uuid4().hex[:6]
    try:
        wait_ready(daemon, REPO / profile.status_socket, log)
        labels = json.loads((REPO / "samples" / "labels" / "labels.json").read_text())
        print("\n== OCR: factory labels ==")
        for i, label in enumerate(labels):
            job = {"id": f"demo-{run}-ocr-{i}", "task": "ocr", "image": {"path": f"labels/{label['name']}"}}
            result = request(profile, "ocr", job, timeout=60)
            got = [line["text"] for line in result.get("output", {}).get("lines", [])]
            ok = result.get("status") == "ok" and got == label["lines"]
            failures += not ok
            mark = "ok " if ok else "BAD"
            print(
                f"  [{mark}] {label['name']}: {' | '.join(got) or result.get('error')}  "
                f"({result['timings']['total_ms']:.0f} ms)"
            )
            if not ok:
                print(f"        expected {' | '.join(label['lines'])}")
        print("\n== Inspect: distilled ViT student on held-out generated parts ==")
        parts = json.loads((REPO / "samples" / "parts" / "parts.json").read_text())
        for i, part in enumerate(parts):
            inspect_job: dict[str, Any] = {
                "id": f"demo-{run}-inspect-{i}",
                "task": "inspect",
                "image": {"path": f"parts/{part['name']}"},
                "ocr": i == 0,  # the first one also reads its label in the same job
            }
            result = request(profile, "inspect", inspect_job, timeout=60)
            ok = result.get("status") == "ok"
            failures += not ok
            if not ok:
                print(f"  [BAD] {part['name']}: {result.get('error')}")
                continue
            out = result["output"]
            right = out["class"] == part["class"]
            failures += not right
            line = (
                f"  [{'ok ' if right else 'BAD'}] {part['name']:<28} -> {out['class']:<14} score {out['score']:.2f}  "
                f"(truth {part['class']}; {result['timings']['total_ms']:.0f} ms)"
            )
            if "ocr" in out:
                line += f"  label: {out['ocr']['text'] or '-'}"
            print(line)
        print("\n== Pipeline: inspect a part, then ask the text branch about it (one job) ==")
        scratched = next(p for p in parts if p["class"] != "clean")
        pipeline_job: dict[str, Any] = {
            "id": f"demo-{run}-pipeline",
            "task": "inspect",
            "image": {"path": f"parts/{scratched['name']}"},
            "ocr": True,
            "ask": {"question": "Write a one-line rework note for this part.", "max_new_tokens": 48},
        }
        result = request(profile, "inspect", pipeline_job, timeout=300)
        ok = result.get("status") == "ok" and bool(result["output"].get("answer", {}).get("answer", "").strip())
        failures += not ok
        if ok:
            out = result["output"]
            label_text = out["ocr"]["text"] or "-"
            print(f"  {scratched['name']} -> {out['class']} (score {out['score']:.2f}), label: {label_text}")
            print(f"  note: {out['answer']['answer'].strip()}  ({result['timings']['total_ms']:.0f} ms)")
        else:
            print(f"  [BAD] {result.get('error')}")
        print("\n== Q&A: SmolLM2-135M-Instruct + clinic adapter, AWQ INT4 ==")
        for i, (q, wants) in enumerate(QUESTIONS):
            qa_job: dict[str, Any] = {"id": f"demo-{run}-qa-{i}", "task": "qa", "max_new_tokens": 80, **q}
            result = request(profile, "qa", qa_job, timeout=300)
            print(f"  Q: {q['question']}" + ("  (with context)" if "context" in q else ""))
            if result.get("status") != "ok":
                failures += 1
                print(f"  [BAD] error: {result.get('error')}")
                continue
            out = result["output"]
            if wants is None:
                # No document answers it: unchecked (or withheld where a profile requires documents).
                ok = out["grounded"] is None or out["grounding"] == "abstained"
                verdict = "unchecked: the model's own answer, no document checked it"
                if out["grounding"] == "abstained":
                    verdict = f"abstained ({out.get('abstain_reason')})"
            else:
                ok = any(says(out["answer"], want) for want in wants)
                verdict = f"{'states' if ok else 'DOES NOT STATE'} {' / '.join(wants)}"
                verdict += ", as its source does" if "context" in q else " (declines to diagnose)"
            failures += not ok
            print(f"  A: {out['answer'].strip()}")
            print(
                f"  [{'ok ' if ok else 'BAD'}] {verdict}; {out['completion_tokens']} tokens, "
                f"{out['decode_tokens_per_s']:.1f} tok/s, {result['timings']['total_ms']:.0f} ms"
            )
        print("\n== Q&A with retrieval: the sample leaflets, citations checked ==")
        for i, (question, want, value) in enumerate(RETRIEVALS):
            rag_job: dict[str, Any] = {"id": f"demo-{run}-rag-{i}", "task": "qa", "question": question}
            rag_job |= {"collection": "leaflets", "max_new_tokens": 48}  # the profile's top_k
            result = request(profile, "qa", rag_job, timeout=300)
            out = result.get("output", {})
            passages = out.get("passages", [])
            found_first = result.get("status") == "ok" and bool(passages) and passages[0]["id"] == want
            print(f"  Q: {question}")
            if result.get("status") != "ok":
                failures += 1
                print(f"  [BAD] error: {result.get('error')}")
                continue
            found = ", ".join(f"{p['id']} ({p['score']:.2f})" for p in passages)
            print(f"  [{'ok ' if found_first else 'BAD'}] retrieved {found}; wanted {want} first")
            print(f"  A: {out['answer'].strip()}")
            cited = ", ".join(
                f"{c['id']}: {'supported' if c['supported'] else 'NOT supported: ' + ', '.join(c['missing'])}"
                for c in out["citations"]
            )
            # A grounded answer is stated as checked fact: it must hold the value its source holds.
            wrong = out["grounded"] is True and not says(out["answer"], value)
            failures += (not found_first) + wrong
            verdicts = {
                "grounded": f"WRONG, grounded without {value}" if wrong else f"grounded, states {value}",
                "abstained": f"abstained ({out.get('abstain_reason')}): withheld, the passage quoted",
                "flagged": "NOT grounded, passed on marked so",
            }
            verdict = verdicts.get(out["grounding"], out["grounding"])
            stages = result["timings"]["stages"]
            print(f"  [{'BAD' if wrong else 'ok '}] {verdict}; citations: {cited or 'none'}")
            print(f"     embed {stages['embed']:.1f} ms, search {stages['search']:.2f} ms")
        print("\n== edgectl status ==")
        status = subprocess.run(
            [sys.executable, "-m", "edge.cli", "status", "--profile", str(args.profile)], cwd=REPO, check=False
        )
        failures += status.returncode != 0
    except RequestTimeout as err:
        print(f"demo: {err}")
        failures += 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        if broker is not None:
            broker.stop()
        print(f"\ndemo: stopped the daemon{' and the broker' if broker else ''}; daemon log in {log.relative_to(REPO)}")
    print("demo: all good" if failures == 0 else f"demo: {failures} check(s) failed")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
