"""Text engines for benchmarks and evaluations: the shipped profile's qa section for a
device, with the fields a measurement changes named, built by `TextEngine.load` as the
daemon builds it. Every figure row carries `engine_config` (what the engine resolved
to, with the profile and the changed fields) and `served` (whether that is what the
shipped profile serves)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.common import REPO
from edge.config.loader import load_profile
from edge.config.profile import Profile
from edge.config.text import QAModelConfig
from edge.text.engine import TextEngine, variant
from edge.text.model.checkpoint import CPU_KERNELS
from edge.text.runtime.generate import SamplingParams
from engines.text.text_build import serving_group

# The profile a device ships with: what `edgectl serve` runs there unless told otherwise.
SHIPPED = {"cpu": "cpu-dev", "cuda": "gpu-dev"}
# Fields a measurement may set without leaving the served configuration: which
# checkpoint it loads, and how much context, how many sequences and tokens it measures.
NEUTRAL = frozenset({"engine", "max_context_tokens", "max_sequences", "max_new_tokens", "threads"})


def shipped_profile(device: str) -> Profile:
    return load_profile(REPO / "profiles" / f"{SHIPPED[device]}.yaml")


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def section(device: str, **changes: Any) -> tuple[QAModelConfig, dict[str, Any]]:
    """The shipped qa section for `device` with `changes`, and its origin record."""
    cfg = variant(shipped_profile(device).models.qa, device=device, **changes)
    origin = {"profile": SHIPPED[device], "changed": {k: _plain(v) for k, v in sorted(changes.items())}}
    return cfg, origin


def load_engine(checkpoint: Path, device: str, warm: bool = True, **changes: Any) -> TextEngine:
    """The engine the daemon would build for `device` from its shipped profile, serving
    `checkpoint`, with `changes` to the qa section (named in its config's origin)."""
    cfg, origin = section(device, engine=checkpoint, **changes)
    return TextEngine.load(checkpoint, cfg, origin=origin, warm=warm)


def profile_engine(profile: Path, origin: dict[str, Any]) -> TextEngine:
    """The engine a whole profile file's qa section builds, as `edgectl serve` with that
    profile builds it (its thread counts this box's share, as the daemon makes them);
    `origin` names the shipped profile and the fields it changed."""
    cfg = load_profile(profile).models.with_cpu_threads(len(os.sched_getaffinity(0))).qa
    if cfg.engine is None:
        raise ValueError(f"{profile}: models.qa.engine is not set")
    return TextEngine.load(cfg.engine, cfg, origin=origin)


def served_cpu_kernel() -> str:
    """The INT4 kernel today's shipped CPU profile serves (where the box compiles ours)."""
    return CPU_KERNELS.get(shipped_profile("cpu").models.qa.cpu_kernel, "cpu")


def is_served(config: dict[str, Any]) -> bool:
    """Whether an engine's resolved configuration is what the shipped profile serves on
    its device today: built from that profile, changing only neutral fields, from a
    checkpoint quantized as `edgectl build` quantizes, on the CPU with the kernel the
    profile names (a figure measured before the profile changed its kernel is not)."""
    origin = config.get("origin") or {}
    changed = set(origin.get("changed") or {})
    return (
        origin.get("profile") == SHIPPED.get(config["device"])
        and changed <= NEUTRAL
        and config.get("group_size") == serving_group(int(config.get("parameters") or 0))
        and (config["device"] != "cpu" or config.get("kernel") == served_cpu_kernel())
    )


def engine_fields(engine: TextEngine) -> dict[str, Any]:
    """The two keys every text figure row carries."""
    config = engine.config()
    return {"engine_config": config, "served": is_served(config)}


def fixed(new_tokens: int) -> SamplingParams:
    """Greedy, exactly `new_tokens` tokens: a timed or compared run does not end where the
    model would stop."""
    return SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
