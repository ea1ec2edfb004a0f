"""Collections of chunked documents in the state directory, changed all or nothing.

A collection is a folder of versions and a pointer to the live one:

    <root>/<collection>/CURRENT                  the live version's name, replaced atomically
    <root>/<collection>/v000003-<content hash>/  chunks.jsonl, documents.json (and what else
                                                 a commit adds)

A change writes a whole new version beside the live one (a temporary folder, each file
synced, then renamed into place), then points CURRENT at it (a temporary file renamed
over it, the folder synced), then lets the old version go. Killed at any point (kill -9,
a power cut), the collection is the old version or the new one, never a mix: a version
folder is complete before CURRENT can name it, and what a killed change left half
written is swept away the next time the collection is changed. A change that cannot be
written (a full disk) removes what it wrote and leaves the collection as it was.

A version's name is its number and a hash of its content, so a collection removed and
added again with other documents never reuses a name a reader may have cached (the
daemon's retriever keeps a collection's index by its version's name).

Changes of one collection are serialized: each holds an exclusive lock (flock) on
<root>/.locks/<collection>.lock from reading the live version to switching to its own,
so concurrent `edgectl docs add` runs each land whole, one after the other. Readers take
no lock: CURRENT always names a complete version.

A removal renames the collection's folder out of sight (`.removed-<collection>-<random>`)
before deleting it; what a killed removal left there is never listed and is deleted by
the next change or removal.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.docs.chunking import Chunk

logger = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# An older store's versions had the number only; they are still read.
VERSION = re.compile(r"v(\d{6})(?:-[0-9a-f]{12})?")
REMOVED = ".removed-"
LOCKS = ".locks"
# Each step of a commit, in order, for progress (and for tests that stop a commit there).
STEPS = ("writing", "written", "switched", "done")


class CollectionError(ValueError):
    pass


@dataclass(frozen=True)
class Document:
    name: str
    source: str  # the path it was read from
    sha256: str
    bytes: int
    chunks: int


@dataclass
class Collection:
    name: str
    version: str
    documents: list[Document]
    chunks: list[Chunk]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            entry.unlink()


# Per lock file, in this process: a reentrant lock (threads of one process, which one
# flock cannot tell apart: flock belongs to the open file, and the process would block
# itself opening it twice), how deep its holder is, and the flocked descriptor.
_gates: dict[Path, threading.RLock] = {}
_gates_lock = threading.Lock()
_depth: collections.Counter[Path] = collections.Counter()
_descriptors: dict[Path, int] = {}


def _gate(path: Path) -> threading.RLock:
    with _gates_lock:
        return _gates.setdefault(path, threading.RLock())


def _flock(path: Path, on_wait: Callable[[], None] | None) -> int:
    """The lock file at `path`, open and exclusively flocked (waiting for another
    process's change to end)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


class DocStore:
    """The collections under `root` (paths.state_dir/docs)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, name: str) -> Path:
        if not NAME.fullmatch(name):
            raise CollectionError(
                f"collection name {name!r}: 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
            )
        return self.root / name

    @contextlib.contextmanager
    def changing(self, name: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold collection `name`'s change lock: one change of it at a time, across
        processes and threads; a change that finds it taken waits (`on_wait` is told
        once). A change inside another of the same thread (add, then commit) takes it once."""
        path = (self._dir(name).parent / LOCKS / f"{name}.lock").absolute()
        gate = _gate(path)
        if not gate.acquire(blocking=False):
            if on_wait is not None:
                on_wait()
                on_wait = None  # told once
            gate.acquire()
        try:
            if _depth[path] == 0:
                _descriptors[path] = _flock(path, on_wait)
            _depth[path] += 1
            try:
                yield
            finally:
                _depth[path] -= 1
                if _depth[path] == 0:
                    os.close(_descriptors.pop(path))  # closing the descriptor releases the flock
        finally:
            gate.release()

    def names(self) -> list[str]:
        """The collections that have a live version (not what a killed change or removal left)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if NAME.fullmatch(p.name) and (p / "CURRENT").is_file())

    def current(self, name: str) -> str | None:
        pointer = self._dir(name) / "CURRENT"
        try:
            version = pointer.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            raise CollectionError(f"collection {name!r}: its CURRENT cannot be read ({err})") from err
        if not VERSION.fullmatch(version) or not (pointer.parent / version).is_dir():
            raise CollectionError(f"collection {name!r}: CURRENT names {version!r}, which is not a version here")
        return version

    def version_dir(self, name: str, version: str) -> Path:
        return self._dir(name) / version

    def load(self, name: str) -> Collection:
        version = self.current(name)
        if version is None:
            raise CollectionError(f"no collection named {name!r}")
        folder = self._dir(name) / version
        try:
            documents = [Document(**d) for d in json.loads((folder / "documents.json").read_text(encoding="utf-8"))]
            with open(folder / "chunks.jsonl", encoding="utf-8") as f:
                chunks = [Chunk(**json.loads(line)) for line in f if line.strip()]
        except (OSError, ValueError, TypeError) as err:
            raise CollectionError(f"collection {name!r}: version {version} cannot be read ({err})") from err
        return Collection(name, version, documents, chunks)

    def sweep(self, name: str) -> None:
        """Remove what is not the live version: old versions and half-written ones (under
        the change lock: another change's half-written version is its work in progress)."""
        with self.changing(name):
            folder = self._dir(name)
            live = self.current(name)
            for entry in folder.iterdir() if folder.is_dir() else []:
                if entry.name not in ("CURRENT", live):
                    _remove(entry)

    def sweep_removed(self) -> list[str]:
        """Delete what killed removals left out of sight; the collections it was of."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            if entry.name.startswith(REMOVED):
                # `.removed-<name>` (an older store's) or `.removed-<name>-<12 hex>`.
                found.append(re.sub(r"-[0-9a-f]{12}$", "", entry.name[len(REMOVED) :]))
                _remove(entry)
        return found

    def commit(
        self,
        name: str,
        documents: list[Document],
        chunks: list[Chunk],
        extra: dict[str, bytes] | None = None,
        on_step: Callable[[str], None] | None = None,
    ) -> str:
        """Make `documents` and their `chunks` (and `extra` files) the collection's live
        version, all or nothing; returns the version's name."""
        folder = self._dir(name)
        step = on_step or (lambda _: None)
        lines = "".join(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in chunks).encode("utf-8")
        files = {
            "chunks.jsonl": lines,
            "documents.json": json.dumps([asdict(d) for d in documents], indent=1).encode("utf-8"),
            **(extra or {}),
        }
        content = hashlib.sha256()
        for file_name in sorted(files):
            content.update(f"{file_name}\0{len(files[file_name])}\0".encode())
            content.update(files[file_name])
        with self.changing(name):
            self.sweep_removed()
            folder.mkdir(parents=True, exist_ok=True)
            self.sweep(name)
            live = self.current(name)
            number = int(VERSION.fullmatch(live).group(1)) + 1 if live else 1  # type: ignore[union-attr]
            version = f"v{number:06d}-{content.hexdigest()[:12]}"
            # Names of this process's own: whatever else is in the folder is never written over.
            staging = folder / f"{version}.tmp-{uuid.uuid4().hex}"
            pointer = folder / f"CURRENT.tmp-{uuid.uuid4().hex}"
            switched = False
            try:
                staging.mkdir()
                step("writing")
                for file_name, data in files.items():
                    _write(staging / file_name, data)
                _fsync_dir(staging)
                staging.rename(folder / version)
                _fsync_dir(folder)
                step("written")
                _write(pointer, version.encode("ascii"))
                os.replace(pointer, folder / "CURRENT")
                switched = True
                _fsync_dir(folder)
            except OSError as err:
                if switched:
                    raise
                # A full disk, say: nothing of this change stays, on disk or in sight.
                for entry in (staging, folder / version, pointer):
                    _remove(entry)
                raise CollectionError(
                    f"collection {name!r} cannot be written ({err.strerror or err}); it stays as it was"
                ) from err
            step("switched")
            self.sweep(name)
            step("done")
        logger.info("collection %s: version %s, %d documents, %d chunks", name, version, len(documents), len(chunks))
        return version

    def remove(self, name: str) -> bool:
        """Remove a whole collection: first out of sight (renamed), then deleted. Returns
        False where there was none but what a killed removal (or a first change) left,
        now deleted; with nothing at all to remove, a CollectionError."""
        folder = self._dir(name)
        with self.changing(name):
            leftovers = name in self.sweep_removed()
            if self.current(name) is None:
                if folder.is_dir():
                    leftovers = True  # a first change killed before its switch
                    shutil.rmtree(folder, ignore_errors=True)
                if leftovers:
                    return False
                raise CollectionError(f"no collection named {name!r}")
            gone = self.root / f"{REMOVED}{name}-{uuid.uuid4().hex[:12]}"
            os.replace(folder, gone)
            _fsync_dir(self.root)
            shutil.rmtree(gone, ignore_errors=True)
        return True

    def summary(self) -> list[dict[str, Any]]:
        """A row per collection; one that cannot be read is a row saying why."""
        out: list[dict[str, Any]] = []
        for name in self.names():
            try:
                collection = self.load(name)
            except CollectionError as err:
                out.append({"name": name, "error": str(err)})
                continue
            out.append(
                {
                    "name": name,
                    "version": collection.version,
                    "documents": len(collection.documents),
                    "chunks": len(collection.chunks),
                    "bytes": sum(d.bytes for d in collection.documents),
                }
            )
        return out
