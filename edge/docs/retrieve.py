"""Retrieval for `qa` jobs: the question embedded, the collection's index searched, the
top passages put into the prompt with their ids (edge/docs/citations.py checks what the
answer then cites).

Passages go into the context as the clinic adapter was trained to read them,
`[doc: <chunk id>] <text>` one a line (engines/text/clinic_data.py), and it cites them as
`(source: <chunk id>)`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge.docs import index
from edge.docs.citations import Asked, held_words
from edge.docs.store import Collection, CollectionError, DocStore

logger = logging.getLogger(__name__)

POOL = 64  # nearest chunks ranked again by the question's names
ASKS_BONUS = 0.02  # added to the score of a chunk sharing a word with what the question asks


class QueryEncoder(Protocol):
    @property
    def model(self) -> str: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class Passage:
    id: str
    score: float
    text: str
    title: str


def context_of(passages: list[Passage]) -> str:
    """The passages as the prompt's context, each tagged with its id."""
    return "\n".join(f"[doc: {p.id}] {p.text}" for p in passages)


class Retriever:
    """Searches the collections under a DocStore. A collection's chunks and index are
    read once per version and kept (a new version, from `edgectl docs add` while the
    daemon runs, is read at the next search); `encoder` is called for the question."""

    def __init__(self, store: DocStore, encoder: QueryEncoder, threads: int = 0) -> None:
        self.store = store
        self.encoder = encoder
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, list[Any], index.VectorIndex]] = {}
        index.set_threads(threads)

    def _collection(self, name: str) -> tuple[list[Any], index.VectorIndex]:
        """The live version's chunks and index, kept by the version's name: a name holds
        its content's hash (edge/docs/store.py), so a collection removed and added again
        is never served from what was kept of the one before."""
        version = self.store.current(name)
        if version is None:
            raise CollectionError(f"no collection named {name!r}")
        with self._lock:
            held = self._open.get(name)
            if held is not None and held[0] == version:
                return held[1], held[2]
        try:
            collection, vectors = self._read(name)
        except CollectionError:
            if self.store.current(name) == version:
                raise
            # A change switched versions while this read the old one (and swept it away).
            collection, vectors = self._read(name)
        with self._lock:
            self._open[name] = (collection.version, collection.chunks, vectors)
        return collection.chunks, vectors

    def _read(self, name: str) -> tuple[Collection, index.VectorIndex]:
        collection = self.store.load(name)
        try:
            vectors = index.VectorIndex.read(self.store.version_dir(name, collection.version))
        except (OSError, ValueError) as err:
            raise CollectionError(
                f"collection {name!r} has no readable index ({err}); add its documents again"
            ) from err
        if vectors.meta.model != self.encoder.model:
            raise CollectionError(
                f"collection {name!r} was embedded with {vectors.meta.model}, not {self.encoder.model}; "
                "add its documents again"
            )
        return collection, vectors

    def search(self, name: str, question: str, top_k: int) -> tuple[list[Passage], dict[str, float]]:
        """The top_k passages of collection `name` for `question` (best first), and the
        milliseconds taken to embed the question and to search.

        The nearest POOL chunks are ranked again by how many of the names the question asks
        about (edge/docs/citations.py: a medicine, a ward code, a model number) each holds,
        then by whether it shares a word with what the question asks (citations.addresses),
        nearest first among equals: a sentence encoder sees "Ward 3B" and "Ward 3C", or
        Dexidone and Dexolan, as nearly the same text, where the question turns on exactly
        that difference, and ranks a ward's visiting hours near its mealtimes."""
        chunks, vectors = self._collection(name)
        t0 = time.perf_counter()
        query = self.encoder.embed([question])[0]
        t1 = time.perf_counter()
        hits = vectors.search(query, max(top_k, POOL))
        t2 = time.perf_counter()
        passages = [Passage(chunks[row].id, score, chunks[row].text, chunks[row].title) for row, score in hits]
        asked = Asked.of(question)

        def rank(p: Passage) -> tuple[int, float]:
            named = len(asked.names & held_words(f"{p.title}\n{p.text}"))
            return -named, -(p.score + ASKS_BONUS * asked.answered_by(f"{p.title}. {p.text}"))

        passages.sort(key=rank)
        return passages[:top_k], {"embed": (t1 - t0) * 1000.0, "search": (t2 - t1) * 1000.0}
