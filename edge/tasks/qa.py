"""The `qa` task: a question (with optional reference text, or passages retrieved from a
collection on the box) answered by the text branch's continuous batcher, optionally
streamed in pieces as it is generated."""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

import torch

from edge.config.text import QAModelConfig
from edge.docs.retrieve import Passage, check_citations, context_of
from edge.docs.store import DocStore
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob
from edge.responder import Responder
from edge.scheduler.models import ModelManager
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.tasks.retrieval import Retrieval
from edge.text.continuous import Sequence
from edge.text.qa import QAEngine, QASettings

logger = logging.getLogger(__name__)


class QATask:
    name = "qa"

    def __init__(
        self,
        engine: QAEngine,
        responder: Responder,
        retrieval: Retrieval | None = None,
        collection: str | None = None,
        top_k: int = QAModelConfig.model_fields["top_k"].default,
    ) -> None:
        self.engine = engine
        self._responder = responder
        self.retrieval = retrieval
        self.collection = collection  # the profile's default
        self.top_k = top_k
        # What each sequence retrieved, for its result's passages and citation checks.
        self._retrieved: weakref.WeakKeyDictionary[Sequence, list[Passage]] = weakref.WeakKeyDictionary()

    def prepare(self, item: WorkItem) -> Sequence:
        job = item.job.request
        assert isinstance(job, QAJob)
        job, passages = self._retrieve(job, item)
        on_text = None
        if job.stream:
            pieces = 0

            def publish_delta(delta: str) -> None:
                nonlocal pieces
                self._responder.partial(item, pieces, delta)
                pieces += 1

            on_text = publish_delta
        seq = self.engine.prepare(job, item, on_text=on_text)
        if passages is not None:
            self._retrieved[seq] = passages
        return seq

    def _retrieve(self, job: QAJob, item: WorkItem) -> tuple[QAJob, list[Passage] | None]:
        """The job with the passages retrieved for it in its context (after any context
        of its own), and those passages; the job as it is where it names no collection."""
        collection = job.collection or self.collection
        if collection is None:
            return job, None
        if self.retrieval is None:
            raise JobError(ErrorCode.UNAVAILABLE, "retrieval is not set up on this box", "collection")
        passages, stages = self.retrieval.search(collection, job.question, job.top_k or self.top_k)
        t0 = time.perf_counter()
        parts = [job.context.strip()] if job.context and job.context.strip() else []
        if passages:
            parts.append(context_of(passages))
        job = job.model_copy(update={"context": "\n".join(parts) or None})
        stages["assemble"] = (time.perf_counter() - t0) * 1000.0
        item.stages.update(stages)
        return job, passages

    def kv_tokens(self, seq: Sequence) -> int:
        return self.engine.kv_tokens(seq)

    def output(self, seq: Sequence) -> Output:
        item = seq.owner
        if isinstance(item, WorkItem):
            item.stages.update(self.engine.stages(seq))
            item.latency.update(self.engine.latency(seq, item.received_at))
        out = self.engine.output(seq)
        passages = self._retrieved.pop(seq, None)
        if passages is not None:
            out["passages"] = [{"id": p.id, "score": round(p.score, 4), "title": p.title} for p in passages]
            out["citations"] = check_citations(seq.text, passages)
        return out


def qa_model_name(cfg: QAModelConfig) -> str:
    if cfg.engine is not None:
        return cfg.engine.name
    return f"{Path(cfg.source).name.removesuffix('.gguf')}-{Path(cfg.adapter).name}"


def start_qa(
    cfg: QAModelConfig,
    checkpoint: Path,
    manager: ModelManager,
    responder: Responder,
    state_dir: Path | None = None,
    engine_dir: Path | None = None,
) -> QATask:
    """Load the text model (its KV cache allocated and every serving shape warmed up
    inside the measured load) and return the task."""
    if cfg.threads and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    settings = QASettings(
        max_context_tokens=cfg.max_context_tokens,
        max_new_tokens=cfg.max_new_tokens,
        system_prompt=cfg.system_prompt,
        max_sequences=cfg.max_sequences,
        prefill_chunk=cfg.prefill_chunk,
        device=cfg.device,
        dtype=cfg.dtype,
        cuda_graphs=cfg.cuda_graphs,
        cpu_kernel=cfg.cpu_kernel,
        embedding=cfg.embedding,
        kv_dtype=cfg.kv_dtype,
        kv_offload=cfg.kv_offload,
        kv_offload_mib=cfg.kv_offload_mib,
        prefix_cache_mib=cfg.prefix_cache_mib,
        offload_dir=state_dir / "kv-offload" if state_dir is not None else None,
    )
    name = qa_model_name(cfg)
    # The backend label says what actually runs: the device and the INT4 kernel.
    load = lambda: QAEngine.load(checkpoint, settings)  # noqa: E731
    manager.register(name, "text", f"torch-{cfg.device}", load, float("inf"), cfg.device)
    engine: QAEngine = manager.load(name)
    kernel = engine.int4_kernel or "float"
    manager.describe(name, f"torch-{cfg.device} {kernel}" + (" + CUDA graphs" if engine.graphs else ""))
    retrieval = None
    if state_dir is not None and engine_dir is not None:
        store = DocStore(state_dir / "docs")
        keep = frozenset({name})
        retrieval = Retrieval(manager, store, engine_dir, cfg.embed_backend, cfg.embed_threads, keep)
        retrieval.preload()
    return QATask(engine, responder, retrieval, cfg.collection, cfg.top_k)
