#!/usr/bin/env python3
"""The daemon as a real process: a real Mosquitto, `edgectl serve` with both branches,
and an outside MQTT v5 client sending camera bursts and a Q&A stream.

    python -m bench.daemon cuda   # Llama-3-8B-shape INT4 (random weights) + student, both on
                                  # CUDA, the budget 8 GiB of GPU memory
    python -m bench.daemon cpu    # SmolLM2-135M AWQ INT4 (real weights) + student on the CPU

Runs, one after another against the same daemon: Q&A alone (questions one at a time,
for the decode rate the daemon reports per answer), cameras alone, cameras with the Q&A
stream. Reported: p50/p99 per task as the requester sees them (publish to result, through
the broker) and the daemon's own; deadline misses; Q&A decode tok/s through the daemon
beside the same engine's own loop (the profile's qa section built by TextEngine.load, the
same questions through its batcher, no MQTT or scheduler), measured in this process after
the daemon stopped; the profile is the device's shipped one (profiles/gpu-dev.yaml,
profiles/cpu-dev.yaml) with only what a bench run must set, listed in the result;
the process's peak of the memory the budget covers (on CUDA: the caching allocator's
peak plus the context, from `edgectl status`) with the ledger's peak and the budget.

On the GPU the models have random weights: the figures are about speed and memory, not
answers. Writes bench/results/daemon_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, Broker, percentile, write_json
from bench.text_engines import SHIPPED, is_served
from engines.text.text_build import serving_group

GIB = 1 << 30


@dataclass(frozen=True)
class Load:
    cameras: int
    burst: int  # images per burst
    period_s: float  # between bursts, per camera
    deadline_ms: int
    qa_every_s: float
    qa_new_tokens: int
    seconds: float
    solo_questions: int  # Q&A alone, for the decode figure
    solo_new_tokens: int
    prompt_words: int  # the random model's prompt length (words are tokens)


LOADS = {
    "cpu": Load(
        cameras=4, burst=4, period_s=1.6, deadline_ms=2000, qa_every_s=2.0, qa_new_tokens=32, seconds=20,
        solo_questions=4, solo_new_tokens=64, prompt_words=0,
    ),
    "cuda": Load(
        cameras=8, burst=8, period_s=0.25, deadline_ms=200, qa_every_s=0.5, qa_new_tokens=64, seconds=10,
        solo_questions=6, solo_new_tokens=128, prompt_words=200,
    ),
}  # fmt: skip

CPU_QUESTION = "What are the signs of dehydration in an elderly patient?"
CPU_CONTEXT = (
    "Dehydration in older adults shows as dry mouth, little or dark urine, dizziness, confusion and "
    "low blood pressure. Encourage small frequent drinks and check the fluid chart every shift."
)


def prepare_engines(device: str, workdir: Path, engine_dir: Path, student_size: str) -> tuple[Path, Path, str]:
    """(text checkpoint, student, what they are)."""
    if device == "cuda":
        from engines.text.random_llama import LLAMA3_8B, write_random_checkpoint
        from engines.vision.random_student import write_random_student

        t0 = time.perf_counter()
        # Quantized as `edgectl build` quantizes (its group size), so the row is the served one.
        group = serving_group(LLAMA3_8B.parameter_count())
        text = write_random_checkpoint(workdir / "llama3-8b-int4-random", LLAMA3_8B, device="cuda", group=group)
        student = write_random_student(workdir / "student-random")
        print(f"wrote the random 8B checkpoint and student in {time.perf_counter() - t0:.0f} s", flush=True)
        return (
            text,
            student,
            f"Llama-3-8B shape, INT4 g{group}, random weights; ViT-Tiny student, random weights",
        )
    from engines.text.text_build import build_text_engine
    from engines.vision.vision_build import build_student

    text = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    student = build_student(engine_dir, student_size, progress=False)
    return text, student, f"SmolLM2-135M + clinic adapter, AWQ INT4 g32 (real weights); {student_size} student"


def write_profile(workdir: Path, device: str, port: int, text: Path, student: Path) -> tuple[Path, dict[str, Any]]:
    """The shipped profile for `device` (profiles/gpu-dev.yaml, profiles/cpu-dev.yaml),
    with only what a bench run must set: the broker's port, private paths, the engines it
    serves, OCR off (the camera load is inspection) and the camera branch's batch for
    the load. Returns the profile's path and the changes made, for the result."""
    import yaml

    shipped = REPO / "profiles" / f"{SHIPPED[device]}.yaml"
    profile = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    cuda = device == "cuda"
    # What the run sets, as dotted profile keys; the result records the same keys, with
    # the engines by name and the directories left out.
    settings: dict[str, Any] = {
        "device_id": "bench",
        "broker.port": port,
        "paths": {
            "state_dir": str(workdir / "state"),
            "runtime_dir": str(workdir / "run"),
            "engine_dir": str(workdir / "engines"),
            "media_dir": str(REPO / "samples"),
        },
        "models.ocr.enabled": False,
        "models.inspect.engine": str(student),
        "models.inspect.max_batch": 32 if cuda else 8,
        "models.inspect.preferred_batch_sizes": [32] if cuda else [8],
        "models.qa.engine": str(text),
        "queue.max_size": 4096,
        "queue.memory_wait_ms": 50,
    }
    for dotted, value in settings.items():
        *parents, last = dotted.split(".")
        node = profile
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    changes = {
        **settings,
        "paths": "a private directory",
        "models.inspect.engine": student.name,
        "models.qa.engine": text.name,
    }
    path = workdir / "profile.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return path, {"shipped": SHIPPED[device], "changed": changes}


@dataclass
class Sent:
    task: str
    at: float
    deadline_ms: int | None
    doc: dict[str, Any] | None = None
    got_at: float | None = None


@dataclass
class Client:
    """An outside requester: MQTT v5, ResponseTopic and CorrelationData on every job."""

    port: int
    device_id: str = "bench"
    reply_topic: str = field(default_factory=lambda: f"bench/replies/{uuid.uuid4().hex}")
    sent: dict[bytes, Sent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self._cond = threading.Condition()
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"bench-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv5
        )
        self._client.on_message = self._on_message
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *a: subscribed.set()
        self._client.connect("127.0.0.1", self.port)
        self._client.loop_start()
        self._client.subscribe([(self.reply_topic, SubscribeOptions(qos=1))])
        if not subscribed.wait(10):
            raise TimeoutError("subscribe timed out")

    def _on_message(self, client: Any, userdata: object, msg: Any) -> None:
        corr = getattr(msg.properties, "CorrelationData", None)
        if corr is None:
            return
        doc = json.loads(msg.payload)
        if doc.get("status") == "partial":
            return
        with self._cond:
            entry = self.sent.get(bytes(corr))
            if entry is not None and entry.doc is None:
                entry.doc, entry.got_at = doc, time.monotonic()
            self._cond.notify_all()

    def send(self, task: str, job: dict[str, Any]) -> bytes:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        corr = uuid.uuid4().bytes
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = corr
        with self._cond:
            self.sent[corr] = Sent(task, time.monotonic(), job.get("deadline_ms"))
        self._client.publish(f"edge/{self.device_id}/jobs/{task}", json.dumps(job).encode(), qos=1, properties=props)
        return corr

    def wait(self, corrs: list[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(self.sent[c].doc is None for c in corrs):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sum(self.sent[c].doc is None for c in corrs)
                    raise TimeoutError(f"{missing} of {len(corrs)} jobs unanswered after {timeout:.0f} s")
                self._cond.wait(left)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def qa_job(job_id: str, device: str, load: Load, new_tokens: int, rng: random.Random, vocab: int) -> dict[str, Any]:
    if device == "cuda":
        words = " ".join(f"t{rng.randrange(1000, vocab)}" for _ in range(load.prompt_words))
        return {"id": job_id, "question": words, "max_new_tokens": new_tokens, "priority": 5}
    return {"id": job_id, "question": CPU_QUESTION, "context": CPU_CONTEXT, "max_new_tokens": new_tokens, "priority": 5}


def run_solo(client: Client, device: str, load: Load, vocab: int) -> list[dict[str, Any]]:
    """Questions one at a time: the decode rate of one sequence through the daemon."""
    rng = random.Random(1)
    outputs = []
    for i in range(load.solo_questions + 1):
        corr = client.send("qa", qa_job(f"solo-{i}", device, load, load.solo_new_tokens, rng, vocab))
        client.wait([corr], 300)
        doc = client.sent[corr].doc
        assert doc is not None and doc["status"] == "ok", doc
        if i:  # the first one warms the path up
            outputs.append(doc["output"])
    return outputs


def run_load(client: Client, device: str, load: Load, with_qa: bool, vocab: int, tag: str) -> dict[str, Any]:
    parts = sorted(p.name for p in (REPO / "samples" / "parts").glob("*.png"))
    stop = threading.Event()
    corrs: list[bytes] = []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def camera(cam: int) -> None:
        rng = random.Random(cam)
        time.sleep(rng.random() * load.period_s)
        while not stop.is_set():
            for _ in range(load.burst):
                n = next(counter)
                job = {
                    "id": f"{tag}-cam{cam}-{n}",
                    "image": {"path": f"parts/{parts[n % len(parts)]}"},
                    "priority": 1,
                    "deadline_ms": load.deadline_ms,
                }
                corr = client.send("inspect", job)
                with lock:
                    corrs.append(corr)
            stop.wait(load.period_s * (0.8 + 0.4 * rng.random()))

    def questions() -> None:
        rng = random.Random(2)
        n = 0
        while not stop.is_set():
            corr = client.send("qa", qa_job(f"{tag}-qa-{n}", device, load, load.qa_new_tokens, rng, vocab))
            with lock:
                corrs.append(corr)
            n += 1
            stop.wait(load.qa_every_s)

    threads = [threading.Thread(target=camera, args=(c,)) for c in range(load.cameras)]
    if with_qa:
        threads.append(threading.Thread(target=questions))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(load.seconds)
    stop.set()
    for t in threads:
        t.join()
    client.wait(corrs, 300)  # every job answered: nothing is dropped at the end of a run
    elapsed = time.monotonic() - t0
    tasks: dict[str, Any] = {}
    for task in ("inspect", "qa"):
        sent = [client.sent[c] for c in corrs if client.sent[c].task == task]
        if not sent:
            continue
        ok = [s for s in sent if s.doc is not None and s.doc["status"] == "ok"]
        e2e = [((s.got_at or s.at) - s.at) * 1000.0 for s in ok]
        own = [float(s.doc["timings"]["total_ms"]) for s in ok if s.doc is not None]
        missed = [
            s
            for s in sent
            if s.doc is None
            or s.doc["status"] != "ok"
            or (s.deadline_ms is not None and ((s.got_at or s.at) - s.at) * 1000.0 > s.deadline_ms)
        ]
        errors = sorted({s.doc["error"]["code"] for s in sent if s.doc is not None and s.doc["status"] != "ok"})
        tasks[task] = {
            "jobs": len(sent),
            "p50_ms": percentile(e2e, 0.5),
            "p99_ms": percentile(e2e, 0.99),
            "daemon_p50_ms": percentile(own, 0.5),
            "daemon_p99_ms": percentile(own, 0.99),
            "missed": len(missed),
            "errors": errors,
            "per_s": len(sent) / elapsed,
        }
        tasks[task].update(_where_time_went(ok, t0))
        if task == "inspect":
            sizes = [int(s.doc["output"]["batch_size"]) for s in ok if s.doc is not None]
            tasks[task]["mean_batch"] = statistics.mean(sizes) if sizes else 0.0
    return {"with_qa": with_qa, "seconds": elapsed, "tasks": tasks}


def _where_time_went(ok: list[Sent], t0: float) -> dict[str, Any]:
    """Where a task's latency went: in the daemon's queue, in its run (each stage), and
    outside its clock (the broker both ways, the intake before the clock starts and the
    responder after it stops); and when the slowest jobs were sent, so a stall shows as a
    cluster in time rather than as one p99."""
    docs = [(s, s.doc) for s in ok if s.doc is not None]
    outside = [((s.got_at or s.at) - s.at) * 1000.0 - float(d["timings"]["total_ms"]) for s, d in docs]
    stages: dict[str, list[float]] = {}
    for _, d in docs:
        for name, ms in d["timings"].get("stages", {}).items():
            stages.setdefault(name, []).append(float(ms))
    slowest = sorted(docs, key=lambda sd: (sd[0].got_at or sd[0].at) - sd[0].at, reverse=True)[:20]
    return {
        "outside_p50_ms": percentile(outside, 0.5),
        "outside_p99_ms": percentile(outside, 0.99),
        "stage_p99_ms": {name: percentile(values, 0.99) for name, values in stages.items()},
        "slowest": [
            {
                "sent_at_s": round(s.at - t0, 3),
                "e2e_ms": round(((s.got_at or s.at) - s.at) * 1000.0, 1),
                "daemon_ms": float(d["timings"]["total_ms"]),
                "queued_ms": float(d["timings"]["queued_ms"]),
            }
            for s, d in slowest
        ],
    }


def status(socket_path: Path) -> dict[str, Any]:
    from edge.health.status import query_status

    return query_status(socket_path, timeout=10)


def start_daemon(profile: Path, workdir: Path, timeout: float = 600) -> tuple[subprocess.Popen[bytes], Path]:
    import yaml

    data = yaml.safe_load(profile.read_text())
    sock = Path(data["paths"]["runtime_dir"]) / "status.sock"
    log = (workdir / "daemon.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.cli", "serve", "--profile", str(profile)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{(workdir / 'daemon.log').read_text()}")
        try:
            doc = status(sock)
            if doc.get("state") == "ready" and doc["broker"]["connected"]:
                return proc, sock
        except Exception:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"the daemon was not ready:\n{(workdir / 'daemon.log').read_text()}")


def kernel_decode(
    profile: Path, origin: dict[str, Any], device: str, load: Load, vocab: int, new_tokens: int
) -> dict[str, Any]:
    """The same engine without the daemon: the profile's qa section built by
    TextEngine.load as the daemon builds it, the same questions asked one at a time
    through its batcher, the decode rate as the daemon reports it (Sequence.tokens_per_s)."""
    from bench.text_engines import profile_engine
    from edge.text.runtime.generate import SamplingParams

    engine = profile_engine(profile, origin)
    rng = random.Random(1)
    rates = []
    for i in range(load.solo_questions + 1):
        job = qa_job(f"k{i}", device, load, new_tokens, rng, vocab)
        ids, prefix = engine.prompter.parts(job["question"], job.get("context"))
        seq = engine.generate(ids, SamplingParams(max_new_tokens=new_tokens), prefix=prefix)
        if i:  # as the daemon's: the first warms the path up
            rates.append(seq.tokens_per_s)
    config = engine.config()
    del engine
    return {
        "decode_tok_s": statistics.median(rates),
        "loop": "TextEngine.generate: the daemon's batcher, one sequence, no MQTT or scheduler",
        "engine_config": config,
    }


def _same_engine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The daemon's engine and the loop's resolved alike (where they came from aside)."""
    strip = ("origin",)
    return {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}


def profile_origin(changes: dict[str, Any], device: str) -> dict[str, Any]:
    """The profile changes as the qa section's origin: only models.qa.* fields count."""
    qa = {k.removeprefix("models.qa."): v for k, v in changes["changed"].items() if k.startswith("models.qa.")}
    return {"profile": changes["shipped"], "changed": qa}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    load = LOADS[device]
    if args.seconds:
        load = Load(**{**asdict(load), "seconds": args.seconds})
    workdir = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    broker = Broker(workdir, root=args.mosquitto_root, log=workdir / "mosquitto.log")
    broker.start()
    port = broker.port
    daemon = None
    try:
        text, student, models = prepare_engines(device, workdir, args.engine_dir, args.student_size)
        vocab = int(json.loads((text / "config.json").read_text())["vocab_size"])
        profile, profile_changes = write_profile(workdir, device, port, text, student)
        t0 = time.monotonic()
        daemon, sock = start_daemon(profile, workdir)
        start_s = time.monotonic() - t0
        print(f"daemon ready in {start_s:.0f} s", flush=True)
        loaded = status(sock)
        client = Client(port)
        solo = run_solo(client, device, load, vocab)
        alone = run_load(client, device, load, False, vocab, "alone")
        # The mixed load several times: its camera p99 has varied from run to run, and one
        # run would hide that. The figure is the median run's; every run is kept.
        mixed_runs = [run_load(client, device, load, True, vocab, f"mixed{i}") for i in range(args.repeats)]
        mixed = sorted(mixed_runs, key=lambda r: r["tasks"]["inspect"]["p99_ms"])[len(mixed_runs) // 2]
        final = status(sock)
        client.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        daemon = None
    finally:
        if daemon is not None:
            daemon.kill()
        broker.stop()
    prompt_tokens = int(statistics.median(o["prompt_tokens"] for o in solo))
    kernel = kernel_decode(profile, profile_origin(profile_changes, device), device, load, vocab, load.solo_new_tokens)
    memory = final["memory"]
    dev_name = "cpu"
    if device == "cuda":
        import torch

        dev_name = torch.cuda.get_device_name(0)
    else:
        import platform

        dev_name = platform.processor() or platform.machine()
    result = {
        "device": dev_name,
        "models": models,
        "load": asdict(load),
        "daemon_start_s": start_s,
        "decode_tok_s_daemon": statistics.median(o["decode_tokens_per_s"] for o in solo),
        "decode_tok_s_kernel": kernel["decode_tok_s"],
        "kernel_loop": kernel["loop"],
        # What the daemon's text engine resolved to (its status), the kernel loop's the same.
        # What the daemon's text engine resolved to (its status), with the profile it came
        # from and the qa fields the run changed; the kernel loop's must be the same.
        "engine_config": {**loaded["text_engine"], "origin": profile_origin(profile_changes, device)},
        "same_engine": _same_engine(loaded["text_engine"], kernel["engine_config"]),
        "profile": profile_changes,
        "solo": {
            "questions": len(solo),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": statistics.median(o["completion_tokens"] for o in solo),
            "prefill_ms": statistics.median(o["prefill_ms"] for o in solo),
        },
        "camera_p99_ms_alone": alone["tasks"]["inspect"]["p99_ms"],
        "camera_p99_ms_with_qa": mixed["tasks"]["inspect"]["p99_ms"],
        "process_peak_bytes": memory["process_peak_bytes"],
        "ledger_peak_bytes": memory["peak_bytes"],
        "budget_bytes": memory["budget_bytes"],
        "memory_scope": memory["scope"],
        "memory_at_ready": {k: loaded["memory"].get(k) for k in ("used_bytes", "device_bytes", "rss_bytes")},
        "models_in_status": loaded["models"],
        "kv": memory.get("kv"),
        "alone": alone,
        "with_qa": mixed,
        "with_qa_runs": [r["tasks"]["inspect"]["p99_ms"] for r in mixed_runs],
        "with_qa_all": mixed_runs,
        "branches": final["branches"],
    }
    result["served"] = is_served(result["engine_config"])
    result["decode_daemon_over_kernel"] = result["decode_tok_s_daemon"] / result["decode_tok_s_kernel"]
    result["camera_p99_ratio"] = result["camera_p99_ms_with_qa"] / result["camera_p99_ms_alone"]
    result["ledger_over_process_peak"] = result["ledger_peak_bytes"] / result["process_peak_bytes"]
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def print_result(r: dict[str, Any]) -> None:
    print(f"{r['device']}: {r['models']}; budget {r['budget_bytes'] / GIB:.1f} GiB ({r['memory_scope']})")
    print("| run | task | jobs | p50 ms | p99 ms | daemon p99 ms | missed | jobs/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in ("alone", "with_qa"):
        for task, t in r[name]["tasks"].items():
            print(
                f"| {name} | {task} | {t['jobs']} | {t['p50_ms']:.0f} | {t['p99_ms']:.0f} | {t['daemon_p99_ms']:.0f} "
                f"| {t['missed']} | {t['per_s']:.1f} |"
            )
    print(
        f"decode through the daemon {r['decode_tok_s_daemon']:.1f} tok/s, bare loop {r['decode_tok_s_kernel']:.1f} "
        f"tok/s: {r['decode_daemon_over_kernel']:.2f}x (target >= 0.95x)"
    )
    print(f"camera p99 with Q&A / alone: {r['camera_p99_ratio']:.2f}x (target <= 2x), the median of runs at "
          + ", ".join(f"{ms:.0f}" for ms in r["with_qa_runs"]) + " ms")  # fmt: skip
    for name in ("alone", "with_qa"):
        cam = r[name]["tasks"]["inspect"]
        print(f"  {name}: camera outside the daemon's clock p99 {cam['outside_p99_ms']:.0f} ms; stage p99s "
              + ", ".join(f"{k} {v:.0f}" for k, v in cam["stage_p99_ms"].items()))  # fmt: skip
    print(
        f"process peak {r['process_peak_bytes'] / GIB:.2f} GiB, ledger peak {r['ledger_peak_bytes'] / GIB:.2f} GiB "
        f"({r['ledger_over_process_peak']:.2f} of the measured peak), budget {r['budget_bytes'] / GIB:.1f} GiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("--seconds", type=float, default=None, help="length of each load run")
    parser.add_argument("--mosquitto-root", type=Path, default=None, help="where mosquitto's .debs were unpacked")
    parser.add_argument("--engine-dir", type=Path, default=REPO / ".edge" / "engines", help="cpu: built engines")
    parser.add_argument("--student-size", default="default", help="cpu: the student build to serve")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the mixed load (the median is the figure)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args)
    out = args.out or RESULTS / f"daemon_{args.device}.json"
    write_json(out, result)
    print_result(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
