"""The text engine: the profile's qa section made into a served model.

One way in: the daemon, `edgectl verify` and every benchmark and evaluation (through
bench/text_engines.py; tests/test_bench_engines.py fails on one built another way) build
their text model with `TextEngine.load(checkpoint, cfg)`, where `cfg` is a profile's `models.qa` section (a
benchmark that measures a variant changes a field of it and says which). The engine knows
no job: it turns questions into prompt tokens, sequences into tokens, and says what it
resolved to (`config`), so every figure it measured names what it ran."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge.config.text import QAModelConfig
from edge.text.kv.float_cache import SparseAttention
from edge.text.kv.kv_offload import KVOffload
from edge.text.kv.kv_quant import FORMATS, KVFormat
from edge.text.kv.prefix_cache import PrefixCache
from edge.text.model.checkpoint import IMAGE_PART, TextCheckpoint, load_checkpoint
from edge.text.model.embedding import EmbeddingFormat, QuantizedEmbedding
from edge.text.model.llama import LlamaModel
from edge.text.model.splice import Splice
from edge.text.ops import step_ops
from edge.text.ops.cpu import cpu_kv
from edge.text.ops.cuda import cuda_build, cuda_int4
from edge.text.ops.int4 import share_dequant_buffer, tune_gemv
from edge.text.ops.triton import triton_int4
from edge.text.prompt import Prompter
from edge.text.runtime import fused_step
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def variant(cfg: QAModelConfig, **changes: Any) -> QAModelConfig:
    """The section with `changes` applied, validated as a profile's own would be: how a
    benchmark or a check says which fields of the served configuration it changed."""
    return QAModelConfig.model_validate({**cfg.model_dump(), **changes})


def resolve_embedding(cfg: QAModelConfig) -> EmbeddingFormat:
    """The token table's format: "auto" is int8 on CUDA, float on the CPU."""
    if cfg.embedding == "auto":
        return "int8" if cfg.device == "cuda" else "float"
    return cfg.embedding


def cuda_kernel(cfg: QAModelConfig) -> str | None:
    """The INT4 kernel a CUDA section names, checked against what this box can run (None:
    the device's default; on the CPU cpu_kernel decides)."""
    if cfg.device != "cuda" or cfg.cuda_kernel == "auto":
        return None
    if cfg.cuda_kernel == "cuda-mma" and not cuda_int4.available(cfg.device):
        raise RuntimeError("models.qa.cuda_kernel cuda-mma is not built here (nvcc missing or failed; see the log)")
    if cfg.cuda_kernel == "triton" and not triton_int4.TRITON_SUPPORT:
        raise RuntimeError("models.qa.cuda_kernel triton needs Triton, which is not installed here")
    return {"torch": "cuda"}.get(cfg.cuda_kernel, cfg.cuda_kernel)


def resolve_dtype(cfg: QAModelConfig) -> torch.dtype:
    """The activations' type: "auto" is float32 on the CPU, float16 on CUDA."""
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    return torch.float16 if cfg.device == "cuda" else torch.float32


def kv_format(cfg: QAModelConfig) -> KVFormat:
    """The KV cache's format, checked against what this box can run: the quantized
    formats need their attention kernels (on CUDA Triton's, or ours built by nvcc; a C
    compiler on the CPU)."""
    fmt = FORMATS[cfg.kv_dtype]
    if fmt.dtype == "float16":
        return fmt
    if cfg.device == "cuda" and not step_ops.quantized_kv(cfg.device):
        raise RuntimeError(
            f"models.qa.kv_dtype {fmt.dtype} on CUDA needs Triton or our CUDA kernels, and neither is here "
            "(Triton is not installed; nvcc is missing or the build failed: see the log)"
        )
    if cfg.device == "cpu" and not cpu_kv.available():
        raise RuntimeError(f"models.qa.kv_dtype {fmt.dtype} on the CPU needs a C compiler (install gcc, or set CC)")
    return fmt


def sparse_attention(cfg: QAModelConfig, model: LlamaModel) -> tuple[SparseAttention | None, str | None]:
    """The top-k block attention this engine serves (None: dense), and why it serves dense
    where the profile enables it: on the CPU only, where the C decode step over a float
    cache and the quantized cache's attention kernel (an int8 or int4 cache, whose steps
    run op by op) select blocks. A refusal is logged and reported in `config`, never
    silent."""
    sparse = cfg.sparse_attention
    if not sparse.enabled:
        return None, None
    if cfg.device != "cpu":
        refused = "the CUDA and Triton decode kernels do not select blocks yet"
    elif cfg.kv_dtype == "float16" and not fused_step.steps_on_cpu(model):
        refused = "the model's decode steps run op by op, not in the CPU's C step (the log says why)"
    else:
        return SparseAttention(sparse.top_k_blocks, sparse.block_tokens, sparse.min_context), None
    logger.warning("models.qa.sparse_attention is enabled but attention stays dense: %s", refused)
    return None, refused


def group_sizes(path: Path) -> list[int]:
    """The INT4 group sizes a checkpoint was built with (none: a float checkpoint)."""
    quant = path / "quant.json"
    if not quant.exists():
        return []
    linears = json.loads(quant.read_text(encoding="utf-8"))["linears"]
    return sorted({int(info["group_size"]) for info in linears.values()})


class TextEngine:
    """A text model as the profile's qa section describes it, over a continuous batcher
    whose KV cache is allocated once (max_sequences rows of max_context_tokens, its rows
    handed out by the batcher's KV cache manager), warmed up before the first job.

    `origin` says where the section came from: the profile's name and the fields a
    caller changed from it (a benchmark's variant), recorded in `config`."""

    def __init__(
        self,
        checkpoint: TextCheckpoint,
        cfg: QAModelConfig,
        offload_dir: Path | None = None,
        origin: dict[str, Any] | None = None,
    ) -> None:
        self._ckpt = checkpoint
        self.cfg = cfg
        self.origin = origin or {}
        # Read once: status and every metrics scrape ask for config().
        self._groups = group_sizes(checkpoint.path)
        # A vision-language model's language model: its template takes typed parts, images or not.
        typed = all((checkpoint.path / name).is_file() for name in IMAGE_PART)
        self.prompter = Prompter(checkpoint.tokenizer, checkpoint.chat, cfg.system_prompt, typed)
        self.sparse, self.sparse_refused = sparse_attention(cfg, checkpoint.model)
        self.batcher = ContinuousBatcher(
            checkpoint.model,
            checkpoint.tokenizer,
            checkpoint.eos_ids,
            slots=cfg.max_sequences,
            slot_len=cfg.max_context_tokens,
            kv_format=kv_format(cfg),
            sparse=self.sparse,
        )
        self.batcher.prefill_chunk = cfg.prefill_chunk
        if cfg.speculative == "prompt-lookup":
            self.batcher.speculative_tokens = cfg.speculative_tokens
        if cfg.kv_offload != "off":
            self.batcher.offload = KVOffload(cfg.kv_offload, self.batcher.device, offload_dir, cfg.kv_offload_mib << 20)
            self.batcher.kv.offload_snapshot = self.batcher.offload.snapshot
        if cfg.prefix_cache_mib > 0:
            self.batcher.prefix_cache = PrefixCache(cfg.prefix_cache_mib << 20)
            self.batcher.kv.prefix_snapshot = self.batcher.prefix_cache.snapshot
        # Device bytes a prefill of the longest prompt takes beyond the model (its
        # activations): measured at warm-up on CUDA, reserved by each job while it is
        # prefilled. On the CPU that working memory stays in the heap after warm-up,
        # inside the model's measured footprint.
        self.prefill_bytes = 0
        self.graphs = 0

    @classmethod
    def load(
        cls,
        path: Path,
        cfg: QAModelConfig,
        offload_dir: Path | None = None,
        origin: dict[str, Any] | None = None,
        warm: bool = True,
    ) -> TextEngine:
        """Load the checkpoint at `path` as `cfg` says, and warm it up (`warm` False
        only for tools that measure the warm-up itself)."""
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("models.qa.device is 'cuda' but torch sees no CUDA device here")
        if cfg.threads and cfg.device == "cpu":
            torch.set_num_threads(cfg.threads)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(
            path,
            dtype=resolve_dtype(cfg),
            device=cfg.device,
            int4_kernel=cuda_kernel(cfg),
            cpu_kernel=cfg.cpu_kernel,
            embedding=resolve_embedding(cfg),
        )
        engine = cls(ckpt, cfg, offload_dir, origin)
        engine._stage("weights and KV cache", t0)
        if warm:
            engine.warm_up()
        return engine

    # -- what it is ------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        return self.batcher.model

    @property
    def tokenizer(self) -> Any:
        return self._ckpt.tokenizer

    @property
    def device(self) -> torch.device:
        return self.batcher.device

    @property
    def dtype(self) -> torch.dtype:
        return resolve_dtype(self.cfg)

    @property
    def int4_kernel(self) -> str | None:
        return self._ckpt.int4_kernel

    @property
    def kv_cache_bytes(self) -> int:
        return self.batcher.cache.nbytes

    def config(self) -> dict[str, Any]:
        """What this engine resolved to: the figures' `engine_config` and status's."""
        model = self.batcher.model
        table = model.embed_tokens
        groups = self._groups
        fused = bool(model.fused_decode) if model.fused_decode is not None else fused_step.can_fuse(model)
        # The CPU's step reads a float cache; a quantized one is read op by op.
        fused = fused and (self.device.type != "cpu" or self.batcher.kv.dtype == "float16")
        folds = fused and fused_step.folds_norm(model, 1)[0]
        return {
            "device": self.device.type,
            "dtype": DTYPE_NAMES[self.dtype],
            "kernel": self.int4_kernel or "float",
            "group_size": groups[0] if len(groups) == 1 else (groups or None),
            "parameters": model.config.parameter_count(),
            "embedding": table.fmt if isinstance(table, QuantizedEmbedding) else "float",
            "kv_dtype": self.batcher.kv.dtype,
            # Positions a row of a sliding layer's own buffer holds (float_cache.py), or its
            # code slots in an int8/int4 cache (quant_cache.py); None: every layer holds
            # every position.
            "kv_sliding_slots": getattr(self.batcher.cache, "local_slots", 0) or None,
            "fused_step": fused,
            "fold_norms": bool(folds),
            "cuda_graphs": self.graphs > 0,
            "triton": step_ops.triton_present(),
            "step_kernels": step_ops.backend(self.device) if fused and self.device.type == "cuda" else None,
            "cuda_arch": cuda_build.target(cuda_build.device_arch(self.device)) if self.device.type == "cuda" else None,
            "threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "max_sequences": self.cfg.max_sequences,
            "max_context_tokens": self.cfg.max_context_tokens,
            "prefill_chunk": self.cfg.prefill_chunk,
            # What runs: CUDA graphs leave speculation off (ContinuousBatcher._draft).
            "speculative": self.cfg.speculative if self.graphs == 0 else "off",
            "speculative_tokens": self.cfg.speculative_tokens,
            "kv_offload": self.cfg.kv_offload,
            "prefix_cache_mib": self.cfg.prefix_cache_mib,
            # What runs: served only on the CPU: the C step over a float cache, the quantized
            # cache's attention kernel over an int8/int4 one (sparse_attention).
            "sparse_attention": {
                "enabled": self.cfg.sparse_attention.enabled,
                "served": self.sparse is not None,
                "refused": self.sparse_refused,
                "top_k_blocks": self.cfg.sparse_attention.top_k_blocks,
                "block_tokens": self.cfg.sparse_attention.block_tokens,
                "min_context": self.cfg.sparse_attention.min_context,
            },
            "checkpoint": self._ckpt.path.name,
            **({"origin": self.origin} if self.origin else {}),
        }

    # -- loading ---------------------------------------------------------------------------

    def _stage(self, what: str, since: float) -> None:
        """A load stage's time and, on CUDA, the device memory after it: what a slow or
        large load is made of, in the log."""
        took = time.perf_counter() - since
        if self.device.type != "cuda":
            logger.info("text model: %s in %.1f s", what, took)
            return
        free, total = torch.cuda.mem_get_info(self.device)
        logger.info(
            "text model: %s in %.1f s; allocated %.0f MiB, reserved %.0f MiB, device in use %.0f MiB",
            what,
            took,
            torch.cuda.memory_allocated(self.device) / 2**20,
            torch.cuda.memory_reserved(self.device) / 2**20,
            (total - free) / 2**20,
        )

    def warm_up(self) -> None:
        """Every serving shape once before any job, so every weight page is resident
        before memory is measured and no kernel is built or tuned mid-run: on CUDA the
        INT4 GEMV's tuner for every row count a step or a short prefill feeds it, each
        decode shape, the longest prefill (whose activations are measured), and the CUDA
        graphs of the decode step. One short generation last."""
        model = self.batcher.model
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            tune_gemv(model, self.dtype)
            # Before the prefill is measured and the graphs captured: the slab buffer is
            # then the model's, held once, not in each prefill's activations.
            shared = share_dequant_buffer(model, self.dtype)
            self._stage(f"INT4 GEMV tuned, {shared / 2**20:.0f} MiB prefill dequantization buffer", t0)
        t0 = time.perf_counter()
        self.batcher.warm_up()
        self._stage("the serving shapes run (ContinuousBatcher.warm_up)", t0)
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            self.prefill_bytes = self._measure_prefill()
            if self.cfg.cuda_graphs:
                self.graphs = self.batcher.capture_graphs()
            torch.cuda.empty_cache()  # the warm-up's transient blocks are not the model's
            self._stage(f"longest prefill measured ({self.prefill_bytes / 2**20:.0f} MiB), {self.graphs} graphs", t0)
        # As a job's would be: its system turn the prefix the prefix cache keeps.
        ids, prefix = self.prompter.parts("Hello", None)
        self.generate(ids, SamplingParams(max_new_tokens=2), "warm-up", prefix=prefix)

    @torch.inference_mode()
    def _measure_prefill(self) -> int:
        length = self.batcher.slot_len - 1
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros((1, length), dtype=torch.long, device=self.device)
        self.batcher.model(ids, self.batcher.cache.rows(0, 1), 0)
        torch.cuda.synchronize(self.device)
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - before)

    # -- serving ---------------------------------------------------------------------------

    def sequence(
        self,
        ids: list[int],
        params: SamplingParams,
        owner: Any = None,
        prefix: int = 0,
        on_text: Callable[[str], None] | None = None,
        splices: tuple[Splice, ...] = (),
        make_splices: Callable[[], tuple[Splice, ...]] | None = None,
    ) -> Sequence:
        """A sequence for the batcher: `prefix` leading tokens others may share; `splices`
        rows its prefill reads in place of its tokens' (an image's: edge/vlm), or
        `make_splices` what makes them once it is admitted (Sequence.make_splices)."""
        for splice in splices:
            if splice.at < 0 or splice.end > len(ids):
                raise ValueError(f"rows spliced at {splice.at}..{splice.end} fall outside a prompt of {len(ids)}")
        seq = Sequence(owner, ids, params, on_text)
        seq.prefix = prefix
        seq.splices = splices
        seq.make_splices = make_splices
        return seq

    def kv_tokens(self, seq: Sequence) -> int:
        """KV positions the sequence can ever occupy: what it reserves before it runs."""
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.batcher.slot_len)

    def generate(
        self,
        ids: list[int],
        params: SamplingParams,
        owner: str = "alone",
        prefix: int = 0,
        on_text: Callable[[str], None] | None = None,
        splices: tuple[Splice, ...] = (),
    ) -> Sequence:
        """Run one prompt to its end alone (the batcher must be idle)."""
        room = self.batcher.slot_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt is {len(ids)} tokens; the context window is {self.batcher.slot_len}")
        if params.max_new_tokens > room:
            params = dataclasses.replace(params, max_new_tokens=room)
        return self.batcher.single(self.sequence(ids, params, None, prefix, on_text, splices), owner)
