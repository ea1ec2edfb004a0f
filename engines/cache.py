"""Build outputs keyed by their inputs: a directory per key, published atomically."""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from edge import artifacts

logger = logging.getLogger(__name__)

MANIFEST = artifacts.MANIFEST

# Off inside `existing_only()`: a daemon told not to build engines must find them built.
_BUILDS_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("builds_allowed", default=True)


class EngineMissing(FileNotFoundError):
    """An engine that is not built (or out of date) where building is not allowed."""


def stop_on_sigterm() -> None:
    """In a build process: SIGTERM ends it as an exception would, so the scratch
    directory of the build in progress is removed on the way out (the default action
    would end the process where it stands and leave it)."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def existing_only() -> Iterator[None]:
    token = _BUILDS_ALLOWED.set(False)
    try:
        yield
    finally:
        _BUILDS_ALLOWED.reset(token)


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_key(inputs: dict[str, Any]) -> str:
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of a complete build (serving reads them the same way)."""
    return artifacts.read_manifest(out_dir)


def build_cached(out_dir: Path, inputs: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `build` into a scratch directory and rename it to `out_dir` when it succeeds.

    A directory with a manifest whose inputs match is reused as is; a half-written one
    (a crash mid-build) never has a manifest, so it is rebuilt rather than trusted.
    One build of `out_dir` runs at a time (a lock file beside it): a second waits, then
    finds the first's result. Whoever holds the lock removes the scratch directories of
    builds of `out_dir` that were killed before they could (SIGKILL, a power cut): an
    8B model's leaves gigabytes behind. It also removes those of other outputs in the
    folder where no build of theirs runs (a killed build whose inputs have changed since).
    """
    existing = read_manifest(out_dir)
    if existing is not None and existing.get("inputs") == inputs:
        logger.info("engine %s is up to date", out_dir)
        return out_dir
    if not _BUILDS_ALLOWED.get():
        raise EngineMissing(f"engine {out_dir} is not built; run `edgectl build --profile ...`")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        existing = read_manifest(out_dir)
        if existing is not None and existing.get("inputs") == inputs:
            logger.info("engine %s was built meanwhile", out_dir)
            return out_dir
        _remove_abandoned(out_dir)
        _remove_abandoned_beside(out_dir)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        try:
            details = build(scratch)
            manifest = {"inputs": inputs, **details, "built_at": time.time()}
            (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(scratch, out_dir)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    logger.info("built engine %s", out_dir)
    return out_dir


def _try_lock(path: Path) -> Any:
    """The open, locked lock file `path` if no one holds it now, else None (no waiting;
    nor where it cannot be opened: another user's build, say)."""
    try:
        fh = path.open("a")
    except OSError:
        return None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    if not _names(path, fh):  # removed or replaced meanwhile by its holder: someone else's turn
        fh.close()
        return None
    return fh


def _names(path: Path, fh: Any) -> bool:
    """Whether `path` still names the open lock file `fh` (its holder removes it when done)."""
    try:
        return path.stat().st_ino == os.fstat(fh.fileno()).st_ino
    except FileNotFoundError:
        return False


def _release(path: Path, fh: Any) -> None:
    """A held lock file removed (under the lock: see _build_lock) and let go of."""
    path.unlink(missing_ok=True)
    fcntl.flock(fh, fcntl.LOCK_UN)
    fh.close()


def _remove_abandoned_beside(out_dir: Path) -> None:
    """Scratch directories of other outputs in `out_dir`'s folder (a build killed under
    another cache key: its inputs changed since, so no build of that name will clear
    it), each where no build of its output runs now (its lock is free): taken without
    waiting, so a live build elsewhere is never waited for nor touched."""
    scratch = re.compile(r"\.(.+)\.[a-z0-9_]{8}")
    names = set()
    for path in out_dir.parent.glob(".*"):
        found = scratch.fullmatch(path.name)
        if found and found.group(1) != out_dir.name and path.is_dir() and not path.is_symlink():
            names.add(found.group(1))
    for name in sorted(names):
        lock = out_dir.parent / f".{name}.lock"
        fh = _try_lock(lock)
        if fh is None:
            continue
        try:
            _remove_abandoned(out_dir.parent / name)
        finally:
            _release(lock, fh)


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Held while `out_dir` is built; the kernel lets go of it when the process ends,
    however it ends. The lock file is removed by its holder when done, so a build leaves
    nothing beside its output: a waiter that then holds the removed file's lock sees the
    name gone (or naming another file) and locks again, so two builders never hold two
    files of the same name."""
    path = out_dir.parent / f".{out_dir.name}.lock"
    while True:
        fh = path.open("a")
        fcntl.flock(fh, fcntl.LOCK_EX)
        if _names(path, fh):
            break
        fh.close()
    try:
        yield
    finally:
        _release(path, fh)


def _remove_abandoned(out_dir: Path) -> None:
    """Scratch directories of `out_dir`'s builds (tempfile.mkdtemp's `.<name>.<8 random
    characters>`): under the build lock, none belongs to a live build."""
    scratch = re.compile(rf"\.{re.escape(out_dir.name)}\.[a-z0-9_]{{8}}")
    for path in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*"):
        if scratch.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            logger.info("removing %s, left by a build that was stopped", path)
            shutil.rmtree(path, ignore_errors=True)


def tag_serves(out_dir: Path, selector: dict[str, Any]) -> None:
    """Record in a built directory's manifest that it serves `selector` (what serving
    finds it by, edge/artifacts.py), if it does not say so already. One checkpoint can
    serve several selectors (the imported base is also the float model without an
    adapter). The manifest is replaced atomically: a reader sees the old one or the new."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise FileNotFoundError(f"{out_dir} is not a built engine (no manifest)")
    serves = [s for s in manifest.get("serves", []) if isinstance(s, dict)]
    if selector in serves:
        return
    manifest["serves"] = [*serves, selector]
    tmp = out_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / MANIFEST)
