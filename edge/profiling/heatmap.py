"""The profile's heat maps, drawn from its JSON document alone: rows (kernels, copies,
operators, stages, steps) by columns of time.

- bandwidth.png: each cell the share of the box's copy bandwidth the row's known bytes
  took over that column; only rows whose bytes are known (the title counts the others).
- activity.png: each cell the share of the column the row ran (capped at 1 where calls
  overlap), and under them the sampled rows: each GPU's load and memory-controller
  utilisation and the CPUs' load.

matplotlib draws them. It is not needed to serve, so it is an optional extra
(`pip install '.[profile]'`): without it the JSON is still written and `Unavailable`
says how to get the pictures (or to draw them elsewhere with `edgectl profile --draw`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

LABEL_CHARS = 64
MISSING = "matplotlib is not installed: `pip install '.[profile]'` (the profile extra) to draw the heat maps"


class Unavailable(RuntimeError):
    """matplotlib is not installed here."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise Unavailable(MISSING) from err
    matplotlib.use("Agg")  # files only: no display on a box
    import matplotlib.pyplot as plt

    return plt


def _label(row: dict[str, Any]) -> str:
    name = str(row["name"])
    if len(name) > LABEL_CHARS:
        name = name[: LABEL_CHARS - 3] + "..."
    return f"{row['kind']}: {name}"


def _nan(values: list[float | None] | None, columns: int) -> list[float]:
    if values is None:
        return [math.nan] * columns
    return [math.nan if v is None else float(v) for v in values]


def _draw(
    plt: Any,
    labels: list[str],
    cells: list[list[float]],
    doc: dict[str, Any],
    title: str,
    scale: str,
    path: Path,
    split: int | None = None,
    text: dict[str, str] | None = None,
) -> Path:
    """One heat map; `split`: the row above which a line parts recorded rows from sampled
    ones; `text`: PNG text chunks to add."""
    import numpy as np

    seconds = float(doc["window"]["seconds"])
    data = np.ma.masked_invalid(np.asarray(cells, dtype=float).reshape(len(labels), -1))
    height = 1.6 + 0.22 * max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    try:
        cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0.0, vmax=1.0,
                          extent=(0.0, seconds, len(labels), 0.0))  # fmt: skip
        ax.set_yticks([i + 0.5 for i in range(len(labels))], labels, fontsize=7)
        if split:
            ax.axhline(split, color="white", linewidth=2)
        ax.set_xlabel("seconds from the start of the window")
        ax.set_title(title, fontsize=10)
        fig.colorbar(image, ax=ax, label=scale, fraction=0.03, pad=0.01)
        fig.tight_layout()
        # No software name or date: the same document draws the same bytes here.
        fig.savefig(path, format="png", metadata={"Software": None, **(text or {})})
    finally:
        plt.close(fig)
    return path


def draw(doc: dict[str, Any], out: Path, prefix: str = "", text: dict[str, str] | None = None) -> list[Path]:
    """bandwidth.png and activity.png of a profile document into `out` (each name after
    `prefix`); Unavailable without matplotlib. `text`: PNG text chunks each file carries
    (the documentation's copies carry what they were drawn from: bench/plots.py)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    columns = int(doc["window"]["columns"])
    rows = doc["rows"]
    device = doc["device"]
    where = f"{device.get('name')} ({device.get('backend')})"
    bandwidth = device.get("copy_bandwidth_bytes_per_s")
    copy = f"{bandwidth / 1e9:.1f} GB/s copy" if bandwidth else "copy bandwidth not measured"
    known = [r for r in rows if r["bandwidth_share_by_column"] is not None]
    labels = [_label(r) for r in known]
    cells = [_nan(r["bandwidth_share_by_column"], columns) for r in known]
    if not known:
        labels, cells = ["(no row's bytes are known)"], [[math.nan] * columns]
    unknown = len(rows) - len(known)
    title = f"Share of the copy bandwidth ({copy}), {where}"
    if unknown:
        title += f"; {unknown} rows of unknown bytes left out"
    paths = [_draw(plt, labels, cells, doc, title, "bandwidth share", out / f"{prefix}bandwidth.png", text=text)]
    labels = [_label(r) for r in rows]
    cells = [[math.nan if b is None else min(1.0, float(b)) for b in r["busy"]] for r in rows]
    samples = doc["samples"]
    for gpu in samples["gpus"]:
        source = samples["source"]
        labels.append(f"sampled: GPU {gpu['index']} load ({source})")
        cells.append(_nan(gpu["load_by_column"], columns))
        labels.append(f"sampled: GPU {gpu['index']} memory controller ({source})")
        cells.append(_nan(gpu["memory_controller_by_column"], columns))
    labels.append("sampled: CPU load (/proc/stat)")
    cells.append(_nan(samples["cpu_load_by_column"], columns))
    title = f"Activity: share of each column busy, {where}"
    paths.append(
        _draw(plt, labels, cells, doc, title, "busy share", out / f"{prefix}activity.png", split=len(rows), text=text)
    )
    return paths
