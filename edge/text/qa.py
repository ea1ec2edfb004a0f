"""The `qa` task on the text branch: chat prompt, context window checks, generation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge.config.schema import DEFAULT_SYSTEM_PROMPT
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob
from edge.text.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.generate import SamplingParams, generate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QASettings:
    max_context_tokens: int = 2048
    max_new_tokens: int = 128
    system_prompt: str = DEFAULT_SYSTEM_PROMPT


def chatml(system: str, user: str) -> str:
    """The ChatML turn layout SmolLM2-Instruct was tuned on, ready for the answer."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def user_message(question: str, context: str | None) -> str:
    if not context:
        return question
    return f"Context:\n{context.strip()}\n\nQuestion: {question.strip()}"


class QAEngine:
    """One sequence at a time on one worker thread; the KV cache is allocated once."""

    def __init__(self, checkpoint: TextCheckpoint, settings: QASettings) -> None:
        self._ckpt = checkpoint
        self._settings = settings
        self._cache = checkpoint.model.new_cache(1, settings.max_context_tokens)

    @classmethod
    def load(cls, path: Path, settings: QASettings) -> QAEngine:
        engine = cls(load_checkpoint(path), settings)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """One short generation, so every weight page is resident before memory is
        measured and the first real job does not pay for page faults."""
        ids = self.prompt_ids("Hello", None)
        params = SamplingParams(max_new_tokens=2)
        generate(self._ckpt.model, self._ckpt.tokenizer, ids, params, self._ckpt.eos_ids, self._cache)

    @property
    def kv_cache_bytes(self) -> int:
        return self._cache.nbytes

    def prompt_ids(self, question: str, context: str | None) -> list[int]:
        text = chatml(self._settings.system_prompt, user_message(question, context))
        return list(self._ckpt.tokenizer.encode(text, add_special_tokens=False).ids)

    def answer(self, job: QAJob, on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
        ids = self.prompt_ids(job.question, job.context)
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
        with torch.inference_mode():
            result = generate(
                self._ckpt.model, self._ckpt.tokenizer, ids, params, self._ckpt.eos_ids, self._cache, on_text
            )
        return {
            # Not stripped: streamed deltas must concatenate to exactly this text.
            "answer": result.text,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "prefill_ms": round(result.prefill_ms, 3),
            "decode_tokens_per_s": round(result.tokens_per_s, 2),
        }
