#!/usr/bin/env python3
"""`edgectl profile` of an 8B-shape Q&A engine under load, as the daemon builds and serves it.

`run` does what an operator would, each step the project's own command:
1. a random-weight Llama-3-8B-shape GGUF with every matrix Q4_0 (bench/random_gguf.py, the
   llama.cpp peer's writer, with a byte-level BPE vocabulary and chat template so the
   questions tokenize as a real model's would);
2. a profile derived from profiles/gpu-dev.yaml: its Q&A model alone, `source:` that file,
   `adapter: none`, engines, state and run directories under the work directory;
3. `edgectl build --profile` (a file whose block linears are all Q4_0 is kept as stored:
   its codes repacked, nothing rounded again; engines/text/gguf_int4.py);
4. `edgectl profile --workload qa --jobs N` with more jobs than the profile's
   `max_sequences`, so the continuous batcher keeps its rows full and queues the rest.

It writes OUT/profile.json (and the heat maps where matplotlib is installed) and OUT/run.json
(each step's command, exit status and seconds). `adopt` checks a CUDA run's profile.json
and keeps it as bench/results/profile_cuda.json, from which `python -m bench.render` draws
the heat maps on the documentation's pages. Speed and bandwidth only: the weights are random.

    python -m bench.profile_8b run --out /tmp/profile8b                      # the 8B shape, on CUDA
    python -m bench.profile_8b run --shape tiny --device cpu --out /tmp/p   # the same flow in seconds
    python -m bench.profile_8b adopt /tmp/profile8b/profile.json             # bench/results/profile_cuda.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from bench.common import REPO, RESULTS, write_json

if TYPE_CHECKING:
    from edge.text.architecture import LlamaConfig

BASE_PROFILE = REPO / "profiles" / "gpu-dev.yaml"
# Each shape by name; the 8B one is what is measured, the tiny one runs the same flow on a CPU.
SHAPE_NAMES = ("llama3-8b", "tiny")
MEASURED_SHAPE = "llama3-8b"
RESULT = RESULTS / "profile_cuda.json"
DEFAULT_JOBS = 16


def shape(name: str) -> LlamaConfig:
    """The LlamaConfig of a shape name (imported here: torch comes with it)."""
    from dataclasses import replace

    from engines.text.random_llama import LLAMA3_8B

    if name == "llama3-8b":
        return LLAMA3_8B
    if name == "tiny":
        # The 8B model's vocabulary (so its prompts are the same tokens), narrow layers of
        # whole Q4_0 blocks.
        return replace(LLAMA3_8B, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                       max_position=4096)  # fmt: skip
    raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPE_NAMES)}")


def device_id(shape_name: str) -> str:
    """The derived profile's device_id, which the document keeps (workload.profile): the
    GPU profile's own, and the model's shape."""
    base = yaml.safe_load(BASE_PROFILE.read_text(encoding="utf-8"))
    return f"{base['device_id']}-{shape_name}"


def gguf_name(shape_name: str) -> str:
    return f"random-{shape_name}-q4_0.gguf"


def derived_profile(gguf: Path, work: Path, shape_name: str, device: str) -> dict[str, Any]:
    """profiles/gpu-dev.yaml with its Q&A model alone, serving `gguf` with no adapter; its
    directories under `work`. `device` other than cuda: the same profile on that device
    (the flow checked on a CPU)."""
    doc: dict[str, Any] = yaml.safe_load(BASE_PROFILE.read_text(encoding="utf-8"))
    doc["device_id"] = device_id(shape_name)
    models = doc["models"]
    models["ocr"]["enabled"] = False
    models["inspect"]["enabled"] = False
    qa = models["qa"]
    qa.update(enabled=True, source=str(gguf), adapter="none")
    if device != "cuda":
        qa["device"] = device
    doc["paths"] = {
        "state_dir": str(work / "state"),
        "runtime_dir": str(work / "run"),
        "engine_dir": str(work / "engines"),
        "media_dir": str(REPO / "samples"),
    }
    return doc


def _step(name: str, cmd: list[str], log: Path, steps: list[dict[str, Any]]) -> bool:
    """One command, its output to `log` (and the last lines to stderr), timed."""
    print(f"{name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - started
    steps.append({"step": name, "command": cmd, "exit_code": done.returncode, "seconds": round(seconds, 1)})
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-8:]
    print("\n".join(f"  {line}" for line in tail), file=sys.stderr, flush=True)
    print(f"{name}: exit {done.returncode} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return done.returncode == 0


def run(shape_name: str, device: str, jobs: int, work: Path, out: Path) -> int:
    """The whole flow; 0 when every step succeeded and profile.json was written."""
    from bench.random_gguf import write_q4_0_gguf

    config = shape(shape_name)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []
    gguf = work / gguf_name(shape_name)
    started = time.monotonic()
    # Written whole or not at all (a temporary name renamed): a file here is a whole one,
    # kept from an earlier call on the same machine.
    written = not gguf.exists()
    if written:
        print(f"writing {gguf}", file=sys.stderr, flush=True)
        write_q4_0_gguf(gguf, config, vocabulary="llama3")
    steps.append({"step": "gguf", "written": written, "bytes": gguf.stat().st_size,
                  "seconds": round(time.monotonic() - started, 1)})  # fmt: skip
    profile = work / "profile.yaml"
    profile.write_text(yaml.safe_dump(derived_profile(gguf, work, shape_name, device)), encoding="utf-8")
    python = sys.executable
    ok = _step("build", [python, "-m", "edge.cli", "build", "--profile", str(profile)], out / "build.log", steps)
    if ok:
        cmd = [python, "-m", "edge.cli", "profile", "--profile", str(profile), "--workload", "qa",
               "--jobs", str(jobs), "--out", str(out)]  # fmt: skip
        # Without matplotlib (a GPU machine may lack it) the document alone; its heat maps
        # are drawn from it elsewhere (`edgectl profile --draw`, or bench.render).
        if importlib.util.find_spec("matplotlib") is None:
            cmd.append("--no-png")
        ok = _step("profile", cmd, out / "profile.log", steps)
    run_doc = {"shape": shape_name, "device": device, "jobs": jobs, "profile": str(profile), "steps": steps}
    write_json(out / "run.json", run_doc)
    if not ok or not (out / "profile.json").is_file():
        print(f"profile_8b: a step failed; see {out}/*.log", file=sys.stderr)
        return 1
    print(f"profile_8b: wrote {out / 'profile.json'}", file=sys.stderr)
    return 0


def concurrency(jobs: list[dict[str, Any]]) -> int:
    """The most jobs running at one time, from each job's start and length."""
    edges = sorted([(j["start_s"], 1) for j in jobs] + [(j["start_s"] + j["seconds"], -1) for j in jobs])
    running = most = 0
    for _, step in edges:  # an end sorts before a start at the same time
        running += step
        most = max(most, running)
    return most


class NotAdoptable(ValueError):
    """A profile document that is not the measured CUDA run."""


def check_measured(doc: dict[str, Any]) -> None:
    """That `doc` is `run`'s document of the measured shape on CUDA, every job answered,
    several at once; NotAdoptable says what is not."""
    workload = doc.get("workload") or {}
    expected = device_id(MEASURED_SHAPE)
    problems = []
    if doc.get("mode") != "workload" or workload.get("task") != "qa":
        problems.append("not a qa workload's profile")
    if doc.get("device", {}).get("backend") != "cuda":
        problems.append(f"run on {doc.get('device', {}).get('backend')!r}, not cuda")
    if workload.get("profile") != expected:
        problems.append(
            f"profile {workload.get('profile')!r}, not {expected!r} (bench/profile_8b.py's {MEASURED_SHAPE})"
        )
    jobs = doc.get("jobs", [])
    if len(jobs) != workload.get("jobs") or any(j.get("status") != "ok" for j in jobs):
        problems.append("not every job was answered")
    elif concurrency(jobs) < 2:
        problems.append("no two jobs ran at once: the batcher was not under load")
    if problems:
        raise NotAdoptable("; ".join(problems))


def adopt(path: Path, to: Path = RESULT) -> Path:
    """`path` (a run's profile.json) checked against the schema and as the measured run,
    written to `to` unchanged."""
    import jsonschema

    from edge.profiling import document

    doc = document.read(path)
    schema = json.loads((REPO / "docs" / "schemas" / "profile.schema.json").read_text(encoding="utf-8"))
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as err:
        raise NotAdoptable(f"{path}: not valid against docs/schemas/profile.schema.json: {err.message}") from err
    check_measured(doc)
    write_json(to, doc, indent=1)
    return to


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="write the GGUF, build it, profile qa jobs")
    r.add_argument("--shape", choices=SHAPE_NAMES, default=MEASURED_SHAPE)
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    r.add_argument("--work", type=Path, default=Path("/tmp/edge-profile8b"), help="the GGUF, profile and engines")
    r.add_argument("--out", type=Path, required=True, help="profile.json, run.json and the steps' logs")
    a = sub.add_parser("adopt", help="keep a CUDA run's profile.json as bench/results/profile_cuda.json")
    a.add_argument("profile_json", type=Path)
    a.add_argument("--to", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.shape, args.device, args.jobs, args.work, args.out)
    try:
        written = adopt(args.profile_json, args.to)
    except ValueError as err:  # NotAProfile, NotAdoptable
        print(f"profile_8b: {err}", file=sys.stderr)
        return 2
    print(f"profile_8b: wrote {written}; `python -m bench.render` draws its heat maps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
