"""Questions about an image as jobs: a `qa` job with an `image`, answered by a
vision-language model the daemon serves (a small random-weight LLaVA-1.5, built with
transformers by bench/vlm_models.py as tests/test_vlm.py builds it, then by `edgectl
build` as a profile's models.qa.source), through a real Mosquitto; its image part counted
in the ledger, its image tokens in its KV; a bad image failing its own job alone; a text
model without an image part refusing such a job naming `image`. Random weights: answers
are checked to arrive and to follow their image, never for what they say."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from PIL import Image

from bench.vlm_models import make_llava, random_image
from edge.builds import locate
from edge.config.loader import load_profile
from edge.config.text import QAModelConfig
from edge.docs.retrieve import Passage
from edge.memory import HostProbe, host_working_bytes
from edge.protocol.errors import JobError
from edge.protocol.images import ImageLimits
from edge.protocol.jobs import ImageRef, ParsedJob, QAJob
from edge.scheduler.branch import Outcome
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager
from edge.scheduler.queue import PriorityDeadlineQueue
from edge.scheduler.text_worker import TextMemory, TextWorker
from edge.scheduler.work import Reply, WorkItem
from edge.tasks.grounding import GroundingPolicy
from edge.tasks.media import MediaLoader
from edge.tasks.passage_fit import context_with
from edge.tasks.qa import QATask, job_sequence, start_qa
from edge.tasks.retrieval import Retrieval
from edge.text.engine import TextEngine, variant
from edge.text.kv.kv_cache import KVSlot
from edge.text.runtime.continuous import Sequence
from edge.vlm.image_prep import prepare, prepare_cost
from edge.vlm.vision_language import VisionLanguage
from edge.vlm.vlm_config import ImagePrep
from tests import fakes
from tests.conftest import Broker, DaemonProc, Requester, edgectl, free_port, start_daemon, write_profile

QUESTION = "What is wrong with this part?"
NEW_TOKENS = 12
IMAGE_TOKENS = 16  # a 4x4 patch grid, CLIP's class token dropped (bench/vlm_models.py)
MAX_PIXELS = 1_000_000  # the test daemon's limits.max_image_pixels
JOBS = "edge/v1/jobs"


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data(image: Any) -> dict[str, str]:
    return {"data": base64.b64encode(_png(image)).decode()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The LLaVA source and its build by `edgectl build`, as a user's profile names it."""
    root = tmp_path_factory.mktemp("vlm-jobs")
    _, processor = make_llava(root / "source", "llava")
    qa = {"source": str(root / "source"), "adapter": "none", "max_new_tokens": NEW_TOKENS, "max_context_tokens": 256}
    models = {"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa}
    profile = write_profile(root, free_port(), root / "engines", device_id="v1", models=models)
    res = edgectl("build", "--profile", str(profile), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    media = root / "media"
    media.mkdir()
    (media / "part_b.png").write_bytes(_png(random_image(60, 50, seed=12)))
    checkpoint = locate(load_profile(profile), "qa", None)
    return {"root": root, "models": models, "media": media, "checkpoint": checkpoint, "processor": processor}


@pytest.fixture(scope="module")
def vlm_daemon(built: dict[str, Any], broker: Broker) -> Iterator[DaemonProc]:
    directory = built["root"] / "daemon"
    directory.mkdir()
    profile = write_profile(
        directory,
        broker.port,
        built["root"] / "engines",
        device_id="v1",
        models=built["models"],
        limits={"max_image_pixels": MAX_PIXELS},
        paths={"media_dir": str(built["media"])},
    )
    d = start_daemon(profile)
    d.wait_ready()
    yield d
    d.stop()


@pytest.mark.integration
def test_a_question_about_an_image_is_answered_from_its_pixels(vlm_daemon: DaemonProc, requester: Requester) -> None:
    image_a = _data(random_image(45, 80, seed=11))
    jobs: dict[str, dict[str, Any]] = {
        "a": {"question": QUESTION, "image": image_a},
        "b": {"question": QUESTION, "image": {"path": "part_b.png"}},
        "a-again": {"question": QUESTION, "image": image_a},
        "text": {"question": QUESTION},
    }
    # Sent together: they go into the one batcher side by side.
    corrs = {name: requester.send(f"{JOBS}/qa", {"id": f"img-{name}", **job}) for name, job in jobs.items()}
    results = {name: requester.wait(corr, 120) for name, corr in corrs.items()}
    assert all(r["status"] == "ok" for r in results.values()), results
    out = {name: r["output"] for name, r in results.items()}
    # Greedy: the same image, the same answer; another image, another one.
    assert out["a"]["answer"] == out["a-again"]["answer"]
    assert out["a"]["answer"] != out["b"]["answer"]
    for name in ("a", "b"):
        assert out[name]["image_tokens"] == IMAGE_TOKENS
        # The image's tokens are prompt tokens: the question about an image has them on top.
        assert out[name]["prompt_tokens"] >= out["text"]["prompt_tokens"] + IMAGE_TOKENS
        assert out[name]["completion_tokens"] > 0
        stages = results[name]["timings"]["stages"]
        # The image is decoded and encoded once the job's KV is granted, after its prompt is tokenized.
        assert list(stages) == ["queued", "tokenize", "image_decode", "image_encode", "prefill", "decode", "detokenize"]
        assert stages["image_encode"] > 0
    assert "image_tokens" not in out["text"]


@pytest.mark.integration
def test_a_bad_image_fails_its_own_job_and_the_others_complete(vlm_daemon: DaemonProc, requester: Requester) -> None:
    bad = {
        "garbage": ({"data": base64.b64encode(b"not an image at all").decode()}, "image_invalid", "image.data"),
        "gif": ({"data": base64.b64encode(b"GIF89a" + bytes(64)).decode()}, "image_invalid", "image.data"),
        "pixels": (_data(Image.new("RGB", (1000, 1100))), "image_too_large", "image.data"),
        "strip": (_data(Image.new("RGB", (1500, 20))), "image_too_large", "image.data"),  # padded to a square
        "outside": ({"path": "../source/config.json"}, "path_forbidden", "image.path"),
        "type": ("part_b.png", "invalid_field", "image"),
    }
    good = [
        requester.send(f"{JOBS}/qa", {"id": f"good-{i}", "question": QUESTION, "image": {"path": "part_b.png"}})
        for i in range(2)
    ]
    sent = {name: requester.send(f"{JOBS}/qa", {"id": f"bad-{name}", "question": QUESTION, "image": image})
            for name, (image, _, _) in bad.items()}  # fmt: skip
    for name, (_, code, field) in bad.items():
        result = requester.wait(sent[name], 120)
        assert result["status"] == "error", (name, result)
        assert (result["error"]["code"], result["error"]["field"]) == (code, field), (name, result)
    answers = [requester.wait(corr, 120) for corr in good]
    assert all(r["status"] == "ok" for r in answers), answers
    assert answers[0]["output"]["answer"] == answers[1]["output"]["answer"]


@pytest.mark.integration
def test_the_ledger_counts_the_image_part(vlm_daemon: DaemonProc, built: dict[str, Any]) -> None:
    doc = vlm_daemon.state()
    assert doc is not None
    weights = VisionLanguage.load(built["checkpoint"]).nbytes  # float32 on the CPU, as served
    (part,) = [m for m in doc["models"] if m["name"].endswith("-image")]
    assert part["branch"] == "text" and part["loaded"]
    assert part["memory_bytes"] >= weights > 0
    assert part["working_bytes"] > 0  # what each image question reserves beyond its image
    memory = doc["memory"]
    assert memory["models"][part["name"]]["bytes"] == part["memory_bytes"]
    held = sum(entry["bytes"] for entry in memory["models"].values())
    assert memory["used_bytes"] == held + memory["reserved_bytes"]
    assert memory["used_bytes"] <= memory["budget_bytes"] - memory["headroom_bytes"]


@pytest.fixture(scope="module")
def task(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> QATask:
    """The qa task in this process, as the daemon starts it."""
    responder, _, _ = fakes.responder(tmp_path_factory.mktemp("vlm-task"))
    manager = ModelManager(MemoryLedger(8192 * 2**20, 0), HostProbe())
    cfg = QAModelConfig(source=str(built["root"] / "source"), adapter="none", max_context_tokens=256)
    media = MediaLoader(ImageLimits(2**20, MAX_PIXELS), built["media"])
    return start_qa(cfg, built["checkpoint"], manager, responder, media=media)


def _item(job: QAJob) -> WorkItem:
    return WorkItem(ParsedJob(job.id, "qa", 5, None, job), Reply("r"))


def test_image_tokens_take_kv_as_prompt_tokens(task: QATask) -> None:
    job = QAJob(id="kv", question=QUESTION, image=ImageRef(path="part_b.png"), max_new_tokens=NEW_TOKENS)
    seq = task.prepare(_item(job))
    assert isinstance(seq, Sequence)
    with_token = task.engine.prompter.ids(QUESTION, None, images=1)
    assert len(seq.prompt) == len(with_token) - 1 + IMAGE_TOKENS  # its image token made one per row
    assert task.kv_tokens(seq) == len(seq.prompt) + NEW_TOKENS
    assert task.images is not None and task.images.name.endswith("-image")
    assert task.images is not None and task.engine.batcher.single(seq, "kv").tokens


def test_a_model_without_an_image_part_refuses_the_image_naming_it(task: QATask) -> None:
    """The same language model served without its image part (as a text model's build
    is): a job with an image is refused, naming the field, before anything is read."""
    blind = QATask(task.engine, task._responder)
    job = QAJob(id="blind", question=QUESTION, image=ImageRef(path="no-such-file.png"))
    with pytest.raises(JobError) as err:
        blind.prepare(_item(job))
    assert (err.value.code, err.value.field) == ("unavailable", "image")
    # Where the profile asks every question of a collection and none is named, the image is
    # still refused, not answered with an abstention; and an image part that failed to
    # load says so.
    strict = GroundingPolicy.of(QAModelConfig(require_collection=True))
    failed = QATask(task.engine, task._responder, policy=strict, image_refusal="the image part did not load (X)")
    with pytest.raises(JobError) as err:
        failed.prepare(_item(job))
    assert (err.value.code, err.value.field, err.value.message) == (
        "unavailable",
        "image",
        "the image part did not load (X)",
    )
    assert not isinstance(
        QATask(task.engine, task._responder, policy=strict).prepare(_item(QAJob(id="words", question=QUESTION))),
        Sequence,
    )  # the same job without its image abstains


def test_an_image_that_overflows_the_context_window_is_blamed(task: QATask, built: dict[str, Any]) -> None:
    text = len(task.engine.prompter.ids(QUESTION, None))
    cfg = variant(task.engine.cfg, max_context_tokens=text + IMAGE_TOKENS // 2)
    engine = TextEngine.load(built["checkpoint"], cfg, warm=False)
    job = QAJob(id="long", question=QUESTION, image=ImageRef(path="part_b.png"))
    with pytest.raises(JobError) as err:
        job_sequence(engine, job, images=task.images)
    assert (err.value.code, err.value.field) == ("prompt_too_long", "image")
    assert f"{IMAGE_TOKENS} of them the image's" in err.value.message


class _Found:
    """Retrieval that finds the same passages for any question: what is under test is
    how many of them the prompt holds, not the search."""

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages

    def search(self, collection: str, question: str, top_k: int) -> tuple[list[Passage], dict[str, float]]:
        return list(self.passages[:top_k]), {"embed": 0.0, "search": 0.0}


def test_passages_are_fitted_beside_the_image(task: QATask, built: dict[str, Any]) -> None:
    """A job with an image and a collection whose passages all fit the window beside its
    question, but not beside its image's rows too: the passages that do not fit are
    dropped and the job answered, not refused as prompt_too_long; refused only where
    the question and the image do not fit with no passage at all."""
    prompter = task.engine.prompter
    text = "The infusion pump's battery lasts eight hours on a full charge; charge it overnight."
    passages = [Passage(f"leaflet-{i}", 1.0, text, "Pump") for i in range(2)]

    def length(n: int) -> int:  # the job's prompt with its image and the first n passages
        return len(prompter.ids(QUESTION, context_with(None, passages[:n]), images=1)) - 1 + IMAGE_TOKENS

    def task_with(window: int) -> QATask:
        engine = TextEngine.load(built["checkpoint"], variant(task.engine.cfg, max_context_tokens=window), warm=False)
        return QATask(engine, task._responder, cast(Retrieval, _Found(passages)), images=task.images)

    job = QAJob(
        id="fit", question=QUESTION, image=ImageRef(path="part_b.png"), collection="pump", max_new_tokens=1
    )  # fmt: skip
    # Both passages and the image leave no position to answer in; counted without the
    # image's rows, both would fit; one passage does fit beside them.
    window = length(2)
    assert len(prompter.ids(QUESTION, context_with(None, passages))) + 1 <= window
    assert length(1) + 1 <= window
    fitting = task_with(window)
    seq = fitting.prepare(_item(job))
    assert isinstance(seq, Sequence)
    assert len(seq.prompt) == length(1)
    out = fitting.output(fitting.engine.batcher.single(seq, "fit"))
    assert out["passages_dropped"] == 1
    assert out["image_tokens"] == IMAGE_TOKENS and out["prompt_tokens"] == length(1)
    # With no passage, the question and the image alone are one position too long.
    with pytest.raises(JobError) as err:
        task_with(length(0)).prepare(_item(job))
    assert (err.value.code, err.value.field) == ("prompt_too_long", "image")


def _harness(task: QATask) -> tuple[PriorityDeadlineQueue, TextWorker, dict[str, Outcome], threading.Condition]:
    queue = PriorityDeadlineQueue(16)
    ledger = MemoryLedger(2**34)
    assert ledger.add_model("llm", "text", task.engine.kv_cache_bytes)
    got: dict[str, Outcome] = {}
    cond = threading.Condition()

    def complete(item: WorkItem, outcome: Outcome) -> None:
        with cond:
            got[item.job.id] = outcome
            cond.notify_all()

    worker = TextWorker("text", queue, task, task.engine.batcher, TextMemory(ledger, "llm", 0.05), complete)
    return queue, worker, got, cond


def test_an_image_is_made_into_rows_only_once_its_job_is_admitted(
    task: QATask, built: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every KV row taken: image jobs wait in the queue holding no rows of their image
    (the tower has not run for them); once rows are free they are admitted and their
    images made into rows then. An image that can no longer be read by then (its file
    overwritten while its job waited) fails its own job with an error naming its field;
    the others complete."""
    assert task.images is not None
    vlm = task.images._manager.get(task.images.name).vlm
    encoded: list[int] = []
    features = vlm.features

    def counted(image: Any) -> Any:
        encoded.append(1)
        return features(image)

    monkeypatch.setattr(vlm, "features", counted)
    changing = built["media"] / "part_changing.png"
    changing.write_bytes(_png(random_image(60, 50, seed=13)))
    kv = task.engine.batcher.kv
    blockers: list[KVSlot] = []
    while (slot := kv.allocate_slots(f"blocker-{len(blockers)}", 1)) is not None:
        blockers.append(slot)
    queue, worker, got, cond = _harness(task)
    items = {
        name: _item(QAJob(id=name, question=QUESTION, image=ImageRef(path=path), max_new_tokens=4))
        for name, path in (("img-ok", "part_b.png"), ("img-changed", "part_changing.png"))
    }
    items["text"] = _item(QAJob(id="text", question=QUESTION, max_new_tokens=4))
    try:
        worker.start()
        for item in items.values():
            queue.put(item)
        deadline = time.monotonic() + 60
        # Each has been prepared (its prompt made, its image counted) and waits for KV.
        while not all(isinstance(item.progress, Sequence) for item in items.values()):
            assert time.monotonic() < deadline, {n: i.progress for n, i in items.items()}
            time.sleep(0.01)
        waiting = {name: item.progress for name, item in items.items()}
        assert all(isinstance(seq, Sequence) and not seq.splices for seq in waiting.values()), waiting
        assert not encoded  # the tower has not run for a job without its KV
        # Its image's positions are in its prompt (and its KV reservation) before its rows exist.
        with_token = task.engine.prompter.ids(QUESTION, None, images=1)
        assert len(cast(Sequence, waiting["img-ok"]).prompt) == len(with_token) - 1 + IMAGE_TOKENS
        changing.write_bytes(b"not an image any more")
        for slot in blockers:
            kv.free(slot)
        blockers = []
        with cond:
            assert cond.wait_for(lambda: len(got) == len(items), 120), got.keys()
    finally:
        for slot in blockers:
            kv.free(slot)
        worker.stop(30)
        changing.unlink(missing_ok=True)
    assert got["text"].error is None and got["img-ok"].error is None, got
    assert got["img-ok"].output is not None and got["img-ok"].output["image_tokens"] == IMAGE_TOKENS
    error = got["img-changed"].error
    assert error is not None and (error.code, error.field) == ("image_invalid", "image.path"), error
    assert len(encoded) == 1  # the good image's, once admitted
    stages = ["tokenize", "image_decode", "image_encode", "prefill", "decode", "detokenize"]
    assert list(items["img-ok"].stages) == stages  # decoded and encoded once admitted


def test_a_paused_question_drops_its_image_rows_with_its_kv(task: QATask) -> None:
    """A pause gives back the sequence's KV and its image's rows with it; they are made
    again when it is admitted again, and it answers as it would have."""
    job = QAJob(id="pause", question=QUESTION, image=ImageRef(path="part_b.png"), max_new_tokens=NEW_TOKENS)
    alone = task.engine.batcher.single(job_sequence(task.engine, job, images=task.images), "alone")
    seq = task.prepare(_item(job))
    assert isinstance(seq, Sequence) and not seq.splices
    batcher = task.engine.batcher
    slot = batcher.kv.allocate_slots("pause", task.kv_tokens(seq))
    assert slot is not None
    batcher.admit(seq, slot)
    assert sum(int(s.rows.shape[0]) for s in seq.splices) == IMAGE_TOKENS
    batcher.step()
    given = batcher.pause(seq, keep=False)
    assert given is slot and not seq.splices
    batcher.kv.free(slot)
    slot = batcher.kv.allocate_slots("pause", task.kv_tokens(seq))
    assert slot is not None
    try:
        batcher.admit(seq, slot)
        assert seq.splices
        while seq.finish is None:
            batcher.step()
    finally:
        batcher.kv.free(slot)
    assert seq.tokens == alone.tokens


def test_a_text_question_to_a_vision_language_model_is_prompted_as_its_processor_does(
    task: QATask, built: dict[str, Any]
) -> None:
    """LLaVA's template writes a message's typed text parts only: a question without an
    image is given to it as such a part, or it would never reach the model."""
    processor = built["processor"]
    system = task.engine.prompter.system_prompt
    messages = [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = processor(text=text, return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
    assert task.engine.prompter.ids(QUESTION, None) == theirs


LLAVA_15 = ImagePrep(True, 336, 0, 0, 3, 336, 336, 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), pad_to_square=True)
LLAVA_NEXT = ImagePrep(True, 336, 0, 0, 3, 336, 336, 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@pytest.mark.parametrize(
    ("prep", "pinpoints", "size"),
    [
        (LLAVA_15, (), (1200, 900)),
        (LLAVA_15, (), (300, 2000)),
        (LLAVA_NEXT, PINPOINTS, (1200, 900)),
        (LLAVA_NEXT, PINPOINTS, (300, 2000)),
    ],
    ids=["llava-photo", "llava-strip", "next-photo", "next-strip"],
)
def test_what_a_job_reserves_covers_what_preprocessing_takes(
    prep: ImagePrep, pinpoints: tuple[tuple[int, int], ...], size: tuple[int, int]
) -> None:
    """prepare_cost, counted from prepare's steps, against the resident memory prepare
    takes at most (measured) for LLaVA-1.5's and LLaVA-NeXT's preprocessing of a photo
    and of a strip."""
    pixels = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
    prepare(pixels, prep, pinpoints)  # once first: what its first run loads is no image's
    measured = host_working_bytes(partial(prepare, pixels, prep, pinpoints))
    cost = prepare_cost(size, prep, pinpoints)
    assert measured <= cost.held_bytes, (measured, cost)
    assert cost.largest_pixels >= size[0] * size[1]


@pytest.mark.integration
@pytest.mark.slow
def test_a_pipeline_job_asks_the_vision_language_model_about_its_part(
    built: dict[str, Any], engine_dir: Path, broker: Broker, requester: Requester
) -> None:
    """An inspect job with `ocr` and `ask` on a box whose text model sees images: the
    question is answered from the part's image, with the verdict and the label's text in
    its prompt, as the pipeline words them for any text model."""
    from tests.conftest import LABELS

    directory = built["root"] / "pipeline"
    directory.mkdir()
    # The session's engines (the inspection student is built there) and this model's build.
    # A window for the label's text too (this tokenizer, trained on a few sentences, takes many tokens).
    qa = {**built["models"]["qa"], "max_context_tokens": 512}
    models = {"qa": qa, "ocr": {"threads": 1}, "inspect": {"build_size": "quick", "threads": 1}}
    profile = write_profile(directory, broker.port, engine_dir, device_id="v2", models=models)
    res = edgectl("build", "--profile", str(profile), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    d = start_daemon(profile)
    try:
        d.wait_ready(300)
        lab = LABELS[1]
        ask = {"question": "Write the rework note for this part.", "max_new_tokens": NEW_TOKENS}
        job = {"image": {"path": f"labels/{lab['name']}"}, "ask": ask}
        read = requester.send("edge/v2/jobs/inspect", {"id": "pipe-ocr", **job, "ocr": True})
        unread = requester.send("edge/v2/jobs/inspect", {"id": "pipe-plain", **job})
        result, plain = requester.wait(read, 180), requester.wait(unread, 180)
    finally:
        d.stop()
    assert result["status"] == plain["status"] == "ok", (result, plain)
    out = result["output"]
    assert [line["text"] for line in out["ocr"]["lines"]] == lab["lines"]
    answer = out["answer"]
    assert answer["image_tokens"] == IMAGE_TOKENS and answer["completion_tokens"] > 0
    vision = [f"inspect.{s}" for s in ("decode", "preprocess", "model", "postprocess")]
    text = ["tokenize", "image_decode", "image_encode", "prefill", "decode", "detokenize"]
    assert list(result["timings"]["stages"]) == ["queued", *vision, *text]
    # The label's text is in the prompt beside the image: longer than without it.
    assert answer["prompt_tokens"] > plain["output"]["answer"]["prompt_tokens"]
    assert plain["output"]["answer"]["image_tokens"] == IMAGE_TOKENS


def test_edgectl_submit_sends_a_questions_image() -> None:
    from edge.cli import _job_from_args, build_parser

    args = build_parser().parse_args(["submit", "qa", "--question", QUESTION, "--media-path", "part_b.png"])
    assert _job_from_args(args)["image"] == {"path": "part_b.png"}
    assert "image" not in _job_from_args(build_parser().parse_args(["submit", "qa", "--question", QUESTION]))
