"""llama.cpp as the peer of `python -m bench.text cuda`, run in the same run on the same GPU.

- `llama-bench` is built from the llama.cpp source vendored in the llama-cpp-python
  sdist, pinned (LLAMACPP_VERSION), trimmed to what llama-bench needs (`trim` writes that
  tarball from the sdist: ggml, src, include, common, vendor, cmake, tools/llama-bench),
  with CUDA for the GPU's own architecture. The build lives outside the repo.
- The model is a random-weight Q4_0 GGUF of the benchmark's shape written with gguf-py
  (bench/random_gguf.py: the bytes of each block random, its scale fixed): the figures are
  about speed, never answers.
- `llama-bench -ngl 99 -fa 1 -p 512 -n 128 -d 0,4096 -o json` gives prefill and decode
  rates at each depth.

    python -m bench.llamacpp_peer trim SDIST.tar.gz OUT.tar.gz   # the source tarball, once
    python -m bench.llamacpp_peer build SRC.tar.gz WORK [ARCH]    # ahead of a benchmark run

`python -m bench.text cuda --llamacpp-src SRC.tar.gz` builds (or finds built), writes the
model and runs it in its own run. It needs gguf (a dependency of edge) and CMake with the
CUDA toolkit.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

LLAMACPP_VERSION = "llama-cpp-python==0.3.36"
KEEP = (
    "CMakeLists.txt",
    "cmake/",
    "ggml/",
    "src/",
    "include/",
    "common/",
    "vendor/",
    "licenses/",
    "tools/llama-bench/",
)
# Only llama-bench among the tools: the others' directories are not in the trimmed tree.
TOOLS_CMAKE = "find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n"


def trim(sdist: Path, out: Path) -> None:
    """The llama.cpp tree llama-bench builds from, out of the llama-cpp-python sdist."""
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            parts = member.name.split("/")
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
                continue
            rel = "/".join(parts[3:])
            if rel == "tools/CMakeLists.txt" or not any(rel == k or rel.startswith(k) for k in KEEP):
                continue
            data = src.extractfile(member) if (member.isfile() or member.islnk()) else None
            if data is None:
                continue  # directories are made by extraction; links are copied as files
            body = data.read()
            # A fresh header: the sdist's long names sit in PAX headers that would keep
            # the old path whatever the member's name says.
            copy = tarfile.TarInfo("llama.cpp/" + rel)
            copy.size, copy.mode, copy.mtime = len(body), member.mode | 0o644, member.mtime
            dst.addfile(copy, io.BytesIO(body))
        tools = TOOLS_CMAKE.encode()
        info = tarfile.TarInfo("llama.cpp/tools/CMakeLists.txt")
        info.size = len(tools)
        dst.addfile(info, io.BytesIO(tools))


def build(source: Path, work: Path, arch: str, jobs: int = 16, nice: bool = False) -> tuple[Path, float]:
    """llama-bench built with CUDA for `arch` (e.g. "90"); returns it and the build's seconds.
    `nice`: at the lowest CPU priority (a build beside a measurement)."""
    started = time.perf_counter()
    prefix = ["nice", "-n", "19"] if nice else []
    root = work / "llama.cpp"
    if not root.exists():
        with tarfile.open(source) as tar:
            tar.extractall(work, filter="data")
    build_dir = work / "build"
    flags = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    flags += ["-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]
    flags += ["-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run([*prefix, "cmake", "-S", str(root), "-B", str(build_dir), *flags], check=True, capture_output=True)
    subprocess.run(
        [*prefix, "cmake", "--build", str(build_dir), "--target", "llama-bench", "-j", str(jobs)],
        check=True,
        capture_output=True,
    )
    binary = build_dir / "bin" / "llama-bench"
    if not binary.exists():
        raise FileNotFoundError(f"the build made no {binary}")
    return binary, time.perf_counter() - started


BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")
TEST_START = "llama-bench: benchmark "


def buffer_peak(log: str) -> dict[str, float]:
    """llama.cpp's own allocations from its log (-v): the model's buffers plus, at the
    test that needed most, its context's (KV cache, compute, output), split into GPU
    buffers (CUDAn) and host ones (CPU, CPU_Mapped, CUDA_Host). Returns MiB."""
    model = {"gpu": 0.0, "host": 0.0}
    peak = {"gpu": 0.0, "host": 0.0, "total": 0.0}
    seen_model = False
    for segment in log.split(TEST_START)[1:]:
        ctx = {"gpu": 0.0, "host": 0.0}
        segment_model = {"gpu": 0.0, "host": 0.0}
        for name, kind, mib in BUFFER.findall(segment):
            side = "gpu" if name.startswith("CUDA") and not name.startswith("CUDA_Host") else "host"
            (segment_model if kind == "model" else ctx)[side] += float(mib)
        if any(segment_model.values()):  # the model was (re)loaded for this test
            model, seen_model = segment_model, True
        gpu, host = model["gpu"] + ctx["gpu"], model["host"] + ctx["host"]
        if gpu + host > peak["total"]:
            peak = {"gpu": gpu, "host": host, "total": gpu + host}
    if not seen_model:
        raise ValueError("llama-bench's log shows no model buffers (was it run with -v?)")
    return peak


def run_bench(binary: Path, model: Path, prompt: int, new_tokens: int, depths: tuple[int, ...]) -> dict[str, Any]:
    """llama-bench's rates: prefill of `prompt` tokens and decode of `new_tokens`, at each
    depth (tokens already in the cache), flash attention on, every layer on the GPU; and
    its buffers' peak from its own log."""
    line = [str(binary), "-m", str(model), "-ngl", "99", "-fa", "1", "-p", str(prompt), "-n", str(new_tokens)]
    line += ["-d", ",".join(map(str, depths)), "-o", "json"]
    done = subprocess.run([*line, "-v", "--progress"], check=True, capture_output=True, text=True)
    out: dict[str, Any] = {"command": " ".join(["llama-bench", *line[1:]]), "prefill_tok_s": {}, "decode_tok_s": {}}
    for row in json.loads(done.stdout):
        depth = str(row.get("n_depth", 0))
        if row["n_prompt"] and not row["n_gen"]:
            out["prefill_tok_s"][depth] = float(row["avg_ts"])
        elif row["n_gen"] and not row["n_prompt"]:
            out["decode_tok_s"][depth] = float(row["avg_ts"])
        out.setdefault("build", row.get("build_commit"))
        out.setdefault("gpu", row.get("gpu_info"))
    (model.parent / "llama-bench.log").write_text(done.stderr)
    out["buffer_lines"] = [" ".join(m) for m in BUFFER.findall(done.stderr)][:24]
    try:
        out["buffers_mib"] = buffer_peak(done.stderr)
    except ValueError as err:  # the rates stand without the memory figure
        out["buffers_mib"], out["buffers_error"] = None, str(err)
    out["model_bytes"] = model.stat().st_size
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "trim":
        trim(Path(sys.argv[2]), Path(sys.argv[3]))
        print(f"wrote {sys.argv[3]}")
        return 0
    if len(sys.argv) in (4, 5) and sys.argv[1] == "build":
        # Built ahead of a benchmark run (which then finds it built): SRC WORK [ARCH]
        import torch

        props = torch.cuda.get_device_properties(0)
        arch = sys.argv[4] if len(sys.argv) == 5 else f"{props.major}{props.minor}"
        binary, seconds = build(Path(sys.argv[2]), Path(sys.argv[3]), arch)
        print(f"built {binary} in {seconds:.0f} s")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
