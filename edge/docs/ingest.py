"""Adding documents to a collection and taking them out: read, cut into chunks, and
committed as one new version of the collection (edge/docs/store.py), all or nothing.

Files are read first, every one of them; a file that cannot be read (its type, its size,
its encoding, a damaged PDF) stops the whole change with its name and the reason, and the
collection stays as it was."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge.docs.chunking import Chunk, chunk_sections
from edge.docs.extract import KINDS, DocumentError, extract
from edge.docs.store import CollectionError, DocStore, Document

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 32 << 20
    max_files: int = 10_000
    max_chunks: int = 200_000


def documents_in(paths: list[Path]) -> list[Path]:
    """The files named, and the supported files under the folders named (sorted)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in KINDS)
        else:
            found.append(path)
    return found


def add(
    store: DocStore,
    name: str,
    paths: list[Path],
    limits: Limits = Limits(),
    progress: Callable[[str], None] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> str:
    """Add (or replace, by file name) documents in collection `name`; returns the new version."""
    say = progress or (lambda _: None)
    files = documents_in(paths)
    if not files:
        raise CollectionError("no documents to add")
    if len(files) > limits.max_files:
        raise CollectionError(f"{len(files)} files; the limit is {limits.max_files} a change")
    names = [f.name for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CollectionError(f"two documents would have the same name: {', '.join(twice)}")
    new_docs: list[Document] = []
    new_chunks: list[Chunk] = []
    for i, path in enumerate(files, 1):
        sections = extract(path, limits.max_file_bytes)
        if not sections:
            raise DocumentError(path, "no text in it")
        chunks = chunk_sections(path.name, sections)
        raw = path.read_bytes()
        new_docs.append(Document(path.name, str(path), hashlib.sha256(raw).hexdigest(), len(raw), len(chunks)))
        new_chunks += chunks
        say(f"[{i}/{len(files)}] {path.name}: {len(sections)} sections, {len(chunks)} chunks")
    kept_docs: list[Document] = []
    kept_chunks: list[Chunk] = []
    if store.current(name) is not None:
        old = store.load(name)
        replaced = set(names)
        kept_docs = [d for d in old.documents if d.name not in replaced]
        kept_chunks = [c for c in old.chunks if c.document not in replaced]
    chunks = kept_chunks + new_chunks
    if len(chunks) > limits.max_chunks:
        raise CollectionError(f"{len(chunks)} chunks; the limit is {limits.max_chunks} a collection")
    version = store.commit(name, kept_docs + new_docs, chunks, on_step=on_step)
    say(f"collection {name}: {len(kept_docs) + len(new_docs)} documents, {len(chunks)} chunks ({version})")
    return version


def remove_documents(store: DocStore, name: str, documents: list[str]) -> str:
    """Take documents out of a collection by name; returns the new version."""
    old = store.load(name)
    missing = sorted(set(documents) - {d.name for d in old.documents})
    if missing:
        raise CollectionError(f"collection {name!r} has no document {', '.join(missing)}")
    gone = set(documents)
    kept = [d for d in old.documents if d.name not in gone]
    return store.commit(name, kept, [c for c in old.chunks if c.document not in gone])
