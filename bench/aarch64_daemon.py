"""The daemon's CPU path on aarch64: `edgectl serve` run by an arm64 Python under
qemu-user, answering one OCR, one inspect and one qa job sent through a real Mosquitto.
bench/check_aarch64.py runs it (`--only daemon`); see its docstring for the emulation.

The arm64 site holds every runtime pin of pyproject.toml as its aarch64 wheel, torch
included (PyPI's torch 2.13.0 for aarch64 is the CUDA 13 build, with its CUDA libraries
as dependencies; without a GPU or a driver it runs on the CPU), except systemd-python (no
wheel; a box builds it from source, and the daemon notifies without it). The engines are
built here, once, into the work folder: they are files for any CPU (safetensors, ONNX,
JSON). The broker is this machine's mosquitto: it carries the jobs, it is not what is
checked.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.check_aarch64 import aarch64_site
from bench.common import REPO, Broker, free_port
from scripts.jetson_requirements import FROM_SOURCE, LEFT_OUT, name_of, pins

SAMPLES = REPO / "samples"
OCR_LABEL = "label_02.png"
PART = "part_01_scratch.png"
QUESTION = "When is the clinic open on Saturdays?"
CONTEXT = "The clinic is open 8 am to 6 pm on weekdays and 9 am to 1 pm on Saturdays."
NEW_TOKENS = 16
READY_S = 3600.0  # the first start under emulation measures OCR's working memory: 25 min here
JOB_S = 1800.0
# manylinux tags a glibc 2.36 (Debian 12) loads: torch's CUDA libraries use several
PLATFORMS = ("manylinux2014_aarch64", *(f"manylinux_2_{minor}_aarch64" for minor in range(17, 37)))
# sysfs as an arm64 kernel shows it for two Cortex-A78AE cores (an Orin's), under the
# tree: qemu-user looks a path up in its -L tree first. torch's cpuinfo reads the cores'
# MIDR, clusters and caches there and crashes on the host's x86 layout.
MIDR = "0x00000000411fd421"
CACHES = (("0", "1", "64K", "Data"), ("1", "1", "64K", "Instruction"), ("2", "2", "256K", "Unified"))


def runtime_pins() -> list[str]:
    """pyproject's runtime pins that a CPU aarch64 box installs from PyPI: the Jetson set
    (requirements/jetson.txt) with torch, less what has no wheel."""
    dropped = (set(LEFT_OUT) - {"torch"}) | FROM_SOURCE
    return [r for r in pins()[0] if name_of(r) not in dropped]


def daemon_site(work: Path) -> Path:
    """The runtime's aarch64 wheels, with their dependencies, installed into work/site-daemon."""
    return aarch64_site(
        work / "site-daemon",
        runtime_pins(),
        "the runtime's aarch64 wheels (torch's CUDA libraries among them: about 5 GB)",
        PLATFORMS,
    )


def arm64_sysfs(tree: Path, cores: int) -> None:
    """The cores' sysfs entries torch's cpuinfo reads, as an arm64 kernel writes them."""
    every = f"0-{cores - 1}"
    for i in range(cores):
        cpu = tree / "sys" / "devices" / "system" / "cpu" / f"cpu{i}"
        files = {
            "regs/identification/midr_el1": MIDR,
            "regs/identification/revidr_el1": "0x0000000000000000",
            "topology/physical_package_id": "0",
            "topology/cluster_cpus_list": every,
            "topology/package_cpus_list": every,
            "topology/core_siblings_list": every,
            "topology/core_cpus_list": str(i),
            "topology/thread_siblings_list": str(i),
            "cpufreq/cpuinfo_max_freq": "2201600",
            "cpufreq/cpuinfo_min_freq": "115200",
            "cache/index3/level": "3",
            "cache/index3/size": "2048K",
            "cache/index3/type": "Unified",
            "cache/index3/shared_cpu_list": every,
        }
        for index, level, size, kind in CACHES:
            files |= {
                f"cache/index{index}/level": level,
                f"cache/index{index}/size": size,
                f"cache/index{index}/type": kind,
                f"cache/index{index}/shared_cpu_list": str(i),
            }
        for name, text in files.items():
            (cpu / name).parent.mkdir(parents=True, exist_ok=True)
            (cpu / name).write_text(text + "\n")


def arm64_cc(work: Path, tree: Path) -> Path:
    """A C compiler for the daemon's CPU INT4 kernel: the tree's GCC, each of its programs
    under qemu. A program under qemu-user cannot run another arm64 program (that takes
    binfmt_misc, which a container does not have), so GCC finds, first on its -B path,
    scripts of this machine that run cc1, as, collect2 and ld under qemu."""
    bin_dir = work / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    gcc_lib = tree / "usr" / "lib" / "gcc" / "aarch64-linux-gnu" / "12"
    programs = {
        "cc": (tree / "usr" / "bin" / "gcc-12", f'-B "{bin_dir}/" '),
        "cc1": (gcc_lib / "cc1", ""),
        "collect2": (gcc_lib / "collect2", ""),
        "as": (tree / "usr" / "bin" / "as", ""),
        "ld": (tree / "usr" / "bin" / "ld.bfd", ""),
    }
    for name, (program, extra) in programs.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec qemu-aarch64 -L "{tree}" "{program}" {extra}"$@"\n')
        script.chmod(0o755)
    return bin_dir / "cc"


def build_engines(engine_dir: Path) -> dict[str, str]:
    """The three tasks' engines, built here (cached by their inputs)."""
    from engines.retrieval.embed_build import build_embedder
    from engines.text.text_build import build_text_engine
    from engines.vision.vision_build import build_student

    text = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    student = build_student(engine_dir, "quick", progress=False)
    build_embedder(engine_dir)
    return {"qa": text.name, "inspect": student.name}


def write_profile(side: Path, port: int, engine_dir: Path) -> Path:
    """profiles/cpu-dev.yaml with the paths in the work folder, the broker's port, the
    smoke-size student and short answers: emulation is 10-50x slower."""
    import yaml

    profile = yaml.safe_load((REPO / "profiles" / "cpu-dev.yaml").read_text(encoding="utf-8"))
    profile["device_id"] = "arm64"
    profile["broker"]["port"] = port
    profile["models"]["inspect"]["build_size"] = "quick"
    profile["models"]["qa"] |= {"max_new_tokens": NEW_TOKENS, "max_context_tokens": 512}
    profile["build_missing_engines"] = False  # a missing engine is a setup error here, not a build under qemu
    profile["metrics"] = {"listen": f"127.0.0.1:{free_port()}"}
    profile["paths"] = {
        "state_dir": str(side / "state"),
        "runtime_dir": str(side / "run"),
        "engine_dir": str(engine_dir),
        "media_dir": str(SAMPLES),
    }
    path = side / "profile.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return path


def wait_ready(proc: subprocess.Popen[bytes], sock: Path, log: Path) -> dict[str, Any]:
    from edge.health.status import StatusUnreachable, query_status

    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the arm64 daemon exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            doc = query_status(sock, timeout=30)
            if doc.get("state") == "ready" and doc["broker"]["connected"]:
                return doc
        except StatusUnreachable:
            pass  # not listening yet
        time.sleep(2)
    raise SystemExit(f"the arm64 daemon was not ready after {READY_S:.0f} s:\n{log.read_text()[-4000:]}")


def excerpt(task: str, doc: dict[str, Any]) -> dict[str, Any]:
    """What the job answered, briefly."""
    if doc.get("status") != "ok":
        return {"error": doc.get("error")}
    out = doc["output"]
    if task == "ocr":
        labels = json.loads((SAMPLES / "labels" / "labels.json").read_text())
        want = next(lab["lines"] for lab in labels if lab["name"] == OCR_LABEL)
        lines = [line["text"] for line in out["lines"]]
        return {"lines": lines, "lines_as_printed": lines == want}
    if task == "inspect":
        return {"class": out["class"], "score": round(float(out["score"]), 4), "defect": out["defect"]}
    return {
        "answer": out["answer"][:120],
        "completion_tokens": out["completion_tokens"],
        "prompt_tokens": out["prompt_tokens"],
        "finish_reason": out["finish_reason"],
    }


def send_jobs(port: int) -> list[dict[str, Any]]:
    """One job of each task, one at a time, through the broker; the answers."""
    from bench.daemon import Client

    jobs: list[tuple[str, dict[str, Any]]] = [
        ("ocr", {"id": "arm64-ocr", "image": {"path": f"labels/{OCR_LABEL}"}}),
        ("inspect", {"id": "arm64-inspect", "image": {"path": f"parts/{PART}"}}),
        ("qa", {"id": "arm64-qa", "question": QUESTION, "context": CONTEXT, "max_new_tokens": NEW_TOKENS}),
    ]
    client = Client(port, device_id="arm64")
    done = []
    try:
        for task, job in jobs:
            print(f"aarch64 daemon: {task} job", flush=True)
            t0 = time.monotonic()
            corr = client.send(task, job)
            try:
                client.wait([corr], JOB_S)
            except TimeoutError:
                done.append({"task": task, "job_id": job["id"], "status": "unanswered", "elapsed_s": JOB_S})
                continue
            doc = client.sent[corr].doc or {}
            done.append(
                {
                    "task": task,
                    "job_id": doc.get("id"),
                    "status": doc.get("status"),
                    "elapsed_s": round(time.monotonic() - t0, 1),
                    "daemon_total_ms": doc.get("timings", {}).get("total_ms"),
                    "output": excerpt(task, doc),
                }
            )
    finally:
        client.close()
    return done


def arm64_run(python: list[str], env: dict[str, str], code: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*python, *code], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def run_daemon(work: Path, tree: Path, python: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The daemon part: returns the result's keys (`jobs` among them)."""
    site = daemon_site(work)
    arm64_sysfs(tree, os.cpu_count() or 1)
    engine_dir = work / "engines"
    engines = build_engines(engine_dir)
    side = work / "daemon"
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    arm_env = {
        **env,
        "PYTHONPATH": f"{site}:{REPO}",
        "PYTHONUNBUFFERED": "1",
        "EDGE_KERNEL_CACHE": str(side / "kernels"),
        "CC": str(arm64_cc(work, tree)),
    }
    print("aarch64: the runtime's versions, and jetson_check", flush=True)
    versions = arm64_run(
        python,
        arm_env,
        ["-c", "import json, platform, torch, onnxruntime, numpy; print(json.dumps({'machine': platform.machine(), "
         "'python': platform.python_version(), 'libc': '-'.join(platform.libc_ver()), 'torch': torch.__version__, "
         "'torch_cuda_available': torch.cuda.is_available(), 'onnxruntime': onnxruntime.__version__, "
         "'numpy': numpy.__version__}))"],
    )  # fmt: skip
    if versions.returncode != 0:
        raise SystemExit(f"the arm64 Python cannot import the runtime:\n{versions.stderr[-3000:]}")
    check = arm64_run(python, arm_env, [str(REPO / "scripts" / "jetson_check.py")])
    said = (check.stdout + check.stderr).strip().splitlines()
    broker = Broker(side, log=side / "mosquitto.log")
    broker.start()
    log = side / "daemon.log"
    profile = write_profile(side, broker.port, engine_dir)
    proc = None
    try:
        print("aarch64: edgectl serve (the daemon's start under emulation takes minutes)", flush=True)
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*python, "-m", "edge.cli", "serve", "--profile", str(profile)],
                cwd=REPO, env=arm_env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        ready = wait_ready(proc, side / "run" / "status.sock", log)
        ready_s = time.monotonic() - t0
        jobs = send_jobs(broker.port)
        from edge.health.status import query_status

        status = query_status(side / "run" / "status.sock", timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        broker.stop()
    text_engine = status.get("text_engine") or ready.get("text_engine") or {}
    return {
        "jobs": jobs,
        "daemon": {
            "what": "edgectl serve (profiles/cpu-dev.yaml, paths and broker port set, inspect's student at "
            "quick size, qa's answers 16 tokens) by the arm64 Python under qemu-user; jobs sent from this "
            "machine through its mosquitto",
            "emulated": True,
            "host": platform.machine(),
            "arm64": json.loads(versions.stdout.strip().splitlines()[-1]),
            "torch_build": "PyPI's torch 2.13.0 aarch64 wheel: the CUDA 13 build (PyPI has no CPU-only one), "
            "on the CPU: no GPU under qemu",
            "left_out": {name: "no wheel; built from source on a box (setup.sh)" for name in sorted(FROM_SOURCE)},
            "broker": "this machine's mosquitto (the broker carries the jobs; it is not what is checked)",
            "engines": engines,
            "ready_s": round(ready_s, 1),
            "qa_kernel": text_engine.get("kernel"),
            "text_engine": text_engine,
            "jetson_check": {"exit": check.returncode, "said": said[-3:]},
        },
    }
