"""Collections of chunked documents in the state directory, changed all or nothing.

A collection is a folder of versions and a pointer to the live one:

    <root>/<collection>/CURRENT      the live version's name, replaced atomically
    <root>/<collection>/v000003/     chunks.jsonl, documents.json (and what else a commit adds)

A change writes a whole new version beside the live one (a temporary folder, each file
synced, then renamed into place), then points CURRENT at it (a temporary file renamed
over it, the folder synced), then lets the old version go. Killed at any point (kill -9,
a power cut), the collection is the old version or the new one, never a mix: a version
folder is complete before CURRENT can name it, and what a killed change left half
written is swept away the next time the collection is opened.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.docs.chunking import Chunk

logger = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
VERSION = re.compile(r"v(\d{6})")
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

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "CURRENT").is_file())

    def current(self, name: str) -> str | None:
        pointer = self._dir(name) / "CURRENT"
        try:
            version = pointer.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
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
        documents = [Document(**d) for d in json.loads((folder / "documents.json").read_text(encoding="utf-8"))]
        with open(folder / "chunks.jsonl", encoding="utf-8") as f:
            chunks = [Chunk(**json.loads(line)) for line in f if line.strip()]
        return Collection(name, version, documents, chunks)

    def sweep(self, name: str) -> None:
        """Remove what is not the live version: old versions and half-written ones."""
        folder = self._dir(name)
        live = self.current(name)
        for entry in folder.iterdir() if folder.is_dir() else []:
            if entry.name in ("CURRENT", live):
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

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
        folder.mkdir(parents=True, exist_ok=True)
        self.sweep(name)
        step = on_step or (lambda _: None)
        live = self.current(name)
        number = int(live[1:]) + 1 if live else 1
        version = f"v{number:06d}"
        staging = folder / f"{version}.tmp"
        staging.mkdir()
        step("writing")
        lines = "".join(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in chunks)
        _write(staging / "chunks.jsonl", lines.encode("utf-8"))
        _write(staging / "documents.json", json.dumps([asdict(d) for d in documents], indent=1).encode("utf-8"))
        for file_name, data in (extra or {}).items():
            _write(staging / file_name, data)
        _fsync_dir(staging)
        staging.rename(folder / version)
        _fsync_dir(folder)
        step("written")
        pointer = folder / "CURRENT.tmp"
        _write(pointer, version.encode("ascii"))
        os.replace(pointer, folder / "CURRENT")
        _fsync_dir(folder)
        step("switched")
        self.sweep(name)
        step("done")
        logger.info("collection %s: version %s, %d documents, %d chunks", name, version, len(documents), len(chunks))
        return version

    def remove(self, name: str) -> None:
        """Remove a whole collection: first out of sight (renamed), then deleted."""
        folder = self._dir(name)
        if self.current(name) is None:
            raise CollectionError(f"no collection named {name!r}")
        gone = self.root / f".removed-{name}"
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(folder, gone)
        _fsync_dir(self.root)
        shutil.rmtree(gone, ignore_errors=True)

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for name in self.names():
            collection = self.load(name)
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
