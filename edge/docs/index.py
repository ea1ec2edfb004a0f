"""The vector index of a collection's chunks: FAISS (faiss-cpu), inner product over unit
vectors (cosine similarity), persisted in the collection's version folder beside its
chunks, so the index and the chunks it points at change together, all or nothing.

Up to EXACT_MAX chunks the index is exact (a flat scan: every vector compared); beyond
that it is HNSW, approximate, with its recall against the exact scan measured by
bench/eval_rag.py (bench/results/rag.json). That script times both kinds at 10k and
100k chunks on 2 threads: the flat scan well under a millisecond at 10k, over the 5 ms
goal at 100k, its time growing with the count. EXACT_MAX is set between the two, not
measured at itself.

Row i of the index is chunk i of the version's chunks.jsonl.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
META_FILE = "index.json"
EXACT_MAX = 20_000
HNSW_M = 32  # links per node
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 96  # candidates kept while searching: recall against latency


@dataclass(frozen=True)
class IndexMeta:
    model: str  # the encoder the vectors come from (a different one: everything is embedded again)
    dimensions: int
    count: int
    kind: Literal["flat", "hnsw"]


def _faiss() -> Any:
    import faiss  # imported where used: reading a profile or a collection's chunks needs none of it

    return faiss


def set_threads(threads: int) -> None:
    if threads > 0:
        _faiss().omp_set_num_threads(threads)


def build(vectors: np.ndarray, kind: Literal["auto", "flat", "hnsw"] = "auto") -> tuple[object, str]:
    """An index over `vectors` [N, D] (unit float32 rows) and the kind chosen."""
    faiss = _faiss()
    n, dim = vectors.shape
    chosen = ("flat" if n <= EXACT_MAX else "hnsw") if kind == "auto" else kind
    if chosen == "flat":
        index = faiss.IndexFlatIP(dim)
    else:
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        index.hnsw.efSearch = HNSW_EF_SEARCH
    if n:
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index, chosen


def serialize(vectors: np.ndarray, model: str) -> dict[str, bytes]:
    """The files a version holds for its index, by name (for DocStore.commit's `extra`)."""
    index, kind = build(vectors)
    meta = IndexMeta(model, int(vectors.shape[1]), int(vectors.shape[0]), kind)  # type: ignore[arg-type]
    return {
        INDEX_FILE: bytes(_faiss().serialize_index(index)),
        META_FILE: json.dumps(asdict(meta), indent=1).encode("utf-8"),
    }


class VectorIndex:
    """A version's index, read from its folder."""

    def __init__(self, index: object, meta: IndexMeta) -> None:
        self._index = index
        self.meta = meta

    @classmethod
    def read(cls, folder: Path) -> VectorIndex:
        faiss = _faiss()
        meta = IndexMeta(**json.loads((folder / META_FILE).read_text(encoding="utf-8")))
        raw = np.frombuffer((folder / INDEX_FILE).read_bytes(), dtype=np.uint8)
        index = faiss.deserialize_index(raw)
        if meta.kind == "hnsw":
            index.hnsw.efSearch = HNSW_EF_SEARCH
        if index.ntotal != meta.count or index.d != meta.dimensions:
            raise ValueError(f"{folder / INDEX_FILE} holds {index.ntotal} vectors of {index.d}, not {meta.count}")
        return cls(index, meta)

    def vectors(self, rows: list[int]) -> np.ndarray:
        """The stored vectors of `rows` (kept chunks, reused in the next version)."""
        keys = np.asarray(rows, dtype=np.int64)
        return np.asarray(self._index.reconstruct_batch(keys), dtype=np.float32).reshape(len(rows), -1)  # type: ignore[attr-defined]

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """The k rows nearest `query` [D] (best first) with their cosine similarity."""
        k = min(k, self.meta.count)
        if k <= 0:
            return []
        scores, rows = self._index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k)  # type: ignore[attr-defined]
        return [(int(r), float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]
