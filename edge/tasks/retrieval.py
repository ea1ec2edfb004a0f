"""Retrieval for the `qa` task: a job's collection searched for its question before its
prompt is built (edge/docs/retrieve.py does the searching and the citation checks).

The encoder is a model under the ledger like the others: registered with the model
manager the first time a job retrieves (or at start, where collections exist), loaded
and measured there, evicted and loaded again as the budget needs. Its build is found by
its manifest in the engine directory (`edgectl docs add` builds it); without one, a
retrieving job is told so, and other jobs run as before.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from edge.artifacts import EngineMissing
from edge.backends import BackendUnavailable
from edge.docs.embed import MODEL, Embedder, locate
from edge.docs.retrieve import Passage, Retriever
from edge.docs.store import CollectionError, DocStore
from edge.protocol.errors import ErrorCode, JobError
from edge.scheduler.models import ModelManager

logger = logging.getLogger(__name__)


class ManagedEncoder:
    """The encoder as the retriever sees it, fetched from the model manager each call
    (loaded again if the ledger evicted it), never evicting the models in `keep`."""

    def __init__(self, manager: ModelManager, keep: frozenset[str]) -> None:
        self._manager = manager
        self._keep = keep | {MODEL}

    @property
    def model(self) -> str:
        return MODEL

    def embed(self, texts: list[str]) -> np.ndarray:
        embedder: Embedder = self._manager.get(MODEL, keep=self._keep)
        return embedder.embed(texts)


class Retrieval:
    def __init__(
        self,
        manager: ModelManager,
        store: DocStore,
        engine_dir: Path,
        backend: str = "onnxruntime",
        threads: int = 0,
        keep: frozenset[str] = frozenset(),
    ) -> None:
        self.store = store
        self._manager = manager
        self._engine_dir = engine_dir
        self._backend = backend
        self._threads = threads
        self._keep = keep
        self._lock = threading.Lock()
        self._retriever: Retriever | None = None

    def _ready(self) -> Retriever:
        with self._lock:
            if self._retriever is None:
                info = locate(self._engine_dir)  # EngineMissing: no encoder built
                load = lambda: Embedder.load(info, self._backend, self._threads)  # noqa: E731
                # torch-cuda holds the encoder on the GPU: measured there, not as the host's.
                device = "cuda" if self._backend == "torch-cuda" else "cpu"
                floor = info.onnx.stat().st_size if self._backend == "onnxruntime" else 0
                self._manager.register(MODEL, "text", self._backend, load, float("inf"), device, host_floor_bytes=floor)
                self._retriever = Retriever(self.store, ManagedEncoder(self._manager, self._keep), self._threads)
            return self._retriever

    def preload(self) -> None:
        """At start: the encoder loaded (and counted) now where the box has collections."""
        if not self.store.names():
            return
        try:
            self._ready()
            self._manager.load(MODEL)
        except EngineMissing as err:
            logger.warning("collections exist but no retrieval encoder is built: %s", err)

    def embed(self, texts: list[str]) -> np.ndarray:
        """The encoder's vectors for `texts` (the HTTP API's embeddings), the encoder
        loaded through the ledger as for a search; JobError `unavailable` if none is built."""
        try:
            self._ready()
            return ManagedEncoder(self._manager, self._keep).embed(texts)
        except (EngineMissing, BackendUnavailable) as err:
            raise JobError(ErrorCode.UNAVAILABLE, str(err), "model") from err

    def search(self, collection: str, question: str, top_k: int) -> tuple[list[Passage], dict[str, float]]:
        try:
            return self._ready().search(collection, question, top_k)
        except (EngineMissing, BackendUnavailable) as err:  # no encoder built, or its backend cannot run here
            raise JobError(ErrorCode.UNAVAILABLE, str(err), "collection") from err
        except CollectionError as err:
            raise JobError(ErrorCode.INVALID_FIELD, str(err), "collection") from err
