"""On aarch64, emulated: retrieval (`edgectl docs add` and the retriever: the encoder on
onnxruntime, the tokenizer, the faiss index) run by an arm64 Python under qemu-user beside
the same run by this machine's Python, and compared; and the daemon's CPU path
(`edgectl serve`) run by that arm64 Python, answering one `ocr`, one `inspect` and one
`qa` job sent through a real Mosquitto (bench/aarch64_daemon.py).

    python -m bench.check_aarch64 [--work /var/tmp/edge-aarch64] [--only retrieval|daemon]

Needs, the first time, network and root on a Debian or Ubuntu host with
`apt-get install qemu-user mmdebstrap mosquitto`: it unpacks Debian 12 for arm64 (Python
3.11, glibc 2.36, GCC 12 for the CPU INT4 kernel) into the work folder and installs there
the project's pinned aarch64 wheels as pip downloads them for that platform: for
retrieval, its path's (numpy, onnxruntime, tokenizers, faiss-cpu, pypdf, PyYAML,
pydantic), without torch (the retrieval path does not import it, and a Jetson takes
NVIDIA's build of it); for the daemon, a site of its own with every runtime pin, torch
included, less systemd-python (no wheel) (about 5 GB: PyPI's aarch64 torch is the CUDA build, with CUDA's libraries).

Retrieval, in each Python, from a fresh state directory: `edgectl docs add` of
samples/leaflets into a collection (the encoder built once here: one ONNX file for any
CPU), then this script's `probe` command: the collection's chunk ids, fixed texts'
embeddings, the retriever's passages for fixed questions, and the HNSW index's recall@10
against the exact scan over seeded random unit vectors.

The daemon: the engines built here (files for any CPU), profiles/cpu-dev.yaml with its
paths in the work folder, this machine's mosquitto as the broker, the jobs sent from this
machine's Python; `scripts/jetson_check.py` run by the arm64 Python too (it must say the
box is no Jetson).

Writes bench/results/aarch64.json (a part run alone keeps the other's keys; the daemon's
are `jobs` and `daemon`) and prints a table. Emulated: the times say nothing of a real
arm64 CPU's speed.

qemu-user shows a program the host's /proc/cpuinfo, which onnxruntime's CPU probe
(cpuinfo) cannot parse as an arm64 one: it crashes on import. So the arm64 side runs in
a mount namespace of its own (unshare, root) where /proc/cpuinfo is the one an arm64
kernel writes for the AGX Orin's Cortex-A78AE cores; torch's newer cpuinfo also reads the
cores' sysfs (MIDR, clusters, caches), given to it in the tree (qemu looks paths up
there first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, write_json
from scripts.jetson_requirements import pins as pinned

SUITE = "bookworm"  # Debian 12: Python 3.11, the project's lowest
PYTHON = "python3.11"
MIRROR = "http://deb.debian.org/debian"
# gcc and libc6-dev: the CPU INT4 kernel (edge/text/ops/cpu/cpu_int4.c) is compiled at first use
TREE_PACKAGES = (
    "python3.11", "libpython3.11-stdlib", "libstdc++6", "libgomp1", "ca-certificates", "gcc", "libc6-dev",
)  # fmt: skip
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_27_aarch64", "manylinux_2_28_aarch64")
RETRIEVAL = ("numpy", "onnxruntime", "tokenizers", "faiss-cpu", "pypdf", "pyyaml", "pydantic")
COLLECTION = "clinic"
LEAFLETS = REPO / "samples" / "leaflets"
TEXTS = ["Pump alarm", "When is the pharmacy open on Saturdays?", "Change the dressing every 48 hours."]
QUESTIONS = ["When is the pharmacy open on Saturdays?", "Who may visit on ward 2?", "What does the pump alarm mean?"]
# /proc/cpuinfo of an arm64 kernel, a block a core: Cortex-A78AE (implementer 0x41, part 0xd42)
CPUINFO_CORE = """processor\t: {i}
BogoMIPS\t: 62.50
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd42
CPU revision\t: 1
"""
HNSW_VECTORS = 10_000
HNSW_QUERIES = 200
HNSW_K = 10


def pins() -> list[str]:
    """The retrieval path's requirements as pyproject.toml pins them."""
    deps = pinned()[0]
    chosen = [d for d in deps if d.split("==")[0].lower() in RETRIEVAL]
    missing = set(RETRIEVAL) - {d.split("==")[0].lower() for d in chosen}
    if missing:
        raise SystemExit(f"pyproject.toml pins none of {sorted(missing)}")
    return chosen


def arm64_tree(work: Path) -> Path:
    """Debian for arm64 unpacked into work/tree (no package scripts run: qemu runs its
    Python with the tree as its root for libraries)."""
    tree = work / "tree"
    if not all((tree / "usr" / "bin" / tool).exists() for tool in (PYTHON, "gcc")):
        for tool in ("mmdebstrap", "qemu-aarch64"):
            if shutil.which(tool) is None:
                raise SystemExit(f"{tool} is missing: apt-get install qemu-user mmdebstrap")
        shutil.rmtree(tree, ignore_errors=True)
        print(f"unpacking Debian {SUITE} for arm64 into {tree}", flush=True)
        subprocess.run(
            ["mmdebstrap", "--arch=arm64", "--variant=extract", f"--include={','.join(TREE_PACKAGES)}", SUITE,
             str(tree), MIRROR],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return tree


def aarch64_site(site: Path, requirements: list[str], what: str, platforms: tuple[str, ...] = PLATFORMS) -> Path:
    """`requirements`' aarch64 wheels for `platforms`, with their dependencies, installed
    into `site` (once: a stamp of the requirements says what is there)."""
    stamp = site / ".pins"
    wanted = "\n".join(requirements)
    if stamp.exists() and stamp.read_text() == wanted:
        return site
    shutil.rmtree(site, ignore_errors=True)
    target = [arg for p in platforms for arg in ("--platform", p)]
    target += ["--python-version", "3.11", "--implementation", "cp", "--only-binary=:all:"]
    print(f"installing {what}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts", "--target", str(site), *target,
         *requirements],
        check=True,
    )  # fmt: skip
    stamp.write_text(wanted)
    return site


def arm64_site(work: Path) -> Path:
    """The retrieval path's pinned aarch64 wheels, installed into work/site."""
    return aarch64_site(work / "site", pins(), "the retrieval path's aarch64 wheels: " + ", ".join(pins()))


def probe(profile_path: Path, out: Path) -> None:
    """In whichever Python runs it: what the collection holds and what retrieval returns."""
    import numpy as np

    from edge.config.loader import load_profile
    from edge.docs import index
    from edge.docs.embed import Embedder, locate
    from edge.docs.retrieve import Retriever
    from edge.docs.store import DocStore

    profile = load_profile(profile_path)
    store = DocStore(profile.paths.state_dir / "docs")
    version = store.current(COLLECTION)
    assert version is not None, "the collection was not added"
    chunks = store.version_dir(COLLECTION, version) / "chunks.jsonl"
    ids = [json.loads(line)["id"] for line in chunks.read_text().splitlines() if line.strip()]
    embedder = Embedder.load(locate(profile.paths.engine_dir), "onnxruntime", 2)
    vectors = embedder.embed(TEXTS)
    retriever = Retriever(store, embedder)
    passages = {}
    for question in QUESTIONS:
        found, _ = retriever.search(COLLECTION, question, 3)
        passages[question] = [{"id": p.id, "score": p.score} for p in found]
    index.set_threads(2)
    rng = np.random.default_rng(7)
    base = rng.standard_normal((HNSW_VECTORS, 384)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = base[:HNSW_QUERIES] + 0.1 * rng.standard_normal((HNSW_QUERIES, 384)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    t0 = time.perf_counter()
    hnsw, _ = index.build(base, "hnsw")
    built_s = time.perf_counter() - t0
    flat, _ = index.build(base, "flat")
    _, want = flat.search(queries, HNSW_K)  # type: ignore[attr-defined]
    _, got = hnsw.search(queries, HNSW_K)  # type: ignore[attr-defined]
    recall = float(np.mean([len(set(g) & set(w)) / HNSW_K for g, w in zip(got, want, strict=True)]))
    import faiss
    import onnxruntime
    import tokenizers

    out.write_text(
        json.dumps(
            {
                "machine": platform.machine(),
                "python": platform.python_version(),
                "libc": "-".join(platform.libc_ver()),
                "versions": {
                    "numpy": np.__version__,
                    "onnxruntime": onnxruntime.__version__,
                    "faiss-cpu": faiss.__version__,
                    "tokenizers": tokenizers.__version__,
                },
                "chunk_ids": ids,
                "embeddings": vectors.tolist(),
                "passages": passages,
                "hnsw_recall_at_10": recall,
                "hnsw_build_s": built_s,
            }
        )
    )


def _run_side(name: str, python: list[str], env: dict[str, str], work: Path, engine_dir: Path) -> dict[str, Any]:
    """edgectl docs add, then the probe, in one Python from a fresh state directory."""
    import yaml

    side = work / name
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    profile = side / "profile.yaml"
    paths = {"state_dir": side / "state", "runtime_dir": side / "run", "engine_dir": engine_dir, "media_dir": REPO}
    profile.write_text(yaml.safe_dump({"device_id": name, "paths": {k: str(v) for k, v in paths.items()}}))
    t0 = time.perf_counter()
    add = subprocess.run(
        [*python, "-m", "edge.cli", "docs", "add", "--profile", str(profile), "--collection", COLLECTION,
         str(LEAFLETS)],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    add_s = time.perf_counter() - t0
    if add.returncode != 0:
        raise SystemExit(f"{name}: edgectl docs add failed:\n{add.stderr[-3000:]}")
    out = side / "probe.json"
    t0 = time.perf_counter()
    run = subprocess.run(
        [*python, "-m", "bench.check_aarch64", "probe", "--profile", str(profile), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"{name}: the probe failed:\n{run.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(out.read_text())
    got.update({"docs_add_s": add_s, "probe_s": time.perf_counter() - t0, "docs_add_said": add.stdout.splitlines()})
    return got


def compare(native: dict[str, Any], arm: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    top_same = all([p["id"] for p in native["passages"][q]] == [p["id"] for p in arm["passages"][q]] for q in QUESTIONS)
    score_diff = max(
        abs(a["score"] - b["score"])
        for q in QUESTIONS
        for a, b in zip(native["passages"][q], arm["passages"][q], strict=False)
    )
    return {
        "chunk_ids_equal": native["chunk_ids"] == arm["chunk_ids"],
        "chunks": len(arm["chunk_ids"]),
        "passages_equal": top_same,
        "embedding_max_diff": float(np.abs(np.array(native["embeddings"]) - np.array(arm["embeddings"])).max()),
        "score_max_diff": score_diff,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("probe", help="(run by each Python) what the collection holds and what retrieval returns")
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/edge-aarch64"), help="tree, wheels and runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "aarch64.json")
    parser.add_argument("--only", choices=("retrieval", "daemon"), help="run one part (default: both)")
    args = parser.parse_args()
    if args.command == "probe":
        probe(args.profile, args.out)
        return 0
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = arm64_tree(work)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "OMP_"))}
    cpuinfo = work / "cpuinfo"
    cpuinfo.write_text("\n".join(CPUINFO_CORE.format(i=i) for i in range(os.cpu_count() or 1)))
    in_namespace = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /proc/cpuinfo && exec "$@"', str(cpuinfo)]
    arm_python = [*in_namespace, "qemu-aarch64", str(tree / "usr" / "bin" / PYTHON)]
    arm_env = {**env, "QEMU_LD_PREFIX": str(tree)}
    # Each part replaces its own keys: the other part's stay as its last run wrote them.
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    ok = True
    if args.only in (None, "retrieval"):
        retrieval, ok = run_retrieval(work, tree, arm_python, env, arm_env)
        result.update(retrieval)
    if args.only in (None, "daemon"):
        from bench.aarch64_daemon import run_daemon

        result.update(run_daemon(work, tree, arm_python, arm_env))
        write_json(args.out, result)
        for job in result["jobs"]:
            print(f"aarch64 daemon: {job['task']}: {job['status']} in {job['elapsed_s']} s: {job.get('output')}")
        print(f"qa kernel: {result['daemon']['qa_kernel']}; jetson_check: {result['daemon']['jetson_check']}")
        ok = ok and all(job["status"] == "ok" for job in result["jobs"])
    write_json(args.out, result)
    print(f"written to {args.out.relative_to(REPO)}")
    return 0 if ok else 1


def run_retrieval(
    work: Path, tree: Path, arm_python: list[str], env: dict[str, str], arm_env: dict[str, str]
) -> tuple[dict[str, Any], bool]:
    """The retrieval part: its result keys, and whether the two sides agree."""
    from engines.retrieval.embed_build import build_embedder

    site = arm64_site(work)
    engine_dir = work / "engines"
    build_embedder(engine_dir)  # here, once: the same ONNX file serves either CPU
    print("x86_64: edgectl docs add, probe", flush=True)
    native = _run_side("native", [sys.executable], env, work, engine_dir)
    print(f"aarch64 (qemu-user, Debian {SUITE}): edgectl docs add, probe", flush=True)
    arm = _run_side("aarch64", arm_python, {**arm_env, "PYTHONPATH": f"{site}:{REPO}"}, work, engine_dir)
    result = {
        "what": "edgectl docs add and retrieval by an arm64 Python under qemu-user against this machine's",
        "emulated": True,
        "debian": SUITE,
        "host": {k: native[k] for k in ("machine", "python", "libc", "versions")},
        "arm64": {k: arm[k] for k in ("machine", "python", "libc", "versions")},
        **compare(native, arm),
        "hnsw": {"vectors": HNSW_VECTORS, "queries": HNSW_QUERIES, "k": HNSW_K},
        "hnsw_recall_at_10_host": native["hnsw_recall_at_10"],
        "hnsw_recall_at_10_arm64": arm["hnsw_recall_at_10"],
        "docs_add_said_arm64": arm["docs_add_said"],
        "docs_add_s": {"host": native["docs_add_s"], "arm64_emulated": arm["docs_add_s"]},
    }
    print(f"\n| | {result['host']['machine']} (here) | {result['arm64']['machine']} (emulated) |")
    print("|---|---|---|")
    for name in ("python", "libc"):
        print(f"| {name} | {result['host'][name]} | {result['arm64'][name]} |")
    for name, version in result["arm64"]["versions"].items():
        print(f"| {name} | {result['host']['versions'][name]} | {version} |")
    print(f"| HNSW recall@10 | {native['hnsw_recall_at_10']:.3f} | {arm['hnsw_recall_at_10']:.3f} |")
    print(
        f"\nchunk ids equal: {result['chunk_ids_equal']} ({result['chunks']} chunks); passages equal: "
        f"{result['passages_equal']}; embeddings within {result['embedding_max_diff']:.1e}, scores within "
        f"{result['score_max_diff']:.1e}"
    )
    ok = result["chunk_ids_equal"] and result["passages_equal"] and result["embedding_max_diff"] < 1e-4
    return result, bool(ok)


if __name__ == "__main__":
    sys.exit(main())
