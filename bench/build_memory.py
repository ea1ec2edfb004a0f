#!/usr/bin/env python3
"""Host memory and time of `edgectl build`'s text build of an 8B-shape model.

A Llama-3-8B-shape model with random weights (a fixed seed) is written to disk as real
ones come: a Hugging Face directory of bfloat16 safetensors shards (with its tokenizer
and chat template), and a GGUF file of F16 tensors as llama.cpp's converter writes one
(q and k rows interleaved, the norms in F32, the vocabulary and merges in its metadata).
Each is built by the command `edgectl build` runs for a profile whose `models.qa` names
it (edge/builds.py: `python -m engines.text.text_build ...`, AWQ INT4, no adapter), in a
child process of its own: its peak resident memory (the kernel's high-water mark of the
child, file-backed pages included: the larger of wait4's and /proc's readings) and its wall
time. The build must peak at most 12 GiB. The vocabulary is a synthetic byte-level BPE of the model's size (every byte
pair, then byte triples, merged), so the calibration text tokenizes as a real model's
would, in tokens of two or three bytes. Never a quality figure: the weights are random.

Writes bench/results/build_memory.json. The sources take about 16 GB of disk each at the
8B shape; each is deleted after its build (`--keep` keeps them and the builds).

    python -m bench.build_memory                      # the 8B shape: about an hour a source on 2 CPUs
    python -m bench.build_memory --sources gguf       # one source; the other's row of the same shape kept
    python -m bench.build_memory --shape tiny --out /tmp/build_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.common import REPO, RESULTS, write_json
from bench.random_gguf import BOS, EOT, SPECIALS, TEMPLATE, add_llama3_vocabulary, add_llama_shape, vocabulary
from edge.builds import build_command, command_line
from edge.config.loader import load_profile
from edge.text.architecture import LlamaConfig
from engines.text.random_llama import LLAMA3_8B
from engines.text.safetensors_writer import SafetensorsWriter

LIMIT_BYTES = 12 * 2**30
SEED = 0
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    # Two of the 8B model's layers with its token table and head: the 8B build's peak (a
    # layer's size and the table's, not the model's) in minutes instead of an hour.
    "llama3-8b-2-layers": replace(LLAMA3_8B, num_layers=2),
    # Llama 3.2 1B's shape: to see the peak follow a layer's size, not the model's.
    "llama3-1b": replace(
        LLAMA3_8B, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192
    ),
    "tiny": replace(
        LLAMA3_8B, vocab_size=2048, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=256
    ),
}
SHARD_BYTES = 5 * 10**9  # transformers' shard size for Llama 3's files
_LAYER_TIME = re.compile(r"layer (\d+)/(\d+) quantized in ([0-9.]+) s")


# --- the source model ---------------------------------------------------------------


def _matrix(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """N(0, 0.02) for a matrix, ones for a norm: drawn in float32 from a generator seeded
    by the tensor's name (the same weights whatever order they are written in), a chunk of
    rows at a time (no float32 copy of a 128k-row table)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], 8192):
        end = min(shape[0], start + 8192)
        out[start:end] = torch.randn(end - start, *shape[1:], generator=gen) * 0.02
    return out


def hf_tensors(config: LlamaConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A Llama checkpoint's tensors as transformers names them, in model order."""
    h, hd = config.hidden_size, config.head_dim
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (config.num_heads * hd, h)
        yield f"{p}.self_attn.k_proj.weight", (config.num_kv_heads * hd, h)
        yield f"{p}.self_attn.v_proj.weight", (config.num_kv_heads * hd, h)
        yield f"{p}.self_attn.o_proj.weight", (h, config.num_heads * hd)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (config.intermediate_size, h)
        yield f"{p}.mlp.up_proj.weight", (config.intermediate_size, h)
        yield f"{p}.mlp.down_proj.weight", (h, config.intermediate_size)
    yield "model.norm.weight", (h,)
    if not config.tie_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


def write_hf(config: LlamaConfig, out: Path) -> dict[str, Any]:
    """A Hugging Face model directory: bfloat16 shards of at most SHARD_BYTES with their
    index, config.json, tokenizer.json, tokenizer_config.json, generation_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True)
    tokens, merges = vocabulary(config.vocab_size)
    regular = len(tokens) - SPECIALS
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens[:regular])}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(tokens[regular:])
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {"bos_token": BOS, "eos_token": EOT, "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    bos, eos = regular + 0, [regular + 1, regular + 9]
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in hf_tensors(config):
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsWriter(out / file, {name: (torch.bfloat16, shape) for name, shape in shard}) as writer:
            for name, shape in shard:
                writer.write(name, _matrix(name, shape, torch.bfloat16))
                weight_map[name] = file
    total = sum(2 * int(np.prod(shape)) for _, shape in hf_tensors(config))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    count = f"{len(shards)} shard" + ("s" if len(shards) > 1 else "")
    return {"format": f"Hugging Face safetensors, bfloat16, {count}", "bytes": _disk_bytes(out)}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves (its NORM RoPE)."""
    rows = weight.shape[0]
    return np.ascontiguousarray(weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape))


GGUF_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf)
    assert match is not None, hf
    return f"blk.{match.group(1)}.{GGUF_PARTS[match.group(2)]}.weight"


def write_gguf(config: LlamaConfig, path: Path) -> dict[str, Any]:
    """The model as llama.cpp's converter writes an F16 file (1-D tensors in F32), the same
    weights as write_hf's, streamed tensor by tensor."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_llama_shape(writer, config)
    add_llama3_vocabulary(writer, config.vocab_size)
    planned = [(name, shape, np.float32 if len(shape) == 1 else np.float16) for name, shape in hf_tensors(config)]
    for name, shape, dtype in planned:
        writer.add_tensor_info(_gguf_name(name), shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, dtype in planned:
        data = _matrix(name, shape, torch.float32 if dtype == np.float32 else torch.float16).numpy()
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, config.num_heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, config.num_kv_heads)
        writer.write_tensor_data(data)
    writer.close()
    return {"format": "GGUF, F16 (norms F32)", "bytes": path.stat().st_size}


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- the build, measured -------------------------------------------------------------


def profile_for(work: Path, source: Path) -> Path:
    """The CPU profile with models.qa naming `source` (INT4 AWQ, no adapter), engines under `work`."""
    data = yaml.safe_load((REPO / "profiles" / "cpu-dev.yaml").read_text(encoding="utf-8"))
    data["models"]["qa"] = {**data["models"]["qa"], "source": str(source), "adapter": "none"}
    data["models"]["qa"]["quantization"] = "awq-int4"
    data["paths"] = {
        "state_dir": str(work / "state"),
        "runtime_dir": str(work / "run"),
        "engine_dir": str(work / "engines"),
        "media_dir": str(REPO / "samples"),
    }
    out = work / "profile.yaml"
    out.write_text(yaml.safe_dump(data), encoding="utf-8")
    return out


def _status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _timeline(samples: list[tuple[float, int]], seconds: float, points: int = 100) -> list[list[float]]:
    """[seconds, bytes]: the largest resident size sampled in each of `points` equal spans
    of the build, to show where it peaks and whether it creeps up layer after layer."""
    span = max(seconds, 1e-9) / points
    peaks: dict[int, tuple[float, int]] = {}
    for t, rss in samples:
        slot = min(points - 1, int(t / span))
        if slot not in peaks or rss > peaks[slot][1]:
            peaks[slot] = (t, rss)
    return [[round(t, 1), rss] for t, rss in (peaks[k] for k in sorted(peaks))]


def measure_build(work: Path, source: Path, threads: int | None) -> dict[str, Any]:
    """`edgectl build`'s text build of `source` in a child process: its peak resident
    memory, wall time and per-layer times, and what it built."""
    profile = load_profile(profile_for(work, source))
    cmd = build_command("qa", profile)
    line = command_line(cmd, profile.paths.engine_dir, progress=False)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log, printed = work / "build.log", work / "build.out"
    samples: list[tuple[float, int]] = []
    hwm = [0]
    started = time.monotonic()
    with log.open("wb") as err, printed.open("wb") as out:
        child = subprocess.Popen(line, cwd=REPO, stdout=out, stderr=err, env=env)
        done = threading.Event()

        def sample() -> None:
            # When the peak came, and a second reading of it: the kernel updates the
            # high-water mark wait4 reports lazily (mapped file pages it reclaims leave
            # the resident set without a mark), so the larger of the two is the peak.
            while not done.wait(0.5):
                rss, high = _status_kib(child.pid, "VmRSS"), _status_kib(child.pid, "VmHWM")
                if rss is not None:
                    samples.append((time.monotonic() - started, rss * 1024))
                if high is not None:
                    hwm[0] = max(hwm[0], high * 1024)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.monotonic() - started
        done.set()
        sampler.join()
        child.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text(encoding="utf-8", errors="replace")
    row: dict[str, Any] = {
        "command": [Path(line[0]).name, *line[1:]],
        "exit_code": child.returncode,
        "seconds": round(seconds, 1),
        # ru_maxrss: the child's high-water resident set, in KiB on Linux.
        "peak_rss_bytes": max(usage.ru_maxrss * 1024, hwm[0], max((rss for _, rss in samples), default=0)),
        "peak_rss_wait4_bytes": usage.ru_maxrss * 1024,
        "peak_rss_sampled_bytes": max(hwm[0], max((rss for _, rss in samples), default=0)),
        "peak_at_s": round(max(samples, key=lambda s: s[1])[0], 1) if samples else None,
        "rss_timeline": _timeline(samples, seconds),
    }
    layer_times = [float(m.group(3)) for m in _LAYER_TIME.finditer(text)]
    if layer_times:
        row["layer_seconds"] = {"mean": round(sum(layer_times) / len(layer_times), 2), "max": max(layer_times)}
    if child.returncode != 0:
        row["error"] = text[-2000:]
        return row
    built = Path(printed.read_text(encoding="utf-8").strip().splitlines()[-1])
    manifest = json.loads((built / "manifest.json").read_text(encoding="utf-8"))
    row["recipe"] = manifest["recipe"]
    row["int4_bytes"] = manifest["weight_bytes"]
    return row


def kept_rows(out: Path, shape: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's rows after the rows of `out` (an earlier run's) for the same shape and
    the other sources: at the 8B shape a source takes about an hour on two CPUs, so each
    may be measured in a run of its own. A row of the same source is replaced."""
    if not out.exists():
        return rows
    earlier = json.loads(out.read_text(encoding="utf-8"))
    if earlier.get("shape_name") != shape:
        return rows
    ran = {r["source"] for r in rows}
    return [r for r in earlier.get("rows", []) if r["source"] not in ran] + rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--sources", default="safetensors,gguf", help="which source formats to build, in order")
    parser.add_argument("--threads", type=int, default=0, help="the build's torch threads (0: torch's default)")
    parser.add_argument("--work", type=Path, default=None, help="where sources and builds go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the sources and builds")
    parser.add_argument("--out", type=Path, default=RESULTS / "build_memory.json")
    args = parser.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    unknown = set(sources) - {"safetensors", "gguf"}
    if unknown:
        parser.error(f"unknown sources {sorted(unknown)}")
    config = SHAPES[args.shape]
    work = args.work or Path(tempfile.mkdtemp(prefix="edge-build-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    rows = []
    for kind in sources:
        where = work / kind
        print(f"writing the {args.shape} source as {kind} under {where}", flush=True)
        t0 = time.monotonic()
        if kind == "safetensors":
            source, written = where / f"random-{args.shape}", write_hf(config, where / f"random-{args.shape}")
        else:
            source = where / f"random-{args.shape}-f16.gguf"
            written = write_gguf(config, source)
        print(f"  {written['bytes'] / 2**30:.1f} GiB in {time.monotonic() - t0:.0f} s; building", flush=True)
        row = {"source": kind, "source_format": written["format"], "source_bytes": written["bytes"]}
        row.update(measure_build(where, source, args.threads or None))
        row["threads"] = threads
        row["within_limit"] = "error" not in row and row["peak_rss_bytes"] <= LIMIT_BYTES
        rows.append(row)
        status = "failed" if "error" in row else f"peak {row['peak_rss_bytes'] / 2**30:.2f} GiB"
        print(f"  {kind}: {status}, {row['seconds'] / 60:.1f} min", flush=True)
        if not args.keep:
            shutil.rmtree(where)
    if not args.keep and args.work is None:
        shutil.rmtree(work)
    rows = kept_rows(args.out, args.shape, rows)
    result = {
        "what": "edgectl build's text build (AWQ INT4, no adapter) of a random-weight model, in a child process",
        "shape_name": args.shape,
        "shape": asdict(config),
        "parameters": config.parameter_count(),
        "quantization": "awq-int4",
        "adapter": "none",
        "limit_bytes": LIMIT_BYTES,
        "within_limit": bool(rows) and all(r["within_limit"] for r in rows),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    write_json(args.out, result)
    print("| source | on disk GiB | peak RSS GiB | minutes | within 12 GiB |\n|---|---:|---:|---:|---|")
    for r in rows:
        peak, minutes = f"{r['peak_rss_bytes'] / 2**30:.2f}", f"{r['seconds'] / 60:.1f}"
        print(f"| {r['source']} | {r['source_bytes'] / 2**30:.1f} | {peak} | {minutes} | {r['within_limit']} |")
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
