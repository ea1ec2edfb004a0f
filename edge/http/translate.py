"""OpenAI request bodies to `qa` (and `embed`) job payloads, and `qa` results to OpenAI responses.

Only the shape changes here: every value a job has (token limits, sampling, priority,
deadline, collection) is passed through as given for the intake to judge, so an HTTP
request is refused for exactly what the same job over MQTT would be, naming the field.
What a job cannot express (several choices, images, structured output) is refused here,
naming the API's field.
"""

from __future__ import annotations

import time
from typing import Any

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import QAJob

# Accepted and ignored: they change nothing a box like this one does (and OpenAI clients
# send several of them by default).
IGNORED = frozenset({"user", "stream_options", "store", "metadata", "parallel_tool_calls", "service_tier"})
# Accepted at their neutral value only.
NEUTRAL: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "best_of": 1,
    "echo": False,
    "logprobs": False,
}
# Passed to the job under the same name: the sampling settings and this API's extensions.
PASSED = ("temperature", "top_p", "seed", "priority", "deadline_ms", "collection", "top_k")
COMMON = frozenset({"model", "stream", "max_tokens", "stop", "response_format", *PASSED})

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _invalid(message: str, param: str) -> JobError:
    return JobError(ErrorCode.INVALID_FIELD, message, param)


def _check_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key, value in body.items():
        if key in allowed or key in IGNORED:
            continue
        if key in NEUTRAL:
            if value is not None and value != NEUTRAL[key]:
                raise _invalid(f"only {key}={NEUTRAL[key]!r} is served here", key)
            continue
        raise _invalid(f"unknown field {key!r}", key)


EMBEDDING_KEYS = frozenset({"model", "input", "encoding_format", "dimensions", "priority", "deadline_ms"})


def check_embedding_keys(body: dict[str, Any]) -> None:
    """An embeddings request's fields: OpenAI's, and this API's priority and deadline."""
    _check_keys(body, EMBEDDING_KEYS)


def _common(body: dict[str, Any], job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = {"id": job_id, "task": "qa"}
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"} and "response_format" not in QAJob.model_fields:
        raise _invalid("structured output is not served: the qa job has no response_format", "response_format")
    if fmt is not None and "response_format" in QAJob.model_fields:
        job["response_format"] = fmt
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None:
        job["max_new_tokens"] = tokens
    stop = body.get("stop")
    if stop is not None:
        job["stop"] = [stop] if isinstance(stop, str) else stop
    for key in PASSED:
        if body.get(key) is not None:
            job[key] = body[key]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream must be true or false", "stream")
    job["stream"] = stream
    return job


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid(
                    "only text content is served here (images go to the qa, inspect and ocr jobs over MQTT)",
                    f"{param}[{i}]",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise _invalid("content must be a string or a list of text parts", param)


def chat_job(body: dict[str, Any], job_id: str) -> dict[str, Any]:
    """A chat completion request as a qa job: the last message (the user's) is the
    question, the ones before it (system prompt, earlier turns) its context."""
    _check_keys(body, COMMON | {"messages", "max_completion_tokens"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise JobError(ErrorCode.MISSING_FIELD, "messages must be a non-empty list", "messages")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _invalid("each message is an object with a role and content", f"messages[{i}]")
        turns.append((msg["role"], _text(msg.get("content"), f"messages[{i}].content")))
    role, question = turns[-1]
    if role != "user":
        raise _invalid("the last message must be the user's", f"messages[{len(turns) - 1}].role")
    job = _common(body, job_id)
    job["question"] = question
    earlier = [text if r == "system" else f"{r}: {text}" for r, text in turns[:-1] if text]
    if earlier:
        job["context"] = "\n\n".join(earlier)
    return job


def completion_job(body: dict[str, Any], job_id: str) -> dict[str, Any]:
    """A (legacy) completion request as a qa job: the prompt is the question."""
    _check_keys(body, COMMON | {"prompt", "suffix"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _invalid("prompt must be one string", "prompt")
    if body.get("suffix"):
        raise _invalid("suffix (fill in the middle) is not served here", "suffix")
    job = _common(body, job_id)
    job["question"] = prompt
    return job


def _usage(output: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(output.get("prompt_tokens", 0)), int(output.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def extension(result: dict[str, Any]) -> dict[str, Any]:
    """What this box adds to an answer (citations, grounding, passages, timings, the job
    span's traceparent), under the response's `edge` key: OpenAI clients ignore it, ours
    read it."""
    output = dict(result.get("output") or {})
    for key in ("answer", "finish_reason", "prompt_tokens", "completion_tokens"):
        output.pop(key, None)
    extra = {"device": result.get("device"), "timings": result.get("timings")}
    if result.get("traceparent") is not None:
        extra["traceparent"] = result["traceparent"]
    return {**output, **extra}


def chat_response(result: dict[str, Any], model: str) -> dict[str, Any]:
    output = result["output"]
    return {
        "id": result["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": output.get("answer", "")},
                "finish_reason": FINISH.get(output.get("finish_reason", ""), "stop"),
            }
        ],
        "usage": _usage(output),
        "edge": extension(result),
    }


def completion_response(result: dict[str, Any], model: str) -> dict[str, Any]:
    output = result["output"]
    return {
        "id": result["id"],
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": output.get("answer", ""),
                "finish_reason": FINISH.get(output.get("finish_reason", ""), "stop"),
                "logprobs": None,
            }
        ],
        "usage": _usage(output),
        "edge": extension(result),
    }


def chunk(
    job_id: str, model: str, chat: bool, delta: str | None, finish: str | None = None, role: str | None = None
) -> dict[str, Any]:
    """One server-sent event's document: a piece of text, or (delta None) the last one;
    `role` (a chat's first chunk) goes in the delta beside the text."""
    if chat:
        piece: dict[str, Any] = {"index": 0, "delta": {} if delta is None else {"content": delta}}
        if role is not None:
            piece["delta"] = {"role": role, **piece["delta"]}
    else:
        piece = {"index": 0, "text": delta or "", "logprobs": None}
    piece["finish_reason"] = finish
    return {
        "id": job_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [piece],
    }
