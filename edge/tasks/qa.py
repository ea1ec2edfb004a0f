"""The `qa` task: a question (with optional reference text) answered by the text
branch's continuous batcher, optionally streamed in pieces as it is generated."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edge.config.schema import QAModelConfig
from edge.protocol.jobs import QAJob
from edge.responder import Responder
from edge.scheduler.models import ModelManager
from edge.scheduler.work import WorkItem
from edge.tasks.base import Output
from edge.text.continuous import Sequence
from edge.text.qa import QAEngine, QASettings

logger = logging.getLogger(__name__)


class QATask:
    name = "qa"

    def __init__(self, engine: QAEngine, responder: Responder) -> None:
        self.engine = engine
        self._responder = responder

    def prepare(self, item: WorkItem) -> Sequence:
        job = item.job.request
        assert isinstance(job, QAJob)
        if not job.stream:
            return self.engine.prepare(job, item)
        pieces = 0

        def publish_delta(delta: str) -> None:
            nonlocal pieces
            self._responder.partial(item, pieces, delta)
            pieces += 1

        return self.engine.prepare(job, item, on_text=publish_delta)

    def kv_tokens(self, seq: Sequence) -> int:
        return self.engine.kv_tokens(seq)

    def output(self, seq: Sequence) -> Output:
        item = seq.owner
        if isinstance(item, WorkItem):
            item.stages.update(self.engine.stages(seq))
            item.latency.update(self.engine.latency(seq, item.received_at))
        return self.engine.output(seq)


def qa_model_name(cfg: QAModelConfig) -> str:
    if cfg.engine is not None:
        return cfg.engine.name
    return f"{Path(cfg.source).name.removesuffix('.gguf')}-{Path(cfg.adapter).name}"


def start_qa(
    cfg: QAModelConfig, checkpoint: Path, manager: ModelManager, responder: Responder, state_dir: Path | None = None
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
    return QATask(engine, responder)
