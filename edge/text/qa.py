"""The `qa` task on the text branch: chat prompt, context window checks, generation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.config.schema import DEFAULT_SYSTEM_PROMPT
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob
from edge.text.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.continuous import ContinuousBatcher, Sequence
from edge.text.generate import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QASettings:
    max_context_tokens: int = 2048
    max_new_tokens: int = 128
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_sequences: int = 1


def chatml(system: str, user: str) -> str:
    """The ChatML turn layout SmolLM2-Instruct was tuned on, ready for the answer."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def user_message(question: str, context: str | None) -> str:
    if not context:
        return question
    return f"Context:\n{context.strip()}\n\nQuestion: {question.strip()}"


class QAEngine:
    """The qa task over a continuous batcher: `prepare` turns a job into a sequence (all
    checks done), the text worker admits and steps sequences, `output` makes the result.
    `answer` runs one job alone, start to finish (tools, tests). The KV cache is
    allocated once: max_sequences rows of max_context_tokens."""

    def __init__(self, checkpoint: TextCheckpoint, settings: QASettings) -> None:
        self._ckpt = checkpoint
        self._settings = settings
        self.batcher = ContinuousBatcher(
            checkpoint.model,
            checkpoint.tokenizer,
            checkpoint.eos_ids,
            slots=settings.max_sequences,
            slot_len=settings.max_context_tokens,
        )

    @classmethod
    def load(cls, path: Path, settings: QASettings) -> QAEngine:
        engine = cls(load_checkpoint(path), settings)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Every serving shape once (ContinuousBatcher.warm_up) and one short generation,
        so every weight page is resident before memory is measured and the first real
        job does not pay for page faults or kernel builds."""
        self.batcher.warm_up()
        self.answer(QAJob(id="warm-up", question="Hello", max_new_tokens=2))

    @property
    def kv_cache_bytes(self) -> int:
        return self.batcher.cache.nbytes

    def prompt_ids(self, question: str, context: str | None) -> list[int]:
        text = chatml(self._settings.system_prompt, user_message(question, context))
        return list(self._ckpt.tokenizer.encode(text, add_special_tokens=False).ids)

    def prepare(self, job: QAJob, owner: Any = None, on_text: Callable[[str], None] | None = None) -> Sequence:
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
        return Sequence(owner, ids, params, on_text)

    def kv_tokens(self, seq: Sequence) -> int:
        """KV positions the sequence can ever occupy: what it reserves before it runs."""
        return min(len(seq.prompt) + seq.params.max_new_tokens, self.batcher.slot_len)

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
        seq = self.prepare(job, on_text=on_text)
        self.batcher.admit(seq)
        while seq.finish is None:
            self.batcher.step()
        return self.output(seq)
