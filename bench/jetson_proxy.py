"""The Jetson's text path measured on a bigger GPU, beside the Triton path in the same run.

A Jetson has nvcc and no Triton. Here the served 8B-shape engine (bench/text.py's
`served` variant, the shipped GPU profile) is measured twice on one checkpoint: in this
process (Triton present), then in a child process where `import triton` fails and our
CUDA kernels are built as compute_80 PTX alone (EDGE_CUDA_ARCH), so the GPU runs
Ampere's instructions, those an Orin's sm_87 has. The child's engine is the Jetson
profile's (jetson-orin: the same qa section but for how many sequences and tokens it
serves, fields a measurement sets anyway). Its row, `jetson-proxy`, goes into
text_cuda.json (replacing an earlier one, keeping the other rows) with its ratios to the
Triton path of the same run.

With --kv-out, the child process also decodes at 4K context with float16, int8 and int4
KV (bench.kv.decode_4k, the Jetson profile's engine), into kv.json's `jetson_proxy`
section with each format's ratio to float16 KV.

With --agreement ENGINE_DIR, instead: greedy answers on the real SmolLM2 (the clinic
build `edgectl build` makes, built or found in ENGINE_DIR) through the Triton path and
through the proxy, the first 16 tokens of 24 held-out prompts, added to the jetson-proxy
row already in --out as `real_model_agreement` (`exact_match`: prompts whose 16 tokens
are all the same; `token_agreement`).

    python -m bench.jetson_proxy [--out bench/results/text_cuda.json] [--kv-out bench/results/kv.json]
    python -m bench.jetson_proxy --agreement ENGINE_DIR [--out bench/results/text_cuda.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import text
from bench.common import RESULTS, agreement, write_json

VARIANT = "jetson-proxy"
PROXY_ARCH = "compute_80"


def measure(checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The served variant's row (bench.text.ours_cuda) on `checkpoint`, capped as the
    daemon is."""
    props = torch.cuda.get_device_properties(0)
    bandwidth = text.copy_bandwidth()
    changes = text.CUDA_VARIANTS["served"][1]
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * text.GIB / props.total_memory)
    text.spin_up(1.0)
    # With --profile, the in-graph profile too: each kernel's time inside the captured
    # step, so the two paths' rows say where their difference lies.
    row = text.ours_cuda(
        checkpoint, changes, args.prompt, args.new_tokens, text.LONG_CONTEXT, bandwidth, profile=args.profile
    )
    row["copy_bandwidth_gb_s"] = bandwidth / 1e9
    return row


def child(checkpoint: str, out: str, prompt: int, new_tokens: int, cap_gib: float, profile: bool) -> None:
    """The proxy's measurement: run as `python -c` after `sys.modules["triton"] = None`."""
    from bench import text_engines

    text_engines.SHIPPED["cuda"] = "jetson-orin"
    args = argparse.Namespace(prompt=prompt, new_tokens=new_tokens, cap_gib=cap_gib, profile=profile)
    write_json(Path(out), measure(Path(checkpoint), args))


def kv_child(checkpoint: str, out: str, context: int, new_tokens: int, profile: bool = False) -> None:
    """The proxy's KV measurement (bench.kv.decode_4k: float16, int8 and int4 KV in turns,
    the served engine of the Jetson profile; with `profile`, each one's kernels), run as
    `child` is."""
    from bench import kv, text_engines

    text_engines.SHIPPED["cuda"] = "jetson-orin"
    write_json(Path(out), {"rows": kv.decode_4k(Path(checkpoint), context, new_tokens, profile=profile)})


def greedy(checkpoint: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """The shipped CUDA profile's engine on `checkpoint`: its greedy tokens for `prompts`
    (bench.text's agreement length) and its configuration."""
    from bench import text_engines

    engine = text_engines.load_engine(checkpoint, "cuda")
    return {"tokens": text._greedy(engine, prompts), "engine_config": engine.config()}


def greedy_child(checkpoint: str, prompts: str, out: str) -> None:
    """`greedy` with the Jetson profile's engine, run as `child` is."""
    from bench import text_engines

    text_engines.SHIPPED["cuda"] = "jetson-orin"
    write_json(Path(out), greedy(Path(checkpoint), json.loads(Path(prompts).read_text())))


def real_agreement(engine_dir: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Greedy answers of the real SmolLM2's served build through the Triton path (this
    process) and the proxy (a child), compared prompt by prompt."""
    from tokenizers import Tokenizer

    from engines.text.text_build import build_text_engine

    served = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    prompts = text.held_out_prompts(Tokenizer.from_file(str(served / "tokenizer.json")))
    triton_path = greedy(served, prompts)  # (its engine gone with the call)
    text._release()
    prompts_file, out = workdir / "prompts.json", workdir / "greedy.json"
    prompts_file.write_text(json.dumps(prompts))
    proxy = _in_child(f"greedy_child({str(served)!r}, {str(prompts_file)!r}, {str(out)!r})", args, out)
    return {
        "model": "SmolLM2-135M-Instruct (real weights), clinic adapter, AWQ INT4 as `edgectl build` makes it",
        "prompts": len(prompts),
        "tokens": text.AGREEMENT_TOKENS,
        **agreement(triton_path["tokens"], proxy["tokens"]),
        "engine_config": proxy["engine_config"],
        "triton_engine_config": triton_path["engine_config"],
    }


def _in_child(call: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`call` (a function of this module, its arguments written out) in a process where
    `import triton` fails, with our CUDA kernels built as args.arch; its JSON."""
    code = f"import sys; sys.modules['triton'] = None\nfrom bench import jetson_proxy\njetson_proxy.{call}\n"
    env = {**os.environ, "EDGE_CUDA_ARCH": args.arch} if args.arch else dict(os.environ)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_child(checkpoint: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / "proxy.json"
    call = f"child({str(checkpoint)!r}, {str(out)!r}, {args.prompt}, {args.new_tokens}, {args.cap_gib}, {args.profile})"
    return _in_child(call, args, out)


def kv_rows(checkpoint: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """kv.json's `jetson_proxy` section: decode at 4K context with each KV format through
    our CUDA kernels (Triton hidden), and int8's and int4's ratios to float16's."""
    out = workdir / "proxy_kv.json"
    call = f"kv_child({str(checkpoint)!r}, {str(out)!r}, {text.LONG_CONTEXT}, {args.new_tokens}, {args.profile})"
    rows = _in_child(call, args, out)
    by_dtype = {r["kv_dtype"]: r for r in rows["rows"]}
    base = by_dtype["float16"]["decode_tok_s_4k"]
    for row in rows["rows"]:
        row["variant"] = VARIANT
        row["vs_float16_kv"] = row["decode_tok_s_4k"] / base
    return {
        "device": torch.cuda.get_device_name(0),
        "cuda_arch": args.arch or "native",
        "context": text.LONG_CONTEXT,
        "rows": rows["rows"],
        "int8_over_float16": by_dtype["int8"]["vs_float16_kv"],
        "int4_over_float16": by_dtype["int4"]["vs_float16_kv"],
    }


def merged(path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """text_cuda.json with `row` in place of an earlier row of its variant. The earlier
    row's real-model agreement (a run of its own, `--agreement`) is kept, marked as
    measured before this row (`earlier_run`): the kernels may have changed since."""
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"rows": []}
    earlier = next((r for r in doc.get("rows", []) if r.get("variant") == row["variant"]), None)
    if earlier is not None and "real_model_agreement" in earlier and "real_model_agreement" not in row:
        row["real_model_agreement"] = {**earlier["real_model_agreement"], "earlier_run": True}
    doc["rows"] = [r for r in doc.get("rows", []) if r.get("variant") != row["variant"]] + [row]
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cap-gib", type=float, default=8.0, help="per-process memory cap (the shipped budget)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the random checkpoint is written")
    parser.add_argument("--out", type=Path, default=RESULTS / "text_cuda.json")
    parser.add_argument("--profile", action="store_true", help="each row's in-graph kernel profile too")
    parser.add_argument(
        "--kv-out", type=Path, default=None, help="also measure the KV formats' decode, into this kv.json"
    )
    parser.add_argument(
        "--arch",
        default=PROXY_ARCH,
        help="what the child's CUDA kernels are built as (EDGE_CUDA_ARCH); empty: for the GPU itself (a diagnosis "
        "of what the PTX costs, not the proxy)",
    )
    parser.add_argument(
        "--agreement",
        type=Path,
        default=None,
        metavar="ENGINE_DIR",
        help="only the real SmolLM2's greedy agreement, added to the jetson-proxy row in --out",
    )
    args = parser.parse_args()
    if args.agreement is not None:
        if not args.out.exists():
            raise SystemExit(f"{args.out} does not exist: measure the {VARIANT} row into it first")
        doc = json.loads(args.out.read_text())
        row = next((r for r in doc["rows"] if r.get("variant") == VARIANT), None)
        if row is None:
            raise SystemExit(f"{args.out} has no {VARIANT} row: measure it first")
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            row["real_model_agreement"] = real_agreement(args.agreement, args, Path(tmp))
        found = row["real_model_agreement"]
        print("greedy agreement, real SmolLM2:", json.dumps({k: v for k, v in found.items() if "config" not in k}))
        write_json(args.out, doc)
        print(f"wrote {args.out}")
        return
    from engines.text.random_llama import LLAMA3_8B, write_random_checkpoint

    group = text.CUDA_VARIANTS["served"][0]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        checkpoint = write_random_checkpoint(
            Path(tmp) / f"llama3-8b-int4-g{group}", LLAMA3_8B, device="cuda", group=group, seed=3
        )
        text._release()
        triton_row = measure(checkpoint, args)
        print("triton path:", json.dumps({k: v for k, v in triton_row.items() if not isinstance(v, dict | list)}))
        text._release()
        torch.cuda.set_per_process_memory_fraction(1.0)
        proxy = run_child(checkpoint, args, Path(tmp))
        kv_section = kv_rows(checkpoint, args, Path(tmp)) if args.kv_out else None
    config = proxy["engine_config"]
    row = {
        # Only the proxy's own build is the jetson-proxy row; another is a diagnosis beside it.
        "variant": VARIANT if args.arch == PROXY_ARCH else f"{VARIANT} ({args.arch or 'native'})",
        **proxy,
        "name": f"jetson-proxy: {proxy['name']}, Triton hidden, CUDA kernels as {args.arch or 'the GPU'}",
        # What the Jetson profile serves, run on this GPU as a proxy: not the GPU profile's row.
        "served": False,
        "proxy_for": config.get("origin", {}).get("profile"),
        "cuda_arch": proxy["engine_config"].get("cuda_arch"),
        "device": torch.cuda.get_device_name(0),
        "triton_same_run": {k: triton_row[k] for k in ("decode_tok_s", "decode_tok_s_4k", "ttft_ms", "peak_gib")},
        "triton_engine_config": triton_row["engine_config"],
        "vs_triton": {
            "decode_512": proxy["decode_tok_s"] / triton_row["decode_tok_s"],
            "decode_4096": proxy["decode_tok_s_4k"] / triton_row["decode_tok_s_4k"],
            "ttft": proxy["ttft_ms"] / triton_row["ttft_ms"],
        },
    }
    print("jetson proxy:", json.dumps({k: v for k, v in row.items() if not isinstance(v, dict | list)}))
    print("vs triton:", json.dumps(row["vs_triton"]))
    write_json(args.out, merged(args.out, row))
    print(f"wrote {args.out}")
    if args.kv_out and kv_section is not None:
        doc = json.loads(args.kv_out.read_text()) if args.kv_out.exists() else {"rows": []}
        doc["jetson_proxy"] = kv_section
        write_json(args.kv_out, doc)
        print("KV formats, jetson proxy:", json.dumps({r["kv_dtype"]: r["vs_float16_kv"] for r in kv_section["rows"]}))
        print(f"wrote {args.kv_out}")


if __name__ == "__main__":
    main()
