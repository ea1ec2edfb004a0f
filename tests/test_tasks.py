"""Task handlers built in-process, with real models, real images and a real ledger, and
no broker: what the branch workers call."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest

from edge.config.backends import OnnxRuntimeConfig
from edge.config.text import QAModelConfig
from edge.config.vision import InspectModelConfig, OCRModelConfig
from edge.memory import HostProbe
from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import ImageLimits
from edge.protocol.jobs import ImageRef, InspectJob, OCRJob, ParsedJob, QAJob
from edge.scheduler.ledger import MemoryLedger
from edge.scheduler.models import ModelManager
from edge.scheduler.work import Reply, WorkItem
from edge.tasks.inspect import INSPECT_MODEL, start_inspect
from edge.tasks.media import MediaLoader
from edge.tasks.ocr import OCR_MODEL, start_ocr
from edge.tasks.qa import start_qa
from edge.text.runtime.continuous import Sequence
from tests import fakes
from tests.conftest import LABELS, SAMPLES

MIB = 2**20


def _item(job: OCRJob | InspectJob | QAJob, task: str) -> WorkItem:
    return WorkItem(ParsedJob(job.id, task, 5, None, job), Reply("r"), time.monotonic())  # type: ignore[arg-type]


def _media() -> MediaLoader:
    return MediaLoader(ImageLimits(6 * MIB, 4_000_000), SAMPLES)


@pytest.fixture(scope="module")
def manager() -> ModelManager:
    ledger = MemoryLedger(8192 * MIB, 256 * MIB)
    mm = ModelManager(ledger, HostProbe())
    assert ledger.add_model("runtime", "daemon", HostProbe().used_bytes(), float("inf"))
    return mm


def test_ocr_task_reads_labels_and_fails_a_bad_image_alone(manager: ModelManager) -> None:
    ocr = start_ocr(OCRModelConfig(threads=1, backend=OnnxRuntimeConfig()), manager, _media())
    assert manager.loaded(OCR_MODEL) and manager.ledger.snapshot()["models"][OCR_MODEL]["bytes"] > 0
    good = OCRJob(id="o1", image=ImageRef(path=f"labels/{LABELS[1]['name']}"))
    bad = OCRJob(id="o2", image=ImageRef(data=base64.b64encode(b"not a png").decode()))
    good_item, bad_item = _item(good, "ocr"), _item(bad, "ocr")
    t0 = time.perf_counter()
    out_good = ocr.run([good_item])[0]
    took = (time.perf_counter() - t0) * 1000.0
    out_bad = ocr.run([bad_item])[0]
    assert isinstance(out_good, dict) and [line["text"] for line in out_good["lines"]] == LABELS[1]["lines"]
    assert isinstance(out_bad, JobError) and out_bad.field == "image.data"
    # Where the time went: every stage, in order, within the call and most of it.
    assert list(good_item.stages) == ["decode", "preprocess", "model", "postprocess"]
    assert all(ms > 0 for ms in good_item.stages.values())
    assert 0.8 * took <= sum(good_item.stages.values()) <= took
    assert list(bad_item.stages) == ["decode"]  # it failed there
    assert manager.ledger.snapshot()["reserved_bytes"] == 0  # each job's buffers given back


def test_inspect_task_batches_reads_labels_and_splits_under_a_squeeze(engine_dir: Path) -> None:
    from engines.vision.vision_build import build_student

    student = build_student(engine_dir, "quick", progress=False)
    probe = HostProbe()
    ledger = MemoryLedger(8192 * MIB, 0)
    manager = ModelManager(ledger, probe)
    ocr = start_ocr(OCRModelConfig(threads=1), manager, _media())
    cfg = InspectModelConfig(threads=1, max_batch=4)
    task = start_inspect(cfg, student, manager, _media(), ocr)
    parts = sorted(p.name for p in (SAMPLES / "parts").glob("*.png"))
    jobs = [InspectJob(id=f"i{i}", image=ImageRef(path=f"parts/{parts[i % len(parts)]}")) for i in range(4)]
    jobs.append(InspectJob(id="lab", image=ImageRef(path=f"labels/{LABELS[0]['name']}"), ocr=True))
    items = [_item(j, "inspect") for j in jobs]
    out = task.run(items)
    assert all(isinstance(o, dict) and o["batch_size"] == 5 for o in out)
    last = out[-1]
    assert isinstance(last, dict) and [line["text"] for line in last["ocr"]["lines"]] == LABELS[0]["lines"]
    # The batch's model time is every job's; the label's OCR adds to the one that asked.
    assert all(list(it.stages) == ["decode", "preprocess", "model", "postprocess"] for it in items)
    plain = [it.stages["model"] for it in items[:4]]
    assert max(plain) == min(plain) > 0
    assert items[-1].stages["model"] > plain[0] and items[-1].stages["postprocess"] > items[0].stages["postprocess"]
    # A budget that holds the models and two jobs' buffers: the batch runs in parts.
    pipeline = manager.get(INSPECT_MODEL)
    two = task.batch_need(2, pipeline)
    assert ledger.lower_budget(ledger.used_bytes() + two + two // 4)
    before = task.split_batches
    out = task.run([_item(j, "inspect") for j in jobs[:4]])
    assert [o["batch_size"] for o in out if isinstance(o, dict)] == [2, 2, 2, 2]
    assert task.split_batches == before + 1 and ledger.snapshot()["reserved_bytes"] == 0


def test_qa_task_streams_pieces_through_the_responder(engine_dir: Path, tmp_path: Path) -> None:
    from engines.text.text_build import build_text_engine

    checkpoint = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    responder, link, _journal = fakes.responder(tmp_path)
    manager = ModelManager(MemoryLedger(8192 * MIB, 0), HostProbe())
    cfg = QAModelConfig(max_context_tokens=256, max_new_tokens=16, max_sequences=1)
    task = start_qa(cfg, checkpoint, manager, responder)
    assert manager.models()[0].backend == "torch-cpu cpu-f32"  # the device and the INT4 kernel
    item = _item(QAJob(id="s1", question="Is 38.5 C a fever?", max_new_tokens=16, stream=True), "qa")
    prepared = task.prepare(item)
    assert isinstance(prepared, Sequence)  # no collection, none required: generated
    seq = task.engine.batcher.single(prepared, "s1")
    output = task.output(seq)
    pieces = [m.doc for m in link.sent]
    assert pieces and all(p["status"] == "partial" and p["id"] == "s1" for p in pieces)
    assert [p["seq"] for p in pieces] == list(range(len(pieces)))
    assert "".join(p["delta"] for p in pieces) == output["answer"] and output["completion_tokens"] > 0
    assert task.kv_tokens(seq) == len(seq.prompt) + 16
    # The stages and token latencies go onto the job's item, for its result.
    assert list(item.stages) == ["tokenize", "prefill", "decode", "detokenize"]
    assert item.stages["prefill"] == seq.prefill_ms > 0 and item.stages["detokenize"] > 0
    assert item.stages["decode"] == pytest.approx(seq.decode_s * 1000 - seq.detokenize_ms)
    gaps = [(b - a) * 1000 for a, b in zip(seq.token_times, seq.token_times[1:], strict=False)]
    assert item.latency["ttft_ms"] == pytest.approx((seq.token_times[0] - item.received_at) * 1000)
    assert item.latency["ttft_ms"] >= item.stages["prefill"]
    assert min(gaps) <= item.latency["token_p50_ms"] <= item.latency["token_p99_ms"] <= max(gaps)
    assert len(seq.token_times) == len(seq.tokens)
    assert "drafted_tokens" not in item.latency  # speculation off (the default): no draft figures


def test_qa_task_with_speculative_decoding_reports_its_drafts(engine_dir: Path, tmp_path: Path) -> None:
    """models.qa.speculative reaches the batcher through the engine, and the job's
    timings carry its drafts, in the result schema's shape."""
    import json

    import jsonschema

    from edge.protocol import results
    from engines.text.text_build import build_text_engine
    from tests.conftest import REPO

    checkpoint = build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)
    responder, _link, _journal = fakes.responder(tmp_path)
    manager = ModelManager(MemoryLedger(8192 * MIB, 0), HostProbe())
    cfg = QAModelConfig(max_context_tokens=512, max_sequences=1, speculative="prompt-lookup", speculative_tokens=3)
    task = start_qa(cfg, checkpoint, manager, responder)
    assert task.engine.batcher.speculative_tokens == 3
    assert task.engine.config()["speculative"] == "prompt-lookup"
    leaflet = (SAMPLES / "leaflets" / "pump.md").read_text()
    job = QAJob(id="d1", question="How long does the pump battery last?", context=leaflet, max_new_tokens=32)
    item = _item(job, "qa")
    prepared = task.prepare(item)
    assert isinstance(prepared, Sequence)
    seq = task.engine.batcher.single(prepared, "d1")
    output = task.output(seq)
    assert item.latency["drafted_tokens"] == seq.drafted > 0
    assert item.latency["accepted_tokens"] == seq.accepted
    assert 0 <= seq.accepted <= seq.drafted
    timings = results.Timings(0.0, 1.0, 1.0, item.stages, item.latency)
    doc = results.ok_result("d1", "qa", "t", output, timings)
    schema = json.loads((REPO / "docs" / "schemas" / "result.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_a_job_that_cannot_fit_is_over_budget_with_figures(manager: ModelManager) -> None:
    with pytest.raises(JobError) as err:
        manager.reserve("huge", "ocr", 10**13, {OCR_MODEL}, "runtime")
    assert err.value.code == ErrorCode.OVER_BUDGET and "usable" in err.value.message


def test_camera_frames_decoded_at_a_reduced_scale_get_the_full_frames_verdict(engine_dir: Path, tmp_path: Path) -> None:
    import cv2

    from engines.vision.vision_build import build_student

    student = build_student(engine_dir, "quick", progress=False)
    names = sorted(p.stem for p in (SAMPLES / "parts").glob("*.png"))
    for name in names:  # each part as a 5 MP camera frame
        part = cv2.imread(str(SAMPLES / "parts" / f"{name}.png"))
        assert part is not None
        frame = cv2.resize(part, (2448, 2048))
        assert cv2.imwrite(str(tmp_path / f"{name}.jpg"), frame, [cv2.IMWRITE_JPEG_QUALITY, 90])
    media = MediaLoader(ImageLimits(6 * MIB, 5_100_000), tmp_path)
    manager = ModelManager(MemoryLedger(8192 * MIB, 0), HostProbe())
    task = start_inspect(InspectModelConfig(threads=1, max_batch=8), student, manager, media, None)
    jobs = [InspectJob(id=n, image=ImageRef(path=f"{n}.jpg")) for n in names]
    out = task.run([_item(j, "inspect") for j in jobs])
    full = manager.get(INSPECT_MODEL).run([media.load(j.image) for j in jobs], bgr=True)
    for got, ref in zip(out, full, strict=True):
        assert isinstance(got, dict) and got["image"] == {"width": 2448, "height": 2048}
        assert got["class"] == ref.label
        assert max(abs(got["probabilities"][c] - p) for c, p in ref.probabilities.items()) < 0.02
