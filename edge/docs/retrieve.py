"""Retrieval for `qa` jobs: the question embedded, the collection's index searched, the
top passages put into the prompt with their ids; then the answer's citations checked
against what was retrieved.

Passages go into the context as the clinic adapter was trained to read them,
`[doc: <chunk id>] <text>` one a line (engines/text/clinic_data.py), and it cites them as
`(source: <chunk id>)`. A citation is checked, never passed on silently:
- `retrieved`: the id is one of the passages this job retrieved (a model can make ids up);
- `overlap`: the share of the citing sentence's content words (lower-cased words of 3
  letters or more, less common function words; and numbers) found in the passage;
- `supported`: retrieved, and every sentence citing it at SUPPORT_MIN overlap or more.
A sentence is the text from the end of the previous sentence (or citation) to its
citation; one whose words all precede another citation is judged by that sentence.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge.docs import index
from edge.docs.store import Collection, CollectionError, DocStore

logger = logging.getLogger(__name__)

CITATION = re.compile(r"\(\s*source:\s*([^()]+?)\s*\)", re.IGNORECASE)
WORD = re.compile(r"[a-z0-9]+(?:[.,:][0-9]+)*")
SENTENCE_END = re.compile(r"[.!?](?:\s+|$)|\n")
SUPPORT_MIN = 0.5
STOPWORDS = frozenset(
    """the and for are but not you all any can her was one our out day get has him his how man new now old see two
    way who its let put say she too use with that this from they have been were will your what when which their there
    them then than into also only some such more most very just over under about after before while where does did
    each other should would could may might must shall these those here being because between both during through
    until again further once why own same nor off yes""".split()
)


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
        milliseconds taken to embed the question and to search."""
        chunks, vectors = self._collection(name)
        t0 = time.perf_counter()
        query = self.encoder.embed([question])[0]
        t1 = time.perf_counter()
        hits = vectors.search(query, top_k)
        t2 = time.perf_counter()
        passages = [Passage(chunks[row].id, score, chunks[row].text, chunks[row].title) for row, score in hits]
        return passages, {"embed": (t1 - t0) * 1000.0, "search": (t2 - t1) * 1000.0}


def content_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if (len(w) >= 3 or w.isdigit()) and w not in STOPWORDS}


def _citing_sentences(answer: str) -> list[tuple[str, str]]:
    """(cited id, the sentence citing it) for every citation in the answer, in order."""
    out: list[tuple[str, str]] = []
    start = 0
    last_words = ""
    for match in CITATION.finditer(answer):
        before = answer[start : match.start()]
        ends = [m.end() for m in SENTENCE_END.finditer(before) if m.end() < len(before.rstrip())]
        sentence = before[ends[-1] :] if ends else before
        if not content_words(sentence):  # "... (source: a) (source: b)": b cites a's sentence
            sentence = last_words
        for cited in (part.strip() for part in match.group(1).split(",")):
            if cited:
                out.append((cited, sentence))
        last_words = sentence
        start = match.end()
    return out


def cited_ids(answer: str) -> list[str]:
    """Every id the answer cites, in order (repeats kept), as check_citations reads them."""
    return [cited for cited, _ in _citing_sentences(answer)]


def check_citations(answer: str, passages: list[Passage]) -> list[dict[str, Any]]:
    """One entry per cited id, in the order first cited: id, the retrieval score (None if
    it was not retrieved), retrieved, overlap (the lowest over its sentences) and
    supported."""
    by_id = {p.id: p for p in passages}
    found: dict[str, dict[str, Any]] = {}
    for cited, sentence in _citing_sentences(answer):
        passage = by_id.get(cited)
        words = content_words(sentence)
        overlap = 0.0
        if passage is not None and words:
            overlap = len(words & content_words(f"{passage.title} {passage.text}")) / len(words)
        entry = found.setdefault(
            cited,
            {
                "id": cited,
                "score": None if passage is None else round(passage.score, 4),
                "retrieved": passage is not None,
                "overlap": overlap,
                "supported": True,
            },
        )
        entry["overlap"] = round(min(entry["overlap"], overlap), 3)
        entry["supported"] = bool(entry["supported"] and passage is not None and overlap >= SUPPORT_MIN)
    return list(found.values())
