"""The HTTP listener: OpenAI's endpoints on aiohttp, in a thread with its own event loop.

Why aiohttp rather than starlette with uvicorn (the two measured, bench/http_stack.py;
figures in bench/results/http_stack.json and docs/http.md): the memory a minimal server
holds is about the same, and starlette+uvicorn imports somewhat faster, which is small
beside loading the models. What decides it: aiohttp is one maintained package with its
own server (no ASGI server and no SSE add-on to keep in step), it cancels a handler
whose client disconnected (how a request withdraws its job), and it runs on an event
loop of its own in a thread without taking over the process's signals, which are the
daemon's; manylinux aarch64 wheels exist for CPython 3.10 and 3.12.

A request becomes a job exactly as a broker message does: an `IncomingJob` (marked local,
its reply topic `$local/<job id>`) handed to the intake's thread, which checks, journals
and queues it; its result comes back through the responder to the inbox opened here.
The job id is made from the request's `Idempotency-Key` where one is given (with the API
key's name, under an `http-` prefix, so two key holders never share a job and an MQTT
requester's own ids are not touched): a retry is then answered from the journal instead
of running again, unless what is stored is a refusal that said to retry (busy, cancelled,
expired, over budget, unavailable), which runs it again (edge/intake.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from edge.comms.local import LocalDeliveries, reply_topic
from edge.comms.message import IncomingJob
from edge.config.http import HTTPConfig
from edge.http import errors, translate
from edge.http.keys import KeyFile
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.jobs import MAX_ID_CHARS

logger = logging.getLogger(__name__)

# Retry-After on a 429: a fixed hint, not a measure of the queue; a client's own backoff
# decides how long it really waits.
RETRY_AFTER_S = 1
# A streamed request waiting this long with nothing to send gets an SSE comment, so
# proxies and clients that drop an idle connection keep it.
HEARTBEAT_S = 15.0
KEY_NAME = "edge.api_key_name"  # the request's API key's name, once authorized


@dataclass(frozen=True)
class Served:
    """What the daemon serves, as the API names it. `embed` runs the retrieval encoder."""

    device_id: str
    jobs_prefix: str  # the device's job topic without its task level, e.g. edge/box1/jobs
    text_model: str | None
    embed_model: str | None
    embed: Callable[[list[str]], np.ndarray] | None
    max_prompt_chars: int
    ready: Callable[[], bool]


@dataclass
class _Waiting:
    """A submitted job's result documents as they arrive, the request's deadline, and
    whether its final result came (`answered` gets an entry)."""

    inbox: asyncio.Queue[bytes]
    deadline: float
    answered: list[bool]


class _Refused(Exception):
    def __init__(self, status: int, doc: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(doc["error"]["message"])
        self.status = status
        self.doc = doc
        self.headers = headers or {}


def _refused(err: JobError | dict[str, Any], chat: bool = True) -> _Refused:
    status, doc = errors.from_job_error(err, chat)
    return _Refused(status, doc, {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None)


def _json(status: int, doc: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(doc, status=status, headers=headers)


class HTTPServer:
    def __init__(
        self,
        cfg: HTTPConfig,
        served: Served,
        submit: Callable[[IncomingJob], None],
        deliveries: LocalDeliveries,
    ) -> None:
        self._cfg = cfg
        self._served = served
        self._submit = submit
        self._deliveries = deliveries
        self._keys = KeyFile.load(cfg.api_keys_file) if cfg.api_keys_file is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def reload_keys(self) -> bool:
        """Read the keys file again (SIGHUP): keys added or removed count from now. A file
        that cannot be read or parsed keeps the keys in use; False then."""
        path = self._cfg.api_keys_file
        if path is None:
            return True
        try:
            keys = KeyFile.load(path)
        except (OSError, ValueError) as err:
            logger.error("API keys not reloaded, the ones in use stay: %s", err)
            return False
        self._keys = keys  # one reference swapped: a request sees the old set or the new
        logger.info("API keys reloaded from %s: %d key(s)", path, len(keys.hashes))
        return True

    # lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Listen (raises OSError if the address cannot be bound) and serve in a thread."""
        address = self._cfg.address
        if address is None:
            return
        tls = self._tls()  # a missing or bad certificate fails here, before anything is opened
        loop = asyncio.new_event_loop()
        # handler_cancellation: a client that disconnects cancels its handler, which
        # withdraws its job (aiohttp leaves it off by default).
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, address[0], address[1], ssl_context=tls)
        try:
            loop.run_until_complete(site.start())
        except BaseException:
            loop.run_until_complete(runner.cleanup())
            loop.close()
            raise
        bound = runner.addresses
        self.port = int(bound[0][1]) if bound else address[1]
        self._loop, self._runner = loop, runner
        self._thread = threading.Thread(target=loop.run_forever, name="http", daemon=True)
        self._thread.start()
        logger.info("HTTP API listening on %s:%s%s", address[0], self.port, " (TLS)" if self._cfg.cert_file else "")

    def close(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        except Exception:  # stopping; what is in flight stays journalled
            logger.warning("HTTP listener did not close cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
            if not self._thread.is_alive():
                loop.close()
        self._loop = self._runner = None

    def _tls(self) -> ssl.SSLContext | None:
        if self._cfg.cert_file is None or self._cfg.key_file is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(self._cfg.cert_file), str(self._cfg.key_file))
        return ctx

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self._cfg.max_body_bytes, middlewares=[self._guard])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        return app

    # every request -----------------------------------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Keys checked; every failure answered with OpenAI's error object, never a traceback."""
        try:
            if self._keys is not None and request.path != "/health":
                self._authorize(request)
            return await handler(request)
        except _Refused as refused:
            return _json(refused.status, refused.doc, refused.headers)
        except web.HTTPRequestEntityTooLarge:
            limit = self._cfg.max_body_bytes
            return _json(413, errors.body(413, f"the request body is over {limit} bytes", "payload_too_large"))
        except web.HTTPException as http:
            if http.status < 400:
                raise
            code = "not_found" if http.status == 404 else "method_not_allowed" if http.status == 405 else "http_error"
            return _json(http.status, errors.body(http.status, f"{request.method} {request.path}: {http.reason}", code))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("HTTP %s %s failed", request.method, request.path)
            message = "internal error; the daemon's log has the details"
            return _json(500, errors.body(500, message, ErrorCode.INTERNAL.value))

    def _authorize(self, request: web.Request) -> None:
        keys = self._keys
        assert keys is not None
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        name = keys.match(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        if name is None:
            raise _Refused(
                401, errors.body(401, "a valid API key is needed (Authorization: Bearer KEY)", "invalid_api_key")
            )
        request[KEY_NAME] = name

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as err:
            raise _refused(JobError(ErrorCode.BAD_JSON, f"the body is not JSON: {err}")) from err
        except RecursionError as err:  # the parser's own limit, not a fault of the daemon
            raise _refused(JobError(ErrorCode.BAD_JSON, "the body is JSON nested too deeply")) from err
        if not isinstance(body, dict):
            raise _refused(JobError(ErrorCode.INVALID_FIELD, "the body must be a JSON object", "<root>"))
        return body

    def _check_model(self, body: dict[str, Any], served: str | None) -> str:
        model = body.get("model")
        if model is None:
            raise _refused(JobError(ErrorCode.MISSING_FIELD, "model is required (GET /v1/models lists them)", "model"))
        if served is None or model != served:
            listed = served or "none"
            message = f"the model {model!r} is not served here (served: {listed})"
            raise _Refused(404, errors.body(404, message, "model_not_found", "model"))
        return served

    # endpoints -----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """Ready to answer: started, models loaded. Orchestrators probe this."""
        ready = self._served.ready()
        return _json(200 if ready else 503, {"status": "ready" if ready else "starting"})

    def _model_docs(self) -> list[dict[str, Any]]:
        names = [n for n in (self._served.text_model, self._served.embed_model) if n is not None]
        return [{"id": n, "object": "model", "created": 0, "owned_by": self._served.device_id} for n in names]

    async def _models(self, request: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": self._model_docs()})

    async def _model(self, request: web.Request) -> web.Response:
        for doc in self._model_docs():
            if doc["id"] == request.match_info["model"]:
                return _json(200, doc)
        name = request.match_info["model"]
        raise _Refused(404, errors.body(404, f"the model {name!r} is not served here", "model_not_found", "model"))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _embeddings(self, request: web.Request) -> web.Response:
        """An embed job through the intake (the queue, its priority and deadline, the
        journal), as a chat is a qa job."""
        body = await self._body(request)
        model = self._check_model(body, self._served.embed_model)
        try:
            translate.check_embedding_keys(body)
        except JobError as err:
            raise _refused(err) from err
        texts = body.get("input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise _refused(JobError(ErrorCode.INVALID_FIELD, "input must be a string or a list of strings", "input"))
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _refused(JobError(ErrorCode.INVALID_FIELD, "encoding_format is float or base64", "encoding_format"))
        if body.get("dimensions") is not None:
            raise _refused(JobError(ErrorCode.INVALID_FIELD, "the encoder's dimensions are fixed", "dimensions"))
        job_id = self._job_id(request, "embd")
        job: dict[str, Any] = {"id": job_id, "task": "embed", "input": texts}
        for key in ("priority", "deadline_ms"):
            if body.get(key) is not None:
                job[key] = body[key]
        result = await self._submit_and_wait(request, job, "embed")
        if result.get("status") != "ok":
            raise _refused(result.get("error") or {})
        data = []
        for i, vec in enumerate(np.asarray(result["output"]["embeddings"], dtype=np.float32)):
            value: Any = base64.b64encode(vec.astype("<f4").tobytes()).decode() if fmt == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        chars = sum(len(t) for t in texts)
        usage = {"prompt_tokens": chars, "total_tokens": chars}  # characters: the encoder's tokens are not counted
        doc = {"object": "list", "data": data, "model": model, "usage": usage}
        return _json(200, doc, {"X-Request-Id": str(result["id"])})

    # jobs through the intake ----------------------------------------------------------------

    def _job_id(self, request: web.Request, kind: str) -> str:
        """`http-` and the endpoint's `kind`, then a random part, or with an
        Idempotency-Key a digest of the API key's name and the Idempotency-Key: a retry
        finds its job, another key holder's same Idempotency-Key does not."""
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return f"http-{kind}-{uuid.uuid4().hex}"
        if not key or len(key) > MAX_ID_CHARS or not key.isprintable():
            message = f"Idempotency-Key must be 1 to {MAX_ID_CHARS} printable characters"
            raise _refused(JobError(ErrorCode.INVALID_FIELD, message, "Idempotency-Key"))
        scope = f"{request.get(KEY_NAME, '')}\n{key}".encode()
        return f"http-{kind}-{hashlib.sha256(scope).hexdigest()[:32]}"

    @contextlib.asynccontextmanager
    async def _submitted(self, request: web.Request, job: dict[str, Any], task: str) -> AsyncIterator[_Waiting]:
        """`job` handed to the intake as a job of `task` with a reply topic of its own, its
        result documents arriving in the yielded inbox. On the way out, a job not yet
        answered (the client went away, or waited too long) is withdrawn if still queued,
        unless a retry with its key waits on it."""
        job_id = str(job["id"])
        payload = json.dumps(job, sort_keys=True, separators=(",", ":")).encode("utf-8")
        topic = reply_topic(job_id)
        loop = asyncio.get_running_loop()
        waiting = _Waiting(asyncio.Queue(), time.monotonic() + self._cfg.timeout_s, [])

        def deliver(doc: bytes) -> None:  # the responder's thread
            loop.call_soon_threadsafe(waiting.inbox.put_nowait, doc)

        self._deliveries.open(topic, deliver)
        try:
            traceparent = request.headers.get("traceparent")
            prefix = self._served.jobs_prefix
            self._submit(IncomingJob(f"{prefix}/{task}", payload, topic, None, traceparent=traceparent, local=True))
            yield waiting
        finally:
            remaining = self._deliveries.close(topic, deliver)
            if not waiting.answered and remaining == 0:
                self._cancel(job_id)

    async def _submit_and_wait(self, request: web.Request, job: dict[str, Any], task: str) -> dict[str, Any]:
        """The job's final result document."""
        async with self._submitted(request, job, task) as waiting:
            return await self._next(waiting.inbox, waiting.deadline, True, waiting.answered)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        model = self._check_model(body, self._served.text_model)
        job_id = self._job_id(request, "chatcmpl" if chat else "cmpl")
        try:
            job = translate.chat_job(body, job_id) if chat else translate.completion_job(body, job_id)
        except JobError as err:
            raise _refused(err, chat) from err
        async with self._submitted(request, job, "qa") as waiting:
            if job["stream"]:
                return await self._stream(
                    request, waiting.inbox, waiting.deadline, job_id, model, chat, waiting.answered
                )
            return self._answer(await self._next(waiting.inbox, waiting.deadline, True, waiting.answered), model, chat)

    async def _next(
        self,
        inbox: asyncio.Queue[bytes],
        deadline: float,
        final: bool,
        answered: list[bool],
        idle: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """The next result document (the final one if `final`); accepted notices
        skipped. `answered` gets an entry when it is the final one. `idle` is called
        after each HEARTBEAT_S without a document."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refused(504, errors.body(504, "no result within the request timeout", "timeout"))
            wait = left if idle is None else min(left, HEARTBEAT_S)
            try:
                doc: dict[str, Any] = json.loads(await asyncio.wait_for(inbox.get(), wait))
            except asyncio.TimeoutError:
                if idle is not None and deadline - time.monotonic() > 0:
                    await idle()
                continue
            status = doc.get("status")
            if status == "accepted" or (final and status == "partial"):
                continue
            if status != "partial":
                answered.append(True)
            return doc

    def _answer(self, result: dict[str, Any], model: str, chat: bool) -> web.Response:
        if result.get("status") != "ok":
            raise _refused(result.get("error") or {}, chat)
        doc = translate.chat_response(result, model) if chat else translate.completion_response(result, model)
        return _json(200, doc, {"X-Request-Id": str(result["id"])})

    async def _stream(
        self,
        request: web.Request,
        inbox: asyncio.Queue[bytes],
        deadline: float,
        job_id: str,
        model: str,
        chat: bool,
        answered: list[bool],
    ) -> web.StreamResponse:
        """Server-sent events: a chunk per partial result, the last with finish_reason,
        then [DONE]. A refusal before anything was sent is an ordinary error response;
        once the stream has started (a first piece, or a heartbeat comment while the job
        waits in the queue) a refusal, a timeout included, is an error event, then [DONE]."""
        events = _Events(request, job_id)

        async def idle() -> None:
            await events.comment("waiting")

        try:
            doc = await self._next(inbox, deadline, False, answered, idle)
            if doc.get("status") == "error" and not events.started:
                raise _refused(doc.get("error") or {}, chat)
            if chat and doc.get("status") != "error":  # OpenAI's first chunk: the role, no content yet
                await events.send(translate.chunk(job_id, model, chat, "", role="assistant"))
            sent = ""
            while True:
                status = doc.get("status")
                if status == "partial":
                    delta = str(doc.get("delta", ""))
                    sent += delta
                    await events.send(translate.chunk(job_id, model, chat, delta))
                elif status == "ok":
                    output = doc.get("output") or {}
                    answer = str(output.get("answer", ""))
                    if answer.startswith(sent) and len(answer) > len(sent):
                        # What the pieces did not carry (all of it for a result from the journal).
                        await events.send(translate.chunk(job_id, model, chat, answer[len(sent) :]))
                    finish = translate.FINISH.get(str(output.get("finish_reason")), "stop")
                    last = translate.chunk(job_id, model, chat, None, finish)
                    last["edge"] = translate.extension(doc)
                    await events.send(last)
                    break
                else:
                    await events.send(errors.from_job_error(doc.get("error") or {}, chat)[1])
                    break
                doc = await self._next(inbox, deadline, False, answered, idle)
        except _Refused as refused:
            if not events.started:
                raise
            await events.send(refused.doc)
        return await events.done()

    def _cancel(self, job_id: str) -> None:
        """Withdraw the job if it is still queued: a cancel job through the same intake."""
        cancel_id = f"http-cancel-{uuid.uuid4().hex}"
        payload = json.dumps({"id": cancel_id, "task": "cancel", "job": job_id}).encode("utf-8")
        topic = f"{self._served.jobs_prefix}/cancel"
        try:
            self._submit(IncomingJob(topic, payload, reply_topic(cancel_id), None, local=True))
        except Exception:  # the job then runs to its end: never a reason to fail the handler
            logger.exception("could not withdraw job %s", job_id)


class _Events:
    """A server-sent event stream whose headers go out with its first write."""

    def __init__(self, request: web.Request, job_id: str) -> None:
        self._request = request
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": job_id}
        )
        self.started = False

    async def _write(self, data: bytes) -> None:
        if not self.started:
            await self._response.prepare(self._request)
            self.started = True
        await self._response.write(data)

    async def send(self, doc: dict[str, Any]) -> None:
        await self._write(b"data: " + json.dumps(doc).encode("utf-8") + b"\n\n")

    async def comment(self, text: str) -> None:
        await self._write(b": " + text.encode("utf-8") + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self._write(b"data: [DONE]\n\n")
        await self._response.write_eof()
        return self._response
