"""Adding documents to a collection and taking them out: read, cut into chunks,
embedded, and committed as one new version of the collection (edge/docs/store.py) with
its vector index (edge/docs/index.py), all or nothing.

Files are read first, every one of them; a file that cannot be read (its type, its size,
its encoding, a damaged or hostile PDF, whatever the reason) stops the whole change with
its name and the reason, and the collection stays as it was. A folder's files are its
own: a link in it that leads outside it is skipped, and said. Chunks the collection
already held keep their vectors (read back from its index) unless the encoder has
changed; only new chunks are embedded. From reading the live version to switching to the
new one, a change holds the collection's change lock (edge/docs/store.py): concurrent
changes land one after the other, none lost."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge.docs import index
from edge.docs.chunking import Chunk, chunk_sections
from edge.docs.extract import KINDS, DocumentError, extract
from edge.docs.names import printable
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


def documents_in(paths: list[Path], skipped: Callable[[str], None] | None = None) -> list[Path]:
    """The files named, and the supported files under the folders named (sorted). Links
    inside a folder are followed only where they stay inside it (one leading out would
    read a file nobody named); each left out is told to `skipped`."""
    say = skipped or (lambda _: None)
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            found.append(path)
            continue
        root = path.resolve()
        inside: list[Path] = []
        # Links to folders are not walked into: one inside the folder is walked as itself.
        for top, folders, files in os.walk(path, followlinks=False):
            links = [Path(top, f) for f in files if Path(f).suffix.lower() in KINDS] + [Path(top, d) for d in folders]
            for entry in links:
                if not entry.is_symlink():
                    continue
                target = entry.resolve()
                if not target.is_relative_to(root):
                    link, to = printable(str(entry)), printable(str(target))
                    say(f"skipped {link}: a link to {to}, outside {printable(str(path))}")
            inside += [
                Path(top, f)
                for f in files
                if Path(top, f).suffix.lower() in KINDS
                and Path(top, f).is_file()
                and Path(top, f).resolve().is_relative_to(root)
            ]
        found += sorted(inside)
    return found


def _read(path: Path, limits: Limits) -> tuple[Document, list[Chunk], int]:
    """A file's Document, its chunks and its count of sections; every failure a
    DocumentError naming the file."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        raise DocumentError(path, "its name is not UTF-8") from None
    try:
        sections = extract(path, limits.max_file_bytes)
        if not sections:
            raise DocumentError(path, "no text in it")
        chunks = chunk_sections(path.name, sections)
        raw = path.read_bytes()
    except DocumentError:
        raise
    except OSError as err:
        raise DocumentError(path, f"cannot be read: {err.strerror or err}") from err
    except Exception as err:
        # Whatever a hostile file makes a parser do, it stops this change, naming the file.
        raise DocumentError(path, f"cannot be read: {type(err).__name__}: {err}") from err
    document = Document(path.name, str(path), hashlib.sha256(raw).hexdigest(), len(raw), len(chunks))
    return document, chunks, len(sections)


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
    files = documents_in(paths, say)
    if not files:
        raise CollectionError("no documents to add")
    if len(files) > limits.max_files:
        raise CollectionError(f"{len(files)} files; the limit is {limits.max_files} a change")
    names = [f.name for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CollectionError(f"two documents would have the same name: {printable(', '.join(twice))}")
    new_docs: list[Document] = []
    new_chunks: list[Chunk] = []
    for i, path in enumerate(files, 1):
        document, chunks, sections = _read(path, limits)
        new_docs.append(document)
        new_chunks += chunks
        say(f"[{i}/{len(files)}] {printable(path.name)}: {sections} sections, {len(chunks)} chunks")
    waiting = lambda: say(f"collection {name}: another change of it is under way; waiting for it")  # noqa: E731
    with store.changing(name, on_wait=waiting):
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
    with store.changing(name):
        old = store.load(name)
        missing = sorted(set(documents) - {d.name for d in old.documents})
        if missing:
            raise CollectionError(f"collection {name!r} has no document {printable(', '.join(missing))}")
        gone = set(documents)
        kept = [d for d in old.documents if d.name not in gone]
        chunks = [c for c in old.chunks if c.document not in gone]
        vectors = _vectors(store, old, chunks, encoder, lambda _: None)
        return store.commit(name, kept, chunks, extra=index.serialize(vectors, encoder.model))
