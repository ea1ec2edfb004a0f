"""The profile as one JSON document (schema docs/schemas/profile.schema.json, version
SCHEMA_VERSION; docs/operations.md, Profiling, says what each figure is and where it
comes from). Everything the heat maps show is in it, so they can be drawn again from the
file alone, on another machine (`edgectl profile --draw`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from edge.profiling.sampler import Series
from edge.profiling.timeline import Row, Timeline

SCHEMA_VERSION = 1
KIND = "edge-profile"


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def row_doc(row: Row, width: float, bandwidth: float | None) -> dict[str, Any]:
    """One row: its totals, and per column the share of the column it ran (`busy`, above
    1 where calls overlap) and the share of the copy bandwidth its known bytes took over
    the column (`bandwidth_share`, null where its bytes are not known)."""
    share = None
    if row.has_bytes and bandwidth:
        share = [_round(moved / width / bandwidth) for moved in row.moved]
    achieved = row.known_bytes / row.known_seconds if row.has_bytes else None
    return {
        "name": row.name,
        "kind": row.kind,
        "calls": row.calls,
        "seconds": _round(row.seconds, 9),
        "bytes": int(row.known_bytes) if row.has_bytes else None,
        "bytes_per_s": _round(achieved, 1),
        "bandwidth_share": _round(achieved / bandwidth) if achieved is not None and bandwidth else None,
        "occupancy": _round(row.occupancy),
        "busy": [_round(b / width) for b in row.busy],
        "bandwidth_share_by_column": share,
    }


def _column_means(times: list[float], values: list[float | None], timeline: Timeline) -> list[float | None]:
    """The mean of the readings taken in each column; a column narrower than the
    sampling interval, with none of its own, holds the last reading before it (each
    reading is already an average over the time since the one before)."""
    sums = [0.0] * timeline.columns
    counts = [0] * timeline.columns
    before: float | None = None
    for t, v in zip(times, values, strict=True):
        c = int((t - timeline.start) / timeline.width) if t >= timeline.start else -1
        if v is None or c >= timeline.columns:
            continue
        if c < 0:
            before = v
            continue
        sums[c] += v
        counts[c] += 1
    out: list[float | None] = []
    for s, n in zip(sums, counts, strict=True):
        if n:
            before = s / n
        out.append(_round(before, 4))
    return out


def samples_doc(series: Series, timeline: Timeline) -> dict[str, Any]:
    """The sampler's series, as taken (`t_s` from the profile's start) and averaged into
    the timeline's columns."""
    times = [t - timeline.start for t in series.times]
    gpus = []
    for index in sorted(series.gpu_load):
        load, memory = series.gpu_load[index], series.memory_controller[index]
        gpus.append({
            "index": index,
            "load": [_round(v, 4) for v in load],
            "memory_controller": [_round(v, 4) for v in memory],
            "load_by_column": _column_means(series.times, load, timeline),
            "memory_controller_by_column": _column_means(series.times, memory, timeline),
        })  # fmt: skip
    return {
        "source": series.source,
        "t_s": [round(t, 4) for t in times],
        "cpu_load": [_round(v, 4) for v in series.cpu_load],
        "cpu_load_by_column": _column_means(series.times, series.cpu_load, timeline),
        "gpus": gpus,
    }


def document(
    mode: str,
    timeline: Timeline,
    series: Series,
    device: dict[str, Any],
    available: dict[str, Any],
    workload: dict[str, Any] | None = None,
    jobs: list[dict[str, Any]] | None = None,
    transfers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    bandwidth = device.get("copy_bandwidth_bytes_per_s")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "mode": mode,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"name": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "device": device,
        "workload": workload,
        "window": {
            "seconds": _round(timeline.end - timeline.start),
            "columns": timeline.columns,
            "column_s": _round(timeline.width, 9),
        },
        "available": available,
        "rows": [row_doc(r, timeline.width, bandwidth) for r in timeline.rows()],
        "transfers": transfers or [],
        "samples": samples_doc(series, timeline),
        "jobs": jobs or [],
    }


def write(doc: dict[str, Any], out: Path) -> Path:
    """profile.json in `out` (made if absent), written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return path


class NotAProfile(ValueError):
    """A file that is not a profile this version can read."""


def read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NotAProfile(f"{path}: cannot read a profile: {err}") from err
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise NotAProfile(f"{path}: not a profile written by `edgectl profile`")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise NotAProfile(
            f"{path}: profile schema version {doc.get('schema_version')}; this edgectl reads {SCHEMA_VERSION}"
        )
    return doc
