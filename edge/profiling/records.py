"""torch.profiler's records (Kineto's trace: CUPTI's kernel and memcpy records on CUDA,
torch's operators on the CPU) as timeline rows.

What each record gives, in Kineto's trace (the JSON `export_chrome_trace` writes):
- `kernel`: a kernel's time on the GPU; `args["est. achieved occupancy %"]`, Kineto's
  estimate of the SM occupancy from the launch's shape and the device's limits (absent
  where it cannot make one); `args["correlation"]`, the CUDA call that launched it;
- `gpu_memcpy`: a copy's time and `args["bytes"]`; its name says which way (HtoD, DtoH,
  DtoD, ...);
- `cuda_runtime` / `cuda_driver`: the host's launch calls, with the same correlation;
- `cpu_op`: a torch operator on a host thread (nested ones inside their caller);
- `user_annotation`: a `record_function` range; the profile marks the clock with one
  and each text step with another (`Windows`).

Kineto's times are microseconds on a clock of its own; `offset` turns them into the
profile's (seconds on the monotonic clock), from a marker recorded at a known moment.
"""

from __future__ import annotations

import bisect
import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.profiling.shapes import Product
from edge.profiling.timeline import Timeline

CLOCK_MARK = "edge.profile.clock"
OCCUPANCY = "est. achieved occupancy %"
# Our INT4 products' kernels (CUDA C's gemv_kernel, Triton's _int4_gemv_bits_kernel).
PRODUCT_KERNELS = re.compile(r"gemv_kernel|int4_gemv")
# Attention over the KV cache (ours in CUDA C and Triton); the merge of split partials
# reads no cache.
ATTENTION_KERNELS = re.compile(r"attn")
NOT_ATTENTION = re.compile(r"merge")


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The profiler's records as Kineto writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        doc = json.loads(path.read_text(encoding="utf-8"))
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def clock_offset(events: Iterable[dict[str, Any]], marked_at: float) -> float | None:
    """Seconds to add to a record's time (ts / 1e6) for the profile's clock, from the
    clock mark recorded at `marked_at`; None without it."""
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") == CLOCK_MARK:
            return marked_at - float(e["ts"]) / 1e6
    return None


@dataclass
class Window:
    """A step of the text model timed by the profile (a prefill or a decode step): what
    its attention reads or writes of the KV cache, and whether its INT4 products read
    every weight once a forward (the products' bytes then known by their order)."""

    name: str
    kv_bytes: float
    forwards: int = 1


@dataclass
class Attribution:
    """What the kernels' bytes are known from: the model's INT4 products in call order
    and the text steps as they ran (in order; their annotations name them)."""

    products: list[Product] | None = None
    windows: list[Window] = field(default_factory=list)


def _direction(name: str) -> str:
    """ "Memcpy HtoD (Pageable -> Device)" -> "memcpy HtoD"."""
    words = name.split()
    return f"memcpy {words[1]}" if len(words) > 1 and words[0].lower() == "memcpy" else name


def _top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operators called from Python, not from inside another operator (per thread)."""
    out = []
    for tid in {e.get("tid") for e in ops}:
        ends: list[float] = []
        for e in sorted((e for e in ops if e.get("tid") == tid), key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends:
                out.append(e)
            ends.append(end)
    return out


def _kernel_bytes(
    kernels: list[dict[str, Any]], events: list[dict[str, Any]], attribution: Attribution
) -> dict[int, float]:
    """Bytes per kernel (by its index in `kernels`) where they are known: the INT4
    products launched inside a text step, matched to the model's products by order when
    the step launched exactly one forward's worth; attention kernels share the step's KV
    bytes equally."""
    products, windows = attribution.products, attribution.windows
    if not windows:
        return {}
    marks = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e.get("name") in {w.name for w in windows}),
        key=lambda e: float(e["ts"]),
    )
    if len(marks) != len(windows):
        return {}  # the annotations are not the steps the profile timed: guess nothing
    launches: dict[Any, float] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    in_window: list[list[int]] = [[] for _ in windows]
    starts = [float(m["ts"]) for m in marks]
    ends = [float(m["ts"]) + float(m["dur"]) for m in marks]
    for i, k in enumerate(kernels):
        at = launches.get(k.get("args", {}).get("correlation"))
        if at is None:
            continue
        w = bisect.bisect_right(starts, at) - 1  # the last step begun by the launch (steps do not overlap)
        if w >= 0 and at <= ends[w]:
            in_window[w].append(i)
    out: dict[int, float] = {}
    for window, members in zip(windows, in_window, strict=True):
        ordered = sorted(members, key=lambda i: float(kernels[i]["ts"]))
        gemvs = [i for i in ordered if PRODUCT_KERNELS.search(kernels[i]["name"])]
        if products and len(gemvs) == len(products) * window.forwards:
            for i, product in zip(gemvs, products * window.forwards, strict=True):
                out[i] = product.nbytes
        attention = [
            i
            for i in ordered
            if ATTENTION_KERNELS.search(kernels[i]["name"]) and not NOT_ATTENTION.search(kernels[i]["name"])
        ]
        for i in attention:
            out[i] = window.kv_bytes / len(attention)
    return out


def add_records(
    timeline: Timeline, events: list[dict[str, Any]], offset: float, attribution: Attribution | None = None
) -> dict[str, bool]:
    """Every kernel, copy and top-level operator into `timeline`; returns what the
    records held (kernels, copies, occupancy), for the profile to say what was available."""

    def at(e: dict[str, Any]) -> float:
        return float(e["ts"]) / 1e6 + offset

    kernels = [e for e in events if e.get("cat") == "kernel"]
    known = _kernel_bytes(kernels, events, attribution or Attribution())
    occupancy_seen = False
    for i, e in enumerate(kernels):
        occ = e.get("args", {}).get(OCCUPANCY)
        occupancy = float(occ) / 100.0 if isinstance(occ, (int, float)) else None
        occupancy_seen = occupancy_seen or occupancy is not None
        timeline.add(e["name"], "kernel", at(e), float(e["dur"]) / 1e6, known.get(i), occupancy)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    for e in copies:
        nbytes = e.get("args", {}).get("bytes")
        timeline.add(_direction(str(e["name"])), "memcpy", at(e), float(e["dur"]) / 1e6,
                     float(nbytes) if isinstance(nbytes, (int, float)) else None)  # fmt: skip
    for e in _top_level([e for e in events if e.get("cat") == "cpu_op"]):
        timeline.add(str(e["name"]), "op", at(e), float(e["dur"]) / 1e6)
    return {"kernels": bool(kernels), "memcpy": bool(copies), "occupancy": occupancy_seen}


def transfers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Host-device copies by direction: count, bytes, seconds and the rate."""
    by: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        nbytes = e.get("args", {}).get("bytes")
        if not isinstance(nbytes, (int, float)):
            continue
        total = by.setdefault(_direction(str(e["name"])).removeprefix("memcpy "), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += float(nbytes)
        total[2] += float(e["dur"]) / 1e6
    return [
        {"direction": d, "count": int(c), "bytes": int(b), "seconds": s, "bytes_per_s": b / s if s > 0 else None}
        for d, (c, b, s) in sorted(by.items())
    ]
