"""The documentation's plots, drawn from bench/results/*.json (bench/render.py writes them).

Each PNG carries a fingerprint of what it was drawn from (the results it reads and the
source of the function that draws it) in a text chunk, so `python -m bench.render --check` can
tell a stale plot without matplotlib and without comparing pixels, which differ between
matplotlib and FreeType versions. A plot whose results are unchanged is not redrawn.

A profile document's heat maps (`HeatMaps`) are drawn by `edgectl profile`'s own code
(edge/profiling/heatmap.py) and fingerprinted the same way; where their document is not in
bench/results, no heat map may be on the pages: `--check` calls one left there stale, and
rendering removes it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS
from edge.profiling import heatmap

PLOT_DIR = REPO / "docs" / "plots"
FINGERPRINT_KEY = "edge-source"
GIB = 1 << 30

Results = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Plot:
    name: str  # docs/plots/NAME.png
    sources: tuple[str, ...]  # bench/results files it reads; drawn only when all exist
    draw: Callable[[Results, Any], None]  # (results by file name, matplotlib Figure)
    size: tuple[float, float]

    @property
    def path(self) -> Path:
        return PLOT_DIR / f"{self.name}.png"

    @property
    def shown(self) -> str:
        """Its path as a message gives it: relative to the repository where inside it."""
        return str(self.path.relative_to(REPO)) if self.path.is_relative_to(REPO) else str(self.path)


def _edge_label(row: dict[str, Any]) -> str:
    if row["name"].startswith("llama.cpp"):
        return "llama.cpp Q4_0"
    return f"edge {row.get('kernel', '')}".strip()


def draw_decode_cuda(results: Results, fig: Any) -> None:
    d = results["text_cuda.json"]
    rows = [r for r in d["rows"] if "decode_tok_s" in r and not r["name"].startswith("HF")]
    labels = [_edge_label(r) for r in rows]
    colours = ["#7f7f7f" if r["name"].startswith("llama.cpp") else "#1f77b4" for r in rows]
    long = d.get("long_context_tokens", 4096)
    panels = [
        (f"decode tok/s, {d['prompt_tokens']} context", [r["decode_tok_s"] for r in rows]),
        (f"decode tok/s, {long} context", [r.get("decode_tok_s_4k", 0.0) for r in rows]),
        (f"time to first token, ms ({d['prompt_tokens']} tokens)", [r["ttft_ms"] for r in rows]),
        ("peak memory, GiB (GPU + host)", [r["peak_gib"] for r in rows]),
    ]
    axes = fig.subplots(1, len(panels))
    for ax, (title, values) in zip(axes, panels, strict=True):
        bars = ax.barh(range(len(rows)), values, color=colours)
        ax.bar_label(bars, fmt="%.1f" if max(values) > 20 else "%.2f", padding=2, fontsize=8)
        ax.set_yticks(range(len(rows)), labels if ax is axes[0] else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.margins(x=0.25)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{d['device']}, Llama-3-8B shape INT4, batch 1, same run (text_cuda.json)", fontsize=10)


def draw_batching_cuda(results: Results, fig: Any) -> None:
    d = results["text_cuda.json"]
    ax = fig.subplots()
    peer = next((r for r in d["rows"] if r["name"].startswith("llama.cpp")), None)
    for r in d["rows"]:
        batched = r.get("batched")
        if not batched:
            continue
        n = [b["sequences"] for b in batched]
        ax.plot(n, [b["aggregate_tok_s"] for b in batched], "o-", label=f"{_edge_label(r)}, whole run")
        ax.plot(n, [b["decode_aggregate_tok_s"] for b in batched], "s--", label=f"{_edge_label(r)}, decode steps")
        ax.set_xticks(n)
    if peer is not None:
        ax.axhline(peer["decode_tok_s"], color="#7f7f7f", linestyle=":", label="llama.cpp, one sequence")
    ax.set_xlabel("sequences decoded together (continuous batching)")
    ax.set_ylabel("tokens/s, all sequences")
    ax.set_title(f"{d['device']}: aggregate decode (text_cuda.json)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def draw_latency_daemon(results: Results, fig: Any) -> None:
    """p50 and p99 per task, alone and beside Q&A, on each device; and the vision batch
    sizes the scheduler formed (a distribution, from the daemon's own counts)."""
    names = [n for n in ("daemon_cpu.json", "daemon_cuda.json") if n in results]
    axes = fig.subplots(2, len(names), squeeze=False)
    for col, name in enumerate(names):
        d = results[name]
        ax = axes[0][col]
        bars: list[tuple[str, float, float]] = []
        for phase in ("alone", "with_qa"):
            for task, t in d[phase]["tasks"].items():
                suffix = " (beside qa)" if phase == "with_qa" and task != "qa" else ""
                bars.append((f"{task}{suffix}", t["p50_ms"], t["p99_ms"]))
        y = range(len(bars))
        ax.barh([i - 0.2 for i in y], [b[1] for b in bars], height=0.4, label="p50", color="#1f77b4")
        ax.barh([i + 0.2 for i in y], [b[2] for b in bars], height=0.4, label="p99", color="#ff7f0e")
        ax.set_yticks(list(y), [b[0] for b in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms, send to result", fontsize=8)
        ax.set_title(f"{d['device']}: job latency ({name})", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        sizes = {int(k): v for k, v in d["branches"]["vision"]["batch_sizes"].items()}
        ax = axes[1][col]
        ax.bar(list(sizes), list(sizes.values()), color="#2ca02c")
        ax.set_xlabel("vision batch size", fontsize=8)
        ax.set_ylabel("batches", fontsize=8)
        ax.set_title("batches the vision branch ran, by size", fontsize=9)
    fig.suptitle("the daemon under the camera load (bench/daemon.py)", fontsize=10)


def draw_memory_daemon(results: Results, fig: Any) -> None:
    """What the ledger counts at ready, model by model and the KV pool, beside the
    measured peaks and the budget, on each device."""
    names = [n for n in ("daemon_cpu.json", "daemon_cuda.json") if n in results]
    ax = fig.subplots()
    for i, name in enumerate(names):
        d = results[name]
        bottom = 0.0
        for m in d["models_in_status"]:
            size = m["memory_bytes"] / GIB
            ax.bar(i, size, bottom=bottom, width=0.5, edgecolor="white")
            # Beside the bar, one line each: a small model's slice is thinner than a label.
            short = "-".join(m["name"].split("-")[:3])
            ax.text(i - 0.27, bottom + size / 2, f"{short} {size:.2f} GiB", ha="right", va="center", fontsize=7)
            bottom += size
        kv = d["kv"]["capacity_bytes"] / GIB
        ax.bar(i, kv, bottom=bottom, width=0.5, color="#c7c7c7", edgecolor="white")
        ax.text(i - 0.27, bottom + kv / 2, f"KV pool {kv:.2f} GiB", ha="right", va="center", fontsize=7)
        for key, style, label, align in (
            ("ledger_peak_bytes", "--", "ledger peak", "bottom"),
            ("process_peak_bytes", ":", "measured peak", "top"),
        ):
            value = d[key] / GIB
            ax.hlines(value, i - 0.25, i + 0.25, colors="black", linestyles=style)
            ax.text(i + 0.27, value, f"{label} {value:.2f} GiB", va=align, fontsize=7)
    budget = max(results[n]["budget_bytes"] for n in names) / GIB
    ax.axhline(budget, color="#d62728", label=f"budget {budget:g} GiB")
    ax.set_xticks(range(len(names)), [f"{results[n]['device']}\n({results[n]['memory_scope']})" for n in names])
    ax.set_xlim(-0.9, len(names) - 0.2)
    ax.set_ylabel("GiB")
    ax.set_title("memory per model at ready, and the peaks under load (daemon_*.json)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


PLOTS = (
    Plot("decode_cuda", ("text_cuda.json",), draw_decode_cuda, (12.0, 2.8)),
    Plot("batching_cuda", ("text_cuda.json",), draw_batching_cuda, (6.5, 4.0)),
    Plot("latency_daemon", ("daemon_cpu.json", "daemon_cuda.json"), draw_latency_daemon, (11.0, 6.5)),
    Plot("memory_daemon", ("daemon_cpu.json", "daemon_cuda.json"), draw_memory_daemon, (8.0, 5.5)),
)


def load(plot: Plot, results_dir: Path = RESULTS) -> Results | None:
    """The results `plot` reads, or None where one is missing."""
    paths = [results_dir / s for s in plot.sources]
    if not all(p.exists() for p in paths):
        return None
    return {p.name: json.loads(p.read_text()) for p in paths}


def fingerprint(plot: Plot, results: Results) -> str:
    digest = hashlib.sha256(inspect.getsource(plot.draw).encode())
    for name in sorted(results):
        digest.update(name.encode())
        digest.update(json.dumps(results[name], sort_keys=True).encode())
    return digest.hexdigest()


def stored_fingerprint(path: Path) -> str | None:
    """The fingerprint a PNG was written with (Pillow reads PNG text chunks)."""
    if not path.exists():
        return None
    from PIL import Image

    with Image.open(path) as image:
        text = getattr(image, "text", {})
        value = text.get(FINGERPRINT_KEY)
        return str(value) if value is not None else None


def stale(plots: tuple[Plot, ...] = PLOTS) -> list[str]:
    """Plots whose PNG is missing or was drawn from other results than today's."""
    out = []
    for plot in plots:
        results = load(plot)
        if results is not None and stored_fingerprint(plot.path) != fingerprint(plot, results):
            out.append(plot.shown)
    return out


def write(plots: tuple[Plot, ...] = PLOTS) -> list[str]:
    """Draw every plot whose results exist and changed; returns the paths written."""
    written = []
    for plot in plots:
        results = load(plot)
        if results is None:
            continue
        mark = fingerprint(plot, results)
        if stored_fingerprint(plot.path) == mark:
            continue
        try:
            import matplotlib
        except ImportError as err:
            raise SystemExit("drawing the plots needs matplotlib: scripts/setup.sh --dev") from err
        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        fig = Figure(figsize=plot.size, dpi=100, layout="constrained")
        plot.draw(results, fig)
        plot.path.parent.mkdir(parents=True, exist_ok=True)
        # No software name or date in the file: it changes only when its results do.
        fig.savefig(plot.path, format="png", metadata={"Software": None, FINGERPRINT_KEY: mark})
        written.append(plot.shown)
    return written


@dataclass(frozen=True)
class HeatMaps:
    """The heat maps of a profile document in bench/results: docs/plots/NAME_bandwidth.png
    and NAME_activity.png."""

    name: str
    source: str  # a bench/results file `edgectl profile` wrote (profile.json, kept)

    def paths(self) -> list[Path]:
        return [PLOT_DIR / f"{self.name}_{kind}.png" for kind in ("bandwidth", "activity")]


PROFILE_MAPS = (HeatMaps("profile_cuda", "profile_cuda.json"),)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def maps_fingerprint(maps: HeatMaps, doc: dict[str, Any]) -> str:
    digest = hashlib.sha256(inspect.getsource(heatmap).encode())
    digest.update(maps.source.encode())
    digest.update(json.dumps(doc, sort_keys=True).encode())
    return digest.hexdigest()


def _document(maps: HeatMaps, results_dir: Path) -> dict[str, Any] | None:
    path = results_dir / maps.source
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def stale_maps(maps: tuple[HeatMaps, ...] = PROFILE_MAPS, results_dir: Path = RESULTS) -> list[str]:
    """Heat maps missing or drawn from another document than today's, and heat maps on the
    pages whose document is not in bench/results."""
    out = []
    for m in maps:
        doc = _document(m, results_dir)
        for path in m.paths():
            if doc is None:
                if path.exists():
                    out.append(_shown(path))
            elif stored_fingerprint(path) != maps_fingerprint(m, doc):
                out.append(_shown(path))
    return out


def write_maps(maps: tuple[HeatMaps, ...] = PROFILE_MAPS, results_dir: Path = RESULTS) -> list[str]:
    """Draw the heat maps whose document exists and changed, remove those whose document
    does not; returns what was done, a line each ("drew PATH", "removed PATH (...)")."""
    done = []
    for m in maps:
        doc = _document(m, results_dir)
        paths = m.paths()
        if doc is None:
            for path in paths:
                if path.exists():
                    path.unlink()
                    done.append(f"removed {_shown(path)} (no bench/results/{m.source})")
            continue
        mark = maps_fingerprint(m, doc)
        if all(stored_fingerprint(p) == mark for p in paths):
            continue
        try:
            drawn = heatmap.draw(doc, paths[0].parent, prefix=f"{m.name}_", text={FINGERPRINT_KEY: mark})
        except heatmap.Unavailable as err:
            raise SystemExit("drawing the heat maps needs matplotlib: scripts/setup.sh --dev") from err
        done += [f"drew {_shown(p)}" for p in drawn]
    return done
