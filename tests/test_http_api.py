"""The OpenAI-compatible HTTP API (docs/http.md) through the daemon as a real process, with
a real broker and OpenAI's own Python client as the caller: HTTP requests are jobs of the
same intake, queue and journal as MQTT ones."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic import ValidationError

from edge.comms.local import LocalDeliveries
from edge.comms.message import IncomingJob
from edge.config.http import HTTPConfig
from edge.http import server
from edge.http.keys import KeyFile, add_key
from edge.http.server import HTTPServer, Served
from tests.conftest import (
    LABELS,
    SAMPLES,
    Broker,
    DaemonProc,
    Requester,
    free_port,
    start_daemon,
    write_profile,
)

TOKEN_CAP = 96  # the profile's max_new_tokens_limit
PROMPT_CHARS = 8000  # the default limits.max_prompt_chars
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


def _edge(resp: Any) -> dict[str, Any]:
    """What the box adds to an OpenAI response (its `edge` key)."""
    extra = resp.model_extra or {}
    return extra["edge"]  # type: ignore[no-any-return]


class Box:
    def __init__(self, daemon: DaemonProc, base_url: str, key: str, model: str, embed_model: str, keys: Path) -> None:
        self.daemon = daemon
        self.keys = keys
        self.base_url = base_url
        self.key = key
        self.model = model
        self.embed_model = embed_model

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, **kwargs)

    def status(self) -> dict[str, Any]:
        res = self.daemon.status()
        return json.loads(res.stdout)  # type: ignore[no-any-return]

    def text_branch(self) -> dict[str, Any]:
        return self.status()["branches"]["text"]  # type: ignore[no-any-return]

    def wait_text(self, running: int, depth: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text_branch()
            if text["running"] >= running and text["depth"] >= depth:
                return
            time.sleep(0.05)
        raise TimeoutError(f"text branch never reached running {running}, depth {depth}: {self.text_branch()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text_branch()
            if text["running"] == 0 and text["depth"] == 0:
                return
            time.sleep(0.05)
        raise TimeoutError("text branch still busy")


@pytest.fixture(scope="module")
def box(broker: Broker, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    directory = tmp_path_factory.mktemp("http")
    from edge.docs.embed import Embedder, locate
    from edge.docs.ingest import add
    from edge.docs.store import DocStore

    info = locate(engine_dir)
    add(DocStore(directory / "state" / "docs"), "leaflets", [SAMPLES / "leaflets"], Embedder.load(info))
    keys = directory / "api-keys"
    key = add_key(keys, "tests")
    port = free_port()
    profile = write_profile(
        directory,
        broker.port,
        engine_dir,
        device_id="web1",
        models={
            "ocr": {"threads": 1},
            "inspect": {"build_size": "quick", "threads": 1, "max_queue_delay_ms": 50},
            "qa": {
                "max_new_tokens": 16,
                "max_context_tokens": 512,
                "max_sequences": 1,
                "max_new_tokens_limit": TOKEN_CAP,
            },
        },
        queue={"max_size": 2},
        http={"listen": f"127.0.0.1:{port}", "api_keys_file": str(keys), "max_body_bytes": 64 * 1024},
    )
    daemon = start_daemon(profile)
    try:
        status = daemon.wait_ready()
        assert status["http"]["port"] == port, status["http"]
        b = Box(daemon, f"http://127.0.0.1:{port}/v1", key, "", info.model, keys)
        b.model = next(m.id for m in b.client().models.list().data if m.id != info.model)
        yield b
    finally:
        daemon.stop()


def test_models_and_health(box: Box) -> None:
    models = box.client().models.list().data
    assert {m.id for m in models} == {box.model, box.embed_model}
    assert all(m.owned_by == "web1" for m in models)
    assert _raw("GET", box.base_url.removesuffix("/v1") + "/health") == (200, {"status": "ready"})


def test_chat_completion_carries_usage_and_the_boxs_extension(box: Box) -> None:
    resp = box.client().chat.completions.create(model=box.model, messages=HELLO, max_tokens=8)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 0
    edge = _edge(resp)
    assert edge["device"] == "web1" and edge["timings"]["total_ms"] > 0
    # The job went through the journal and the job statistics like an MQTT one.
    assert box.status()["jobs"]["ok_by_task"].get("qa", 0) >= 1


def test_completion_and_retrieval_extension(box: Box) -> None:
    resp = box.client().completions.create(
        model=box.model,
        prompt="How often is the dressing changed?",
        max_tokens=12,
        extra_body={"collection": "leaflets", "priority": 3, "deadline_ms": 120_000},
    )
    assert resp.object == "text_completion" and resp.choices[0].text
    edge = _edge(resp)
    # Retrieval ran, and the answer carries its citations, checked against the passages.
    assert edge["timings"]["stages"].get("search", 0) > 0, edge
    assert edge["citations"], edge


def test_streaming_pieces_add_up_to_the_answer(box: Box) -> None:
    client = box.client()
    stream = client.chat.completions.create(model=box.model, messages=HELLO, max_tokens=10, stream=True)
    pieces: list[str] = []
    finish = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert len(pieces) >= 2 and finish in (["stop"], ["length"])
    # Greedy: the same request without streaming gives the same text.
    whole = client.chat.completions.create(model=box.model, messages=HELLO, max_tokens=10)
    assert "".join(pieces) == whole.choices[0].message.content


def test_embeddings_are_the_retrieval_encoders(box: Box) -> None:
    resp = box.client().embeddings.create(model=box.embed_model, input=["a wound dressing", "a pump"])
    assert [d.index for d in resp.data] == [0, 1]
    assert len(resp.data[0].embedding) == 384
    one = box.client().embeddings.create(model=box.embed_model, input="a wound dressing", encoding_format="float")
    assert one.data[0].embedding == pytest.approx(resp.data[0].embedding, abs=1e-5)


def test_embeddings_are_embed_jobs_of_the_text_queue(box: Box) -> None:
    """/v1/embeddings is an `embed` job through the intake: counted by task, journalled (a
    retry with its Idempotency-Key is answered once, from the journal), answered between
    the decode steps of a running chat; its errors name the field."""
    box.wait_idle()
    client = box.client()
    before = box.status()["jobs"]["ok_by_task"].get("embed", 0)
    held: list[Any] = []
    blocker = _busy(box, held)
    try:
        key = {"Idempotency-Key": f"embed-{uuid.uuid4().hex}"}
        first = client.embeddings.with_raw_response.create(
            model=box.embed_model, input=["a wound dressing"], extra_headers=key
        )
        assert box.text_branch()["running"] == 1 and not held  # the chat still decodes
        again = client.embeddings.with_raw_response.create(
            model=box.embed_model, input=["a wound dressing"], extra_headers=key
        )
    finally:
        blocker.join(120)
    job_id = first.headers["X-Request-Id"]
    assert job_id.startswith("http-embd-") and again.headers["X-Request-Id"] == job_id
    assert first.parse().data[0].embedding == again.parse().data[0].embedding
    assert box.status()["jobs"]["ok_by_task"].get("embed", 0) == before + 1
    with pytest.raises(openai.BadRequestError) as long_input:
        client.embeddings.create(model=box.embed_model, input=["ok", "x" * (PROMPT_CHARS + 1)])
    assert _error(long_input)["code"] == "prompt_too_long" and _error(long_input)["param"] == "input[1]"
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model=box.embed_model, input=["ok", ""])
    assert _error(empty)["param"] == "input"
    with pytest.raises(openai.BadRequestError) as misspelt:
        client.embeddings.create(model=box.embed_model, input="ok", extra_body={"encodng_format": "float"})
    assert _error(misspelt)["param"] == "encodng_format"


def _raw(method: str, url: str, body: bytes | None = None, key: str | None = None) -> tuple[int, Any]:
    """A request as any HTTP client sends it: the status and the JSON body."""
    req = urllib.request.Request(url, data=body, method=method)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _error(exc: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = exc.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


def test_structured_output_through_the_api(box: Box) -> None:
    """OpenAI's response_format (json_schema) becomes the qa job's: the answer is JSON the
    schema validates, and the box's extension carries it parsed."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"serial": {"type": "string", "maxLength": 24}, "defect": {"type": "boolean"}},
        "required": ["serial", "defect"],
        "additionalProperties": False,
    }
    question = "Part SN-4471 has a crack along its edge. Give its serial and whether it is defective."
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "part", "schema": schema, "strict": True}}
    reply = box.client().chat.completions.create(
        model=box.model, messages=[{"role": "user", "content": question}], max_tokens=40, response_format=fmt
    )
    parsed = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(parsed, schema)
    assert (reply.model_extra or {})["edge"]["json"] == parsed


def test_errors_name_the_field_in_openais_error_object(box: Box) -> None:
    client = box.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=box.model, messages=HELLO, extra_body={"temperature": "hot"})
    assert _error(bad)["param"] == "temperature" and _error(bad)["code"] == "invalid_field"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    assert _error(unknown)["code"] == "model_not_found" and _error(unknown)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(model=box.model, messages=HELLO, max_tokens=TOKEN_CAP + 1)
    assert _error(many)["param"] == "max_tokens" and str(TOKEN_CAP) in _error(many)["message"]
    with pytest.raises(openai.BadRequestError) as many_streamed:  # refused before any event: a plain error
        client.chat.completions.create(model=box.model, messages=HELLO, max_tokens=TOKEN_CAP + 1, stream=True)
    assert _error(many_streamed)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as fmt:
        bad_schema: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "colour"}}}
        client.chat.completions.create(model=box.model, messages=HELLO, response_format=bad_schema)
    assert _error(fmt)["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as unknown_field:
        client.chat.completions.create(model=box.model, messages=HELLO, extra_body={"temprature": 0.5})
    assert _error(unknown_field)["param"] == "temprature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=box.base_url, api_key="edge-wrong", max_retries=0).models.list()
    # Not JSON, too large, a wrong path: the same error object, never a traceback.
    url = box.base_url + "/chat/completions"
    status, broken = _raw("POST", url, b"{not json", box.key)
    assert status == 400 and broken["error"]["code"] == "bad_json"
    status, huge = _raw("POST", url, b'{"x": "' + b"a" * 70_000 + b'"}', box.key)
    assert status == 413 and huge["error"]["code"] == "payload_too_large"
    status, missing = _raw("GET", box.base_url + "/nothing", None, box.key)
    assert status == 404 and missing["error"]["type"] == "not_found_error"
    # Those refusals cost the daemon nothing: it still answers.
    assert client.chat.completions.create(model=box.model, messages=HELLO, max_tokens=4).choices[0].message.content


def test_an_idempotent_retry_is_answered_once_from_the_journal(box: Box) -> None:
    client = box.client()
    key = f"retry-{uuid.uuid4().hex}"
    before = box.status()["jobs"]["ok_by_task"].get("qa", 0)
    first = client.chat.completions.create(
        model=box.model, messages=HELLO, max_tokens=6, extra_headers={"Idempotency-Key": key}
    )
    again = client.chat.completions.create(
        model=box.model, messages=HELLO, max_tokens=6, extra_headers={"Idempotency-Key": key}
    )
    assert first.id == again.id and first.id.startswith("http-chatcmpl-")  # the key scoped, not taken as is
    assert first.choices[0].message.content == again.choices[0].message.content
    # The stored result itself, its timings included: the job ran once.
    assert _edge(first)["timings"] == _edge(again)["timings"]
    assert box.status()["jobs"]["ok_by_task"].get("qa", 0) == before + 1
    # The key with another request is refused, not answered with the first one's result.
    with pytest.raises(openai.BadRequestError) as reused:
        client.chat.completions.create(
            model=box.model, messages=HELLO, max_tokens=7, extra_headers={"Idempotency-Key": key}
        )
    assert "another job" in _error(reused)["message"]


def _busy(box: Box, results: list[Any]) -> threading.Thread:
    """A long chat in a thread, running on the text branch once this returns: sampling at
    the highest temperature almost never draws end-of-text, so it runs to its token cap."""

    def run() -> None:
        try:
            client = box.client(timeout=120)
            results.append(
                client.chat.completions.create(
                    model=box.model, messages=HELLO, max_tokens=TOKEN_CAP, temperature=5.0, seed=7
                )
            )
        except Exception as err:
            results.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    box.wait_text(running=1, depth=0)
    return thread


def test_a_full_queue_answers_429_with_retry_after(box: Box, broker: Broker) -> None:
    box.wait_idle()
    held: list[Any] = []
    blocker = _busy(box, held)
    requester = Requester(broker.port)
    try:
        corrs = [
            requester.send(
                "edge/web1/jobs/qa", {"id": f"fill-{uuid.uuid4().hex}", "question": "Hi", "max_new_tokens": 2}
            )
            for _ in range(2)
        ]
        box.wait_text(running=1, depth=2)
        with pytest.raises(openai.RateLimitError) as full:
            box.client().chat.completions.create(model=box.model, messages=HELLO, max_tokens=4)
        assert full.value.response.headers["Retry-After"].isdigit()
        assert _error(full)["code"] == "busy"
        assert all(requester.wait(c, timeout=120)["status"] == "ok" for c in corrs)
    finally:
        blocker.join(120)
        requester.close()
    assert not isinstance(held[0], Exception), held


def test_a_client_that_goes_away_withdraws_its_queued_job(box: Box) -> None:
    box.wait_idle()
    held: list[Any] = []
    blocker = _busy(box, held)
    key = f"gone-{uuid.uuid4().hex}"
    try:
        with pytest.raises(openai.APITimeoutError):
            box.client(timeout=1.0).chat.completions.create(
                model=box.model, messages=HELLO, max_tokens=4, extra_headers={"Idempotency-Key": key}
            )
        deadline = time.monotonic() + 30
        while box.text_branch()["depth"] != 0:  # withdrawn while queued
            assert time.monotonic() < deadline, box.text_branch()
            time.sleep(0.05)
        # The same request again runs: a withdrawal is no answer to keep for the key.
        again = box.client(timeout=120).chat.completions.create(
            model=box.model, messages=HELLO, max_tokens=4, extra_headers={"Idempotency-Key": key}
        )
        assert again.choices[0].message.content
    finally:
        blocker.join(120)
    assert not isinstance(held[0], Exception), held


def test_a_client_that_goes_away_mid_answer_stops_its_running_job(box: Box) -> None:
    """A streamed chat whose client closes the connection after its first pieces: the
    job is stopped before its next decode step (counted in status), not run to its token
    cap, and the branch is free for the next request at once."""
    box.wait_idle()
    before = box.text_branch()["stopped"]
    stream = box.client(timeout=120).chat.completions.create(
        model=box.model, messages=HELLO, max_tokens=TOKEN_CAP, temperature=5.0, seed=11, stream=True
    )
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        if pieces >= 2:
            break
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 30
    while box.text_branch()["stopped"] != before + 1:
        assert time.monotonic() < deadline, box.text_branch()
        time.sleep(0.02)
    box.wait_idle(timeout=10)
    after = box.client(timeout=120).chat.completions.create(model=box.model, messages=HELLO, max_tokens=4)
    assert after.choices[0].message.content


def test_a_camera_job_at_priority_0_overtakes_a_queued_http_chat(box: Box, broker: Broker) -> None:
    box.wait_idle()
    held: list[Any] = []
    blocker = _busy(box, held)
    done: dict[str, float] = {}
    chat: list[Any] = []

    def ask_http() -> None:
        chat.append(
            box.client(timeout=120).chat.completions.create(
                model=box.model, messages=HELLO, max_tokens=8, extra_body={"priority": 5}
            )
        )
        done["http"] = time.monotonic()

    requester = Requester(broker.port)
    http_thread = threading.Thread(target=ask_http)
    try:
        http_thread.start()
        box.wait_text(running=1, depth=1)  # the HTTP chat waits behind the long one
        camera = {
            "id": f"cam-{uuid.uuid4().hex}",
            "priority": 0,
            "image": {"path": f"labels/{LABELS[0]['name']}"},
            "ask": {"question": "Write the rework note.", "max_new_tokens": 8},
        }
        corr = requester.send("edge/web1/jobs/inspect", camera)
        result = requester.wait(corr, timeout=120)
        done["camera"] = time.monotonic()
        assert result["status"] == "ok", result
        http_thread.join(120)
        assert chat and chat[0].choices[0].message.content
        assert done["camera"] < done["http"], done
    finally:
        http_thread.join(120)
        blocker.join(120)
        requester.close()


def test_a_traceparent_header_continues_the_trace(box: Box) -> None:
    trace = uuid.uuid4().hex
    resp = box.client().chat.completions.create(
        model=box.model, messages=HELLO, max_tokens=4, extra_headers={"traceparent": f"00-{trace}-{'1' * 16}-01"}
    )
    # The job's span is a child in the caller's trace: same trace id, a span id of its own.
    _, trace_id, span_id, _ = _edge(resp)["traceparent"].split("-")
    assert trace_id == trace and span_id != "1" * 16


def test_a_key_added_counts_after_sighup_and_the_old_ones_still_do(box: Box) -> None:
    new = add_key(box.keys, f"late-{uuid.uuid4().hex[:8]}")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=box.base_url, api_key=new, max_retries=0).models.list()
    box.daemon.proc.send_signal(signal.SIGHUP)
    late = openai.OpenAI(base_url=box.base_url, api_key=new, max_retries=0)
    deadline = time.monotonic() + 30
    while True:  # the supervising loop reads the file again within a second or so
        try:
            assert late.models.list().data
            break
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert box.client().models.list().data


# The pieces on their own, without a daemon ------------------------------------------------


def test_the_keys_file_holds_hashes_and_matches_only_its_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    first, second = add_key(keys, "frigate"), add_key(keys, "webui")
    text = keys.read_text()
    assert first not in text and second not in text  # hashes only
    assert keys.stat().st_mode & 0o777 == 0o600
    loaded = KeyFile.load(keys)
    assert loaded.match(first) == "frigate" and loaded.match(second) == "webui"
    assert loaded.match(first + "x") is None and loaded.match("") is None
    with pytest.raises(ValueError, match="already has"):
        add_key(keys, "frigate")
    keys.write_text(text + "broken-line\n")
    with pytest.raises(ValueError, match=":3:"):
        KeyFile.load(keys)


def test_the_listener_is_loopback_unless_the_profile_allows_more() -> None:
    assert HTTPConfig().address is None  # off by default
    assert HTTPConfig(listen="127.0.0.1:8080").address == ("127.0.0.1", 8080)
    assert HTTPConfig(listen="[::1]:8080").address == ("::1", 8080)
    for remote in ("0.0.0.0:8080", "192.168.1.5:8080", "box.local:8080"):
        with pytest.raises(ValidationError, match="allow_remote"):
            HTTPConfig(listen=remote)
        assert HTTPConfig(listen=remote, allow_remote=True, api_keys_file=Path("keys")).address is not None
    with pytest.raises(ValidationError, match="together"):
        HTTPConfig(listen="127.0.0.1:8443", cert_file=Path("a.crt"))


def test_tls_serves_https_with_the_profiles_certificate(tmp_path: Path) -> None:
    from tests.test_tls import make_pki

    make_pki(tmp_path)
    deliveries = LocalDeliveries()

    def answer(job: IncomingJob) -> None:  # stands in for intake, queue and responder
        doc = json.loads(job.payload)
        result = {"id": doc["id"], "status": "ok", "device": "t", "output": {"answer": "hi", "finish_reason": "eos"}}
        assert job.local and job.response_topic is not None
        deliveries.publish(job.response_topic, json.dumps(result).encode(), None, doc["id"])

    port = free_port()
    cfg = HTTPConfig(listen=f"127.0.0.1:{port}", cert_file=tmp_path / "server.crt", key_file=tmp_path / "server.key")
    served = Served("t", "edge/t/jobs", "m", None, None, 1000, lambda: True)
    server = HTTPServer(cfg, served, answer, deliveries)
    server.start()
    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"https://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            doc = json.loads(resp.read())
        assert doc["choices"][0]["message"]["content"] == "hi" and doc["choices"][0]["finish_reason"] == "stop"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is not served beside it
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        server.close()


def test_allow_remote_needs_a_keys_file(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="allow_remote needs api_keys_file"):
        HTTPConfig(listen="0.0.0.0:8080", allow_remote=True)
    assert HTTPConfig(listen="0.0.0.0:8080", allow_remote=True, api_keys_file=tmp_path / "keys").address


class _Fake:
    """A listener on its own: what would go to the intake is kept here, and the test
    answers it on the job's `$local/` topic as the responder would."""

    def __init__(self, timeout_s: float = 30.0, ready: bool = True) -> None:
        self.deliveries = LocalDeliveries()
        self.jobs: list[dict[str, Any]] = []
        self.port = free_port()
        cfg = HTTPConfig(listen=f"127.0.0.1:{self.port}", timeout_s=timeout_s)
        served = Served("t", "edge/t/jobs", "m", None, None, 1000, lambda: ready)
        self.server = HTTPServer(cfg, served, lambda job: self.jobs.append(json.loads(job.payload)), self.deliveries)

    def __enter__(self) -> _Fake:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    def answer(self, job_id: str, doc: dict[str, Any]) -> None:
        self.deliveries.publish(f"$local/{job_id}", json.dumps({"id": job_id, **doc}).encode(), None, job_id)

    def wait(self, check: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, self.jobs
            time.sleep(0.02)

    def post(self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None) -> Any:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        return conn


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_stream_that_times_out_midway_ends_with_an_error_event_and_done() -> None:
    with _Fake(timeout_s=1.0) as fake:
        conn = fake.post("/v1/chat/completions", {**CHAT, "stream": True})
        fake.wait(lambda: fake.jobs)
        fake.answer(fake.jobs[0]["id"], {"status": "partial", "seq": 0, "delta": "Hel"})
        resp = conn.getresponse()
        events = [e.removeprefix("data: ") for e in resp.read().decode().split("\n\n") if e]
    assert resp.status == 200 and events[-1] == "[DONE]"
    first, piece, error = (json.loads(e) for e in events[:-1])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # OpenAI's first chunk
    assert piece["choices"][0]["delta"] == {"content": "Hel"}
    assert error["error"]["code"] == "timeout"


def test_a_queued_stream_gets_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HEARTBEAT_S", 0.1)
    with _Fake(timeout_s=0.5) as fake:
        resp = fake.post("/v1/chat/completions", {**CHAT, "stream": True}).getresponse()
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert resp.status == 200 and events[0] == ": waiting" and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "timeout"


def test_requests_sharing_a_key_share_its_job_until_the_last_leaves() -> None:
    with _Fake() as fake:
        key = {"Idempotency-Key": "k1"}
        leaving = fake.post("/v1/chat/completions", CHAT, key)
        fake.wait(lambda: fake.deliveries.waiting() == 1)
        staying = fake.post("/v1/chat/completions", CHAT, key)
        fake.wait(lambda: fake.deliveries.waiting() == 2)
        job_id = fake.jobs[0]["id"]
        assert job_id.startswith("http-chatcmpl-") and job_id != "k1"  # the key is never the id itself
        leaving.close()
        fake.wait(lambda: fake.deliveries.waiting() == 1)
        time.sleep(0.2)
        assert [j["task"] for j in fake.jobs] == ["qa", "qa"]  # no cancel: the other still waits
        fake.answer(job_id, {"status": "ok", "output": {"answer": "hi", "finish_reason": "eos"}})
        resp = staying.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"][0]["message"]["content"] == "hi"
        # The last one to leave withdraws it.
        fake.post("/v1/chat/completions", CHAT, {"Idempotency-Key": "k2"}).close()
        fake.wait(lambda: fake.jobs[-1]["task"] == "cancel")
        assert fake.jobs[-1]["job"] == fake.jobs[-2]["id"]


def test_health_nesting_and_the_completion_fields_name() -> None:
    with _Fake(ready=False) as fake:
        conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        resp = fake.post("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000).getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == "bad_json"
        conn = fake.post("/v1/completions", {"model": "m", "prompt": "hi"})
        fake.wait(lambda: fake.jobs)
        error = {"code": "prompt_too_long", "message": "too long", "field": "question"}
        fake.answer(fake.jobs[0]["id"], {"status": "error", "error": error})
        resp = conn.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"]["param"] == "prompt"
