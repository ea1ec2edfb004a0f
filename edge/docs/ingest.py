"""Adding documents to a collection and taking them out: read, cut into chunks,
embedded, and committed as one new version of the collection (edge/docs/store.py) with
its vector index (edge/docs/index.py), all or nothing.

Files are read first, every one of them; a file that cannot be read (its type, its size,
its encoding, a damaged PDF) stops the whole change with its name and the reason, and the
collection stays as it was. Chunks the collection already held keep their vectors (read
back from its index) unless the encoder has changed; only new chunks are embedded."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge.docs import index
from edge.docs.chunking import Chunk, chunk_sections
from edge.docs.extract import KINDS, DocumentError, extract
from edge.docs.store import Collection, CollectionError, DocStore, Document

logger = logging.getLogger(__name__)


class Encoder(Protocol):
    """What ingestion needs of the sentence encoder (edge/docs/embed.py's Embedder)."""

    @property
    def model(self) -> str: ...

    def embed(self, texts: list[str], progress: Callable[[int, int], None] | None = None) -> np.ndarray: ...


def passage_text(chunk: Chunk) -> str:
    """What is embedded for a chunk: its section's heading, then its text."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


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
    encoder: Encoder,
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
    old: Collection | None = None
    if store.current(name) is not None:
        old = store.load(name)
        replaced = set(names)
        kept_docs = [d for d in old.documents if d.name not in replaced]
        kept_chunks = [c for c in old.chunks if c.document not in replaced]
    chunks = kept_chunks + new_chunks
    if len(chunks) > limits.max_chunks:
        raise CollectionError(f"{len(chunks)} chunks; the limit is {limits.max_chunks} a collection")
    vectors = _vectors(store, old, chunks, encoder, say)
    extra = index.serialize(vectors, encoder.model)
    version = store.commit(name, kept_docs + new_docs, chunks, extra=extra, on_step=on_step)
    say(f"collection {name}: {len(kept_docs) + len(new_docs)} documents, {len(chunks)} chunks ({version})")
    return version


def _vectors(
    store: DocStore, old: Collection | None, chunks: list[Chunk], encoder: Encoder, say: Callable[[str], None]
) -> np.ndarray:
    """The vectors of `chunks`: an old version's where it holds the chunk (same id, same
    text, same encoder), the encoder's for the rest."""
    known: dict[tuple[str, str], int] = {}
    stored: index.VectorIndex | None = None
    if old is not None:
        try:
            stored = index.VectorIndex.read(store.version_dir(old.name, old.version))
        except (OSError, ValueError) as err:
            logger.warning("collection %s: its index cannot be read (%s); every chunk is embedded again", old.name, err)
        if stored is not None and stored.meta.model == encoder.model:
            known = {(c.id, c.text): row for row, c in enumerate(old.chunks)}
    reuse = [i for i, c in enumerate(chunks) if (c.id, c.text) in known]
    fresh = [i for i, c in enumerate(chunks) if (c.id, c.text) not in known]
    old_vectors = stored.vectors([known[(chunks[i].id, chunks[i].text)] for i in reuse]) if stored and reuse else None
    new_vectors = None
    if fresh:
        step = max(1, len(fresh) // 10)

        def tell(done: int, total: int) -> None:
            if done == total or done % step < 32:
                say(f"embedding {done}/{total} chunks")

        new_vectors = encoder.embed([passage_text(chunks[i]) for i in fresh], progress=tell)
    filled = [(rows, v) for rows, v in ((reuse, old_vectors), (fresh, new_vectors)) if v is not None]
    out = np.zeros((len(chunks), filled[0][1].shape[1] if filled else 0), dtype=np.float32)
    for rows, vectors in filled:
        out[rows] = vectors
    return out


def remove_documents(store: DocStore, name: str, documents: list[str], encoder: Encoder) -> str:
    """Take documents out of a collection by name; returns the new version."""
    old = store.load(name)
    missing = sorted(set(documents) - {d.name for d in old.documents})
    if missing:
        raise CollectionError(f"collection {name!r} has no document {', '.join(missing)}")
    gone = set(documents)
    kept = [d for d in old.documents if d.name not in gone]
    chunks = [c for c in old.chunks if c.document not in gone]
    vectors = _vectors(store, old, chunks, encoder, lambda _: None)
    return store.commit(name, kept, chunks, extra=index.serialize(vectors, encoder.model))
