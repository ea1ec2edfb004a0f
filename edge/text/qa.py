"""The text branch's engine: chat prompt, context window checks, generation, on the CPU or
on a CUDA device."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.config.text import DEFAULT_SYSTEM_PROMPT
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob
from edge.text import cpu_kv, triton_decode
from edge.text.chat import ChatTemplateError
from edge.text.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.continuous import ContinuousBatcher, Sequence
from edge.text.embedding import EmbeddingFormat
from edge.text.generate import SamplingParams
from edge.text.kv_offload import KVOffload
from edge.text.kv_quant import FORMATS, KVFormat
from edge.text.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class QASettings:
    max_context_tokens: int = 2048
    max_new_tokens: int = 128
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_sequences: int = 1
    # Tokens per prefill chunk while other sequences decode (0: whole prompts).
    prefill_chunk: int = 256
    device: str = "cpu"
    # Activations and float weights: "auto" is float32 on the CPU (the INT4 kernel works
    # in bfloat16 inside) and float16 on CUDA.
    dtype: str = "auto"
    cuda_graphs: bool = True
    # On the CPU: "exact" (our float32 INT4 kernel) or "bf16" (torch's tiled kernel).
    cpu_kernel: str = "exact"
    # The token table: "auto" (int8 on CUDA, float on the CPU), "float", "int8", "int4".
    embedding: str = "auto"
    # The KV cache: "float16" (the activations' type), "int8", "int4" (edge/text/kv_quant.py).
    kv_dtype: str = "float16"
    # Paused sequences' rows: "off", "memory" or "disk" (under offload_dir); see kv_offload.
    kv_offload: str = "off"
    kv_offload_mib: int = 256
    offload_dir: Path | None = None
    # Prefilled prompt prefixes kept for reuse (MiB; 0: none); see prefix_cache.
    prefix_cache_mib: int = 0


def chatml(system: str, user: str) -> str:
    """The ChatML turn layout SmolLM2-Instruct was tuned on, ready for the answer."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def user_message(question: str, context: str | None) -> str:
    if not context:
        return question
    return f"Context:\n{context.strip()}\n\nQuestion: {question.strip()}"


def resolve_embedding(settings: QASettings) -> EmbeddingFormat:
    if settings.embedding == "auto":
        return "int8" if settings.device == "cuda" else "float"
    if settings.embedding not in ("float", "int8", "int4"):
        raise ValueError(f"embedding must be auto, float, int8 or int4, got {settings.embedding!r}")
    return settings.embedding  # type: ignore[return-value]


def kv_format(settings: QASettings) -> KVFormat:
    """The KV cache's format, checked against what this box can run: the quantized
    formats need their attention kernels (Triton on CUDA, a C compiler on the CPU)."""
    if settings.kv_dtype not in FORMATS:
        raise ValueError(f"kv_dtype must be one of {', '.join(FORMATS)}, got {settings.kv_dtype!r}")
    fmt = FORMATS[settings.kv_dtype]
    if fmt.dtype == "float16":
        return fmt
    if settings.device == "cuda" and not triton_decode.TRITON_SUPPORT:
        raise RuntimeError(f"models.qa.kv_dtype {fmt.dtype} on CUDA needs Triton, which is not installed here")
    if settings.device == "cpu" and not cpu_kv.available():
        raise RuntimeError(f"models.qa.kv_dtype {fmt.dtype} on the CPU needs a C compiler (install gcc, or set CC)")
    return fmt


def resolve_dtype(settings: QASettings) -> torch.dtype:
    if settings.dtype != "auto":
        return DTYPES[settings.dtype]
    return torch.float16 if settings.device == "cuda" else torch.float32


class QAEngine:
    """The qa task over a continuous batcher: `prepare` turns a job into a sequence (all
    checks done), the text worker admits and steps sequences, `output` makes the result.
    `answer` runs one job alone, start to finish (tools, tests). The KV cache is
    allocated once: max_sequences rows of max_context_tokens, its rows handed out by the
    batcher's KV cache manager."""

    def __init__(self, checkpoint: TextCheckpoint, settings: QASettings) -> None:
        self._ckpt = checkpoint
        self._settings = settings
        self.batcher = ContinuousBatcher(
            checkpoint.model,
            checkpoint.tokenizer,
            checkpoint.eos_ids,
            slots=settings.max_sequences,
            slot_len=settings.max_context_tokens,
            kv_format=kv_format(settings),
        )
        self.batcher.prefill_chunk = settings.prefill_chunk
        if settings.kv_offload != "off":
            self.batcher.offload = KVOffload(
                settings.kv_offload,  # type: ignore[arg-type]
                self.batcher.device,
                settings.offload_dir,
                settings.kv_offload_mib << 20,
            )
            self.batcher.kv.offload_snapshot = self.batcher.offload.snapshot
        if settings.prefix_cache_mib > 0:
            self.batcher.prefix_cache = PrefixCache(settings.prefix_cache_mib << 20)
            self.batcher.kv.prefix_snapshot = self.batcher.prefix_cache.snapshot
        # Device bytes a prefill of the longest prompt takes beyond the model (its
        # activations): measured at warm-up on CUDA, reserved by each job while it is
        # prefilled. On the CPU that working memory stays in the heap after warm-up,
        # inside the model's measured footprint.
        self.prefill_bytes = 0
        self.graphs = 0

    @property
    def device(self) -> torch.device:
        return self.batcher.device

    @property
    def int4_kernel(self) -> str | None:
        return self._ckpt.int4_kernel

    @classmethod
    def load(cls, path: Path, settings: QASettings) -> QAEngine:
        if settings.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("models.qa.device is 'cuda' but torch sees no CUDA device here")
        t0 = time.perf_counter()
        ckpt = load_checkpoint(
            path,
            dtype=resolve_dtype(settings),
            device=settings.device,
            exact_cpu=settings.cpu_kernel == "exact",
            embedding=resolve_embedding(settings),
        )
        engine = cls(ckpt, settings)
        engine._stage("weights and KV cache", t0)
        engine.warm_up()
        return engine

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
            from edge.text.int4 import share_dequant_buffer, tune_gemv

            tune_gemv(model, resolve_dtype(self._settings))
            # Before the prefill is measured and the graphs captured: the slab buffer is
            # then the model's, held once, not in each prefill's activations.
            shared = share_dequant_buffer(model, resolve_dtype(self._settings))
            self._stage(f"INT4 GEMV tuned, {shared / 2**20:.0f} MiB prefill dequantization buffer", t0)
        t0 = time.perf_counter()
        self.batcher.warm_up()
        self._stage("every decode shape run", t0)
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            self.prefill_bytes = self._measure_prefill()
            if self._settings.cuda_graphs:
                self.graphs = self.batcher.capture_graphs()
            torch.cuda.empty_cache()  # the warm-up's transient blocks are not the model's
            self._stage(f"longest prefill measured ({self.prefill_bytes / 2**20:.0f} MiB), {self.graphs} graphs", t0)
        self.answer(QAJob(id="warm-up", question="Hello", max_new_tokens=2))

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

    @property
    def kv_cache_bytes(self) -> int:
        return self.batcher.cache.nbytes

    def prompt_text(self, question: str, context: str | None) -> str:
        """The prompt in the model's own chat template (ChatML where it has none)."""
        system, user = self._settings.system_prompt, user_message(question, context)
        if self._ckpt.chat is None:
            return chatml(system, user)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        try:
            return self._ckpt.chat.render(messages, add_generation_prompt=True)
        except ChatTemplateError as err:
            why = f"the model's chat template refused the question: {err}"
            raise JobError(ErrorCode.INVALID_FIELD, why, "question") from err

    def prompt_ids(self, question: str, context: str | None) -> list[int]:
        return self.prompt_parts(question, context)[0]

    def prompt_parts(self, question: str, context: str | None) -> tuple[list[int], int]:
        """The prompt's tokens, and how many of the first are its reusable prefix: the
        system turn and the context documents, up to the question (the prefix cache's
        key). The prefix is where the prompt's tokens and the prefix text's own agree,
        less one token (the one a different question could merge with)."""
        # The template writes the special tokens (a BOS among them) itself, as in transformers.
        text = self.prompt_text(question, context)
        encode = self._ckpt.tokenizer.encode
        ids = list(encode(text, add_special_tokens=False).ids)
        marker = "Question: " if context else question
        cut = text.rfind(marker)
        if cut <= 0:
            return ids, 0
        head = encode(text[:cut], add_special_tokens=False).ids
        same = 0
        for a, b in zip(ids, head, strict=False):
            if a != b:
                break
            same += 1
        return ids, max(0, same - 1)

    def prepare(self, job: QAJob, owner: Any = None, on_text: Callable[[str], None] | None = None) -> Sequence:
        t0 = time.perf_counter()
        ids, prefix = self.prompt_parts(job.question, job.context)
        tokenize_ms = (time.perf_counter() - t0) * 1000.0
        new_tokens = job.max_new_tokens or self._settings.max_new_tokens
        window = self._settings.max_context_tokens
        if len(ids) + 1 > window:
            raise JobError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt is {len(ids)} tokens; this device's context window is {window}",
                "context" if job.context else "question",
            )
        # Never refuse a job for wanting more tokens than fit: generate what fits and
        # report finish_reason "length", which is what the caller can act on.
        new_tokens = min(new_tokens, window - len(ids))
        params = SamplingParams(
            max_new_tokens=new_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            stop=tuple(job.stop),
            seed=job.seed,
        )
        seq = Sequence(owner, ids, params, on_text)
        seq.prefix = prefix
        seq.tokenize_ms = tokenize_ms
        return seq

    def kv_tokens(self, seq: Sequence) -> int:
        """KV positions the sequence can ever occupy: what it reserves before it runs."""
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.batcher.slot_len)

    @staticmethod
    def stages(seq: Sequence) -> dict[str, float]:
        """Milliseconds by stage: prefill and decode on the GPU's clock where they ran on
        CUDA (events around each prefill and each decode step it was in); elsewhere as
        the host saw them, decode less the text decoding inside its steps."""
        prefill, decode = seq.prefill_gpu_ms(), seq.decode_gpu_ms()
        return {
            "tokenize": seq.tokenize_ms,
            "prefill": seq.prefill_ms if prefill is None else prefill,
            "decode": max(0.0, seq.decode_s * 1000.0 - seq.detokenize_ms) if decode is None else decode,
            "detokenize": seq.detokenize_ms,
        }

    @staticmethod
    def latency(seq: Sequence, received_at: float) -> dict[str, float]:
        """Time to the first token from the job's arrival, and the time between tokens
        (p50, p99), on the host's clock as the tokens were taken."""
        times = seq.token_times
        if not times:
            return {}
        gaps = np.diff(np.asarray(times)) * 1000.0
        out = {"ttft_ms": (times[0] - received_at) * 1000.0}
        if gaps.size:
            out["token_p50_ms"] = float(np.percentile(gaps, 50))
            out["token_p99_ms"] = float(np.percentile(gaps, 99))
        return out

    @staticmethod
    def output(seq: Sequence) -> dict[str, Any]:
        return {
            # Not stripped: streamed deltas must concatenate to exactly this text.
            "answer": seq.text,
            "finish_reason": seq.finish,
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(seq.tokens),
            "prefill_ms": round(seq.prefill_ms, 3),
            "decode_tokens_per_s": round(seq.tokens_per_s, 2),
        }

    def answer(self, job: QAJob, on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Run one job to completion alone (the batcher must be idle)."""
        return self.output(self.batcher.single(self.prepare(job, on_text=on_text), job.id))
