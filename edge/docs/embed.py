"""Sentence embeddings for retrieval, through the backend seam: the encoder's build
(engines/retrieval/embed_build.py) is found by its manifest and loaded by whichever backend the
profile names (onnxruntime on the CPU by default; a torch backend builds the module from
edge/docs/minilm.py).

Texts are tokenized with the build's own tokenizer (truncated at the model's 256
tokens), sorted by length and run in batches padded to their longest, so one long
chunk does not pad a whole batch of short ones; the vectors come back in the order
given, float32, unit length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.artifacts import EngineMissing, find
from edge.backends import BackendOptions, InferenceSession, ModelSource, get_backend

logger = logging.getLogger(__name__)

MODEL = "all-MiniLM-L6-v2"
BATCH = 32  # texts a run


@dataclass(frozen=True)
class EmbedInfo:
    path: Path
    model: str
    dimensions: int
    max_tokens: int
    onnx: Path
    tokenizer: Path


def locate(engine_dir: Path, model: str = MODEL) -> EmbedInfo:
    """The newest encoder build for `model` in engine_dir; EngineMissing if there is none."""
    engine = find(engine_dir, task="embed", model=model)
    if engine is None:
        raise EngineMissing(
            f"no retrieval encoder ({model}) in {engine_dir}; run `python -m engines.retrieval.embed_build "
            f"--engine-dir {engine_dir}` (edgectl docs add builds it when missing)"
        )
    m = engine.manifest
    return EmbedInfo(
        engine.path,
        str(m["model"]),
        int(m["dimensions"]),
        int(m["max_tokens"]),
        engine.path / str(m["onnx"]),
        engine.path / str(m["tokenizer"]),
    )


def _torch_module() -> object:
    from edge.docs import minilm

    return minilm.load()


class Embedder:
    """One loaded encoder. `embed` is called from one thread at a time (the ledger's
    model manager hands it out like any other model)."""

    def __init__(self, info: EmbedInfo, session: InferenceSession) -> None:
        from tokenizers import Tokenizer

        self.info = info
        self.session = session
        self._tokenizer = Tokenizer.from_file(str(info.tokenizer))
        self._tokenizer.enable_truncation(info.max_tokens)
        self._tokenizer.no_padding()

    @classmethod
    def load(cls, info: EmbedInfo, backend: str = "onnxruntime", threads: int = 0) -> Embedder:
        source = ModelSource(
            name=info.model,
            onnx=info.onnx,
            torch_module=_torch_module,
            inputs=("input_ids", "attention_mask"),
            outputs=("embedding",),
        )
        session = get_backend(backend).load(source, BackendOptions(threads=threads, max_batch=BATCH))
        return cls(info, session)

    @property
    def dimensions(self) -> int:
        return self.info.dimensions

    @property
    def model(self) -> str:
        return self.info.model

    def embed(self, texts: list[str], progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """[len(texts), dimensions] float32 unit vectors."""
        out = np.zeros((len(texts), self.info.dimensions), dtype=np.float32)
        if not texts:
            return out
        encoded = self._tokenizer.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
        for start in range(0, len(order), BATCH):
            rows = order[start : start + BATCH]
            width = max(len(encoded[i].ids) for i in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                n = len(encoded[i].ids)
                ids[r, :n] = encoded[i].ids
                mask[r, :n] = 1
            (vectors,) = self.session.run({"input_ids": ids, "attention_mask": mask})[:1]
            out[rows] = np.asarray(vectors, dtype=np.float32)
            if progress is not None:
                progress(min(start + BATCH, len(order)), len(order))
        return out
