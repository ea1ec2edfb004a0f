"""Vision branch: synthetic data, the teacher's tokens, the student's export, the
inspect pipeline and the dynamic batcher."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge.backends import BackendOptions
from edge.protocol.jobs import JobLimits, parse_job
from edge.scheduler.queue import BatchPolicy, PriorityDeadlineQueue
from edge.scheduler.work import Reply, WorkItem
from edge.vision.inspect import InspectPipeline, preprocess
from edge.vision.vit import ExportWrapper, InspectViT, ViTConfig, load_student
from engines.cache import existing_only
from engines.vision.factory_data import CLASSES, make_sample, patch_targets
from engines.vision.shipped_student import SHIPPED
from engines.vision.vision_build import ONNX_OUTPUTS, SIZES, build_student
from engines.vision.vision_teacher import (
    TEACHER_DIM,
    TOKENS_OUTPUT,
    normalise,
    pool_patches,
    probe_features,
    teacher_tokens,
    token_model_bytes,
    torch_teacher,
)
from tests.conftest import SAMPLES, edgectl, write_profile

LIMITS = JobLimits(max_payload_bytes=1 << 20, max_prompt_chars=1000, max_new_tokens_limit=64)


def test_generator_is_reproducible_and_splits_differ() -> None:
    a, b = make_sample(7, "train", 3), make_sample(7, "train", 3)
    assert np.array_equal(a.image, b.image) and a.serial == b.serial and a.label == b.label
    other = make_sample(7, "test", 3)
    assert not np.array_equal(a.image, other.image)
    labels = [make_sample(0, "val", i).label for i in range(2 * len(CLASSES))]
    assert sorted(set(labels)) == list(range(len(CLASSES))) and labels.count(0) == 2


@pytest.mark.parametrize("index", range(len(CLASSES)))
def test_defect_masks_mark_the_defect(index: int) -> None:
    sample = make_sample(1, "train", index)
    assert sample.image.shape == (224, 224, 3) and sample.image.dtype == np.uint8
    if CLASSES[sample.label] == "clean":
        assert not sample.mask.any()
    else:
        assert sample.mask.sum() >= 20, CLASSES[sample.label]
        targets = patch_targets(sample.mask, 14)
        assert targets.shape == (14, 14) and targets.max() > 0


def test_teacher_tokens_shapes() -> None:
    images = np.stack([make_sample(0, "val", i).image for i in range(2)])
    cls, patches = teacher_tokens(images, grid=14, batch=2, progress=False)
    assert cls.shape == (2, TEACHER_DIM) and patches.shape == (2, 196, TEACHER_DIM)
    assert np.isfinite(cls).all() and float(np.abs(cls).max()) > 0
    # Pooling a constant grid keeps the constant; it is an average, not a resample.
    const = np.ones((1, 256, 4), np.float32) * 3.0
    assert np.allclose(pool_patches(const, 14), 3.0)


def test_torch_teacher_gives_the_onnx_teachers_tokens() -> None:
    """The teacher rebuilt in PyTorch from the ONNX file's weights (for GPU-side token
    making) gives the same backbone tokens as the shipped graph on onnxruntime."""
    import onnxruntime as ort

    images = np.stack([make_sample(5, "test", i).image for i in range(3)])
    pixels = normalise(images)
    session = ort.InferenceSession(token_model_bytes(), providers=["CPUExecutionProvider"])
    (ref,) = session.run([TOKENS_OUTPUT], {"input_image": pixels})
    teacher = torch_teacher()
    with torch.inference_mode():
        got = teacher.tokens(torch.from_numpy(pixels)).numpy()
    assert got.shape == ref.shape == (3, 257, TEACHER_DIM)
    np.testing.assert_allclose(got, ref, atol=1e-3)


@pytest.fixture(scope="module")
def student(engine_dir: Path) -> Path:
    return build_student(engine_dir, "quick", progress=False)


def test_student_is_vit_tiny_sized_and_exported(student: Path) -> None:
    manifest = json.loads((student / "manifest.json").read_text())
    assert 5.0e6 <= manifest["parameters"] <= 6.0e6
    assert manifest["onnx_max_abs_diff"] < 1e-4
    quick = SIZES["quick"]
    assert manifest["inputs"]["data"]["counts"] == {"train": quick.train, "val": quick.val, "test": quick.test}
    assert manifest["inputs"]["recipe"]["epochs"] == quick.epochs


def test_onnx_matches_torch_at_any_batch(student: Path) -> None:
    """The dynamic batch axis: batches the export never saw agree with PyTorch."""
    import onnxruntime as ort

    model = ExportWrapper(load_student(student)).eval()
    session = ort.InferenceSession(str(student / "student.onnx"), providers=["CPUExecutionProvider"])
    images = [make_sample(3, "test", i).image for i in range(5)]
    pixels = preprocess(images, 224)
    got = session.run(list(ONNX_OUTPUTS), {"pixels": pixels})
    with torch.inference_mode():
        ref = [t.numpy() for t in model(torch.from_numpy(pixels))]
    for g, r in zip(got, ref, strict=True):
        assert g.shape[0] == 5
        np.testing.assert_allclose(g, r, atol=1e-4)


def test_pipeline_answers_each_image(student: Path) -> None:
    pipeline = InspectPipeline.load(student, "onnxruntime", BackendOptions(threads=1))
    # Different sizes in one batch: each is resized to the model's input.
    images = [make_sample(4, "test", 0).image, np.zeros((300, 500, 3), np.uint8), np.full((64, 64, 3), 200, np.uint8)]
    found = pipeline.run(images)
    assert len(found) == 3
    for f in found:
        assert f.label in CLASSES and 0.0 <= f.score <= 1.0
        assert abs(sum(f.probabilities.values()) - 1.0) < 1e-4
        assert f.score == max(f.probabilities.values())
        assert len(f.heatmap) == 14 and all(len(row) == 14 for row in f.heatmap)
        doc = f.to_dict(heatmap=False)
        assert "heatmap" not in doc and doc["defect"] == (f.label != "clean")
    assert pipeline.run([]) == []


def test_inspect_job_schema() -> None:
    job = parse_job({"id": "a", "image": {"path": "x.png"}, "heatmap": True}, "inspect", LIMITS)
    assert job.task == "inspect"
    from edge.protocol.errors import JobError

    with pytest.raises(JobError) as err:
        parse_job({"id": "a", "image": {"path": "x.png"}, "heatmap": "yes"}, "inspect", LIMITS)
    assert err.value.field == "heatmap"


def _item(task: str, job_id: str, priority: int = 5) -> WorkItem:
    payload = {"id": job_id, "image": {"path": "x.png"}, "priority": priority}
    if task == "qa":
        payload = {"id": job_id, "question": "q?", "priority": priority}
    return WorkItem(parse_job(payload, task, LIMITS), Reply("r"))


def test_batch_fills_up_and_leaves_other_tasks_queued() -> None:
    q = PriorityDeadlineQueue(100)
    for i in range(5):
        q.put(_item("inspect", f"i{i}"))
    q.put(_item("ocr", "o1"))
    q.put(_item("inspect", "urgent", priority=0))
    first = q.get(timeout=0.1)
    assert first is not None and first.job.id == "urgent"
    batch = q.take_batch(first, BatchPolicy(4, 1.0), lambda it: it.job.task == "inspect")
    assert [it.job.id for it in batch] == ["urgent", "i0", "i1", "i2"]  # full: no waiting
    rest = q.drain()
    assert [it.job.id for it in rest] == ["i3", "i4", "o1"]


def test_batch_waits_at_most_the_queue_delay() -> None:
    q = PriorityDeadlineQueue(100)
    first = _item("inspect", "a")
    t0 = time.monotonic()
    batch = q.take_batch(first, BatchPolicy(8, 0.15), lambda it: True)
    waited = time.monotonic() - first.received_at
    assert [it.job.id for it in batch] == ["a"]
    assert 0.13 <= waited < 0.6, waited
    assert time.monotonic() - t0 < 0.6


def test_batch_takes_late_arrivals_within_the_delay() -> None:
    q = PriorityDeadlineQueue(100)
    first = _item("inspect", "a")

    def late() -> None:
        time.sleep(0.05)
        q.put(_item("inspect", "b"))

    threading.Thread(target=late).start()
    batch = q.take_batch(first, BatchPolicy(2, 2.0), lambda it: True)
    assert [it.job.id for it in batch] == ["a", "b"]
    assert time.monotonic() - first.received_at < 1.0  # full at 2: did not sit out the delay


def test_preferred_size_dispatches_without_waiting() -> None:
    q = PriorityDeadlineQueue(100)
    q.put(_item("inspect", "b"))
    first = _item("inspect", "a")
    batch = q.take_batch(first, BatchPolicy(8, 2.0, frozenset({2})), lambda it: True)
    assert len(batch) == 2
    assert time.monotonic() - first.received_at < 1.0


def test_cancel_takes_a_queued_job_out_by_id() -> None:
    q = PriorityDeadlineQueue(10)
    for i in range(3):
        q.put(_item("ocr", f"j{i}", priority=i))
    taken = q.cancel("j1")
    assert taken is not None and taken.job.id == "j1"
    assert q.cancel("j1") is None and q.cancel("nope") is None
    order = [q.get(timeout=0.1), q.get(timeout=0.1)]
    assert [it.job.id for it in order if it is not None] == ["j0", "j2"]  # still in priority order


def test_streaming_teacher_targets_match_the_stored_ones() -> None:
    """On-the-fly teacher targets (torch teacher, pooled on the device) are what the CPU
    build stores (ONNX tokens, pooled, float16) and feeds its probe."""
    from engines.vision.vision_stream import TeacherFeatures, TeacherTargets

    torch.manual_seed(0)
    probe = torch.nn.Linear(2 * TEACHER_DIM, len(CLASSES))
    images = np.stack([make_sample(6, "train", 1000 + i).image for i in range(3)])
    cls, patches = teacher_tokens(images, grid=14, batch=3, progress=False)
    with torch.no_grad():
        ref_logits = probe(probe_features(cls, patches))
    got = TeacherTargets(probe, 14, torch.device("cpu"), torch.float32)(torch.from_numpy(normalise(images)))
    np.testing.assert_allclose(got.cls.numpy(), cls, atol=1e-3)
    np.testing.assert_allclose(got.patches.numpy(), patches.astype(np.float32), atol=2e-2)
    np.testing.assert_allclose(got.logits.numpy(), ref_logits.numpy(), atol=2e-2)
    # The probe's input, as a head trained on streamed images is fitted on it, is the
    # stored probe's input too; from uint8 images directly (TeacherFeatures) as well.
    assert got.features is not None
    np.testing.assert_allclose(got.features.numpy(), probe_features(cls, patches).numpy(), atol=2e-2)
    direct = TeacherFeatures(14, "cpu")(images, batch=2)  # two batches
    np.testing.assert_allclose(direct.numpy(), got.features.numpy(), atol=1e-4)


def test_generated_samples_are_the_generators_own() -> None:
    """Worker processes make exactly what make_sample makes, in index order."""
    from engines.vision.vision_stream import generate

    made = generate(3, "test", range(500, 503), 14, workers=2)
    for k, i in enumerate(range(500, 503)):
        s = make_sample(3, "test", i)
        assert np.array_equal(made["images"][k], s.image) and made["labels"][k] == s.label
        np.testing.assert_array_equal(made["targets"][k], patch_targets(s.mask, 14))


def test_students_on_one_stream_can_take_soft_labels_from_their_own_heads() -> None:
    """Two distilled students on one stream from the same start, each with its teacher
    head: same images, so the same cross-entropy at the first step, but each its own
    soft-label loss; a missing head for one of them is refused."""
    from engines.vision.distill import TrainRecipe
    from engines.vision.vision_stream import StreamPlan, train_students_streaming
    from engines.vision.vision_teacher import teacher_weights

    config = ViTConfig(num_classes=len(CLASSES))
    weights = teacher_weights()
    torch.manual_seed(0)
    head = torch.nn.Linear(2 * TEACHER_DIM, len(CLASSES))
    uniform = torch.nn.Linear(2 * TEACHER_DIM, len(CLASSES))
    with torch.no_grad():
        uniform.weight.zero_()
        uniform.bias.zero_()
    plan = StreamPlan(steps=1, first_index=7000, workers=1)
    recipe = TrainRecipe(batch_size=4)
    with pytest.raises(ValueError, match="one probe per recipe"):
        train_students_streaming(config, [recipe, recipe], plan, head, weights, "cpu", False, probes=[head])
    (_, a), (_, b) = train_students_streaming(
        config, [recipe, recipe], plan, head, weights, "cpu", False, probes=[head, uniform]
    )
    first_a, first_b = a["history"][0], b["history"][0]
    assert first_a["ce"] == pytest.approx(first_b["ce"], rel=1e-5)
    assert first_a["feat"] == pytest.approx(first_b["feat"], rel=1e-5)
    assert abs(first_a["kd"] - first_b["kd"]) > 1e-3


def test_streaming_distillation_trains_on_new_images() -> None:
    """Two steps on four freshly generated images each (worker processes, the torch
    teacher on the same device), a distilled student and the baseline on the same
    stream: every loss term present and finite, the distilled one moved from the
    teacher's selected weights, the baseline from random ones with no teacher terms."""
    from dataclasses import replace

    from engines.vision.distill import TrainRecipe
    from engines.vision.vision_stream import StreamPlan, train_students_streaming
    from engines.vision.vision_teacher import teacher_weights
    from engines.vision.weight_select import init_from_teacher

    config = ViTConfig(num_classes=len(CLASSES))
    weights = teacher_weights()
    start = InspectViT(config)
    with torch.no_grad():
        init_from_teacher(start, weights)
    probe = torch.nn.Linear(2 * TEACHER_DIM, len(CLASSES))
    plan = StreamPlan(steps=2, first_index=5000, workers=1)
    distilled = TrainRecipe(batch_size=4)
    plain = replace(distilled, distill=False, init="random")
    with pytest.raises(ValueError, match="share a batch size"):
        train_students_streaming(config, [distilled, replace(plain, batch_size=8)], plan, probe, weights, "cpu")
    (model, info), (base, base_info) = train_students_streaming(
        config, [distilled, plain], plan, probe, weights, "cpu", False
    )
    assert info["images"] == base_info["images"] == 8 and [h["step"] for h in info["history"]] == [1, 2]
    for entry in info["history"]:
        assert set(entry) == {"step", "ce", "patch", "kd", "feat"} and all(np.isfinite(v) for v in entry.values())
    assert {k for h in base_info["history"] for k in h} == {"step", "ce", "patch"}
    key = "blocks.0.attn.qkv.weight"
    moved = (model.state_dict()[key] - start.state_dict()[key]).abs().max()
    assert 0 < moved < 0.1  # a step or two from the teacher's weights
    assert (base.state_dict()[key] - start.state_dict()[key]).abs().max() > 0.1  # never started there


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_a_long_stream_build_that_is_not_shipped_is_refused_without_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engines.vision import vision_build

    with pytest.raises(vision_build.BuildRefused, match=r"no CUDA device here.*--device cpu"):
        build_student(tmp_path, "stream-long", progress=False)
    assert list(tmp_path.iterdir()) == []  # refused before any data was generated
    # The command says so as a usage error (exit 2), not with a traceback.
    with pytest.raises(SystemExit) as stop:
        vision_build.main(["--engine-dir", str(tmp_path), "--size", "stream-long", "--no-progress"])
    assert stop.value.code == 2 and "no CUDA device here" in capsys.readouterr().err
    # So does `edgectl build` for a profile that asks for it, naming the field.
    models = {"inspect": {"build_size": "stream-long"}, "qa": {"enabled": False}}
    done = edgectl("build", "--profile", str(write_profile(tmp_path, 1883, tmp_path / "engines", models=models)))
    assert done.returncode == 2, done.stderr
    assert "models.inspect.build_size" in done.stderr and "no CUDA device here" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_shipped_stream_student_is_installed_and_judges_held_out_parts(tmp_path: Path) -> None:
    """The accurate student trains on a GPU; a box asking for it is handed the shipped
    weights (float16) as a build of its own: same directory name as a GPU build of the
    same inputs, its accuracy measured at install on the 500 held-out test parts, and the
    five sample parts judged as their truth says, through the ONNX model served on CPUs."""
    import cv2
    import onnxruntime as ort

    from edge.vision.student import StudentArtifact
    from engines.vision.vision_build import SIZES as ALL

    path = build_student(tmp_path, "stream", progress=False)
    shipped = json.loads((SHIPPED / "distilled-stream" / "manifest.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text())
    assert path.name == shipped_name(shipped)
    assert (
        manifest["inputs"] == shipped["inputs"]
        and manifest["installed_from"] == "engines/vision/students/distilled-stream"
    )
    assert manifest["trained_on"] == "cuda" and manifest["train_images"] == ALL["stream"].stream_steps * 128
    assert manifest["test_accuracy"] >= 0.9, manifest["test_accuracy"]  # measured here, on 500 held-out parts
    assert abs(manifest["test_accuracy"] - manifest["test_accuracy_at_training"]) <= 0.01
    assert manifest["onnx_max_abs_diff"] < 1e-4
    artifact = StudentArtifact.open(path)
    parts = json.loads((SAMPLES / "parts" / "parts.json").read_text())
    images = []
    for part in parts:
        image = cv2.imread(str(SAMPLES / "parts" / part["name"]))
        assert image is not None
        images.append(image)
    pixels = preprocess(images, artifact.image_size, bgr=True)  # as the daemon does
    session = ort.InferenceSession(str(path / "student.onnx"), providers=["CPUExecutionProvider"])
    probs = session.run(["class_probs"], {"pixels": pixels})[0]
    assert [artifact.classes[int(i)] for i in probs.argmax(1)] == [p["class"] for p in parts]
    # A second call finds the installed build.
    assert build_student(tmp_path, "stream", progress=False) == path


def shipped_name(manifest: dict[str, Any]) -> str:
    from engines.cache import cache_key

    return f"vision-student-distilled-stream-{cache_key(manifest['inputs'])}"


def test_a_damaged_or_foreign_shipped_student_is_not_used(tmp_path: Path) -> None:
    from engines.vision.shipped_student import ShippedStudentError, find_shipped, load_shipped

    root = tmp_path / "students"
    shutil.copytree(SHIPPED / "distilled-stream", root / "distilled-stream")
    inputs = json.loads((root / "distilled-stream" / "manifest.json").read_text())["inputs"]
    assert find_shipped("stream", True, inputs, root) == root / "distilled-stream"
    assert find_shipped("stream", True, {**inputs, "recipe": {}}, root) is None  # built from other inputs
    assert find_shipped("stream", False, inputs, root) is None  # none shipped
    weights = root / "distilled-stream" / "student.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ShippedStudentError, match="damaged"):
        load_shipped(root / "distilled-stream")


def test_a_stream_size_builds_exports_and_records_its_stream(engine_dir: Path, tmp_path: Path) -> None:
    path = build_student(engine_dir, "quick-stream", progress=False)
    manifest = json.loads((path / "manifest.json").read_text())
    stream = SIZES["quick-stream"]
    assert manifest["inputs"]["stream"] == {"steps": stream.stream_steps, "first_index": stream.train, "seed": 0}
    assert manifest["train_images"] == stream.stream_steps * stream.stream_batch
    assert manifest["onnx_max_abs_diff"] < 1e-4 and 0.0 <= manifest["test_accuracy"] <= 1.0
    assert manifest["trained_on"] == ("cuda" if torch.cuda.is_available() else "cpu")  # device "auto"
    assert {k for h in manifest["history"] for k in h} == {"step", "ce", "patch", "kd", "feat"}
    # The baseline on the same stream: its own build, true labels only (no teacher terms).
    plain = build_student(engine_dir, "quick-stream", distill=False, progress=False)
    assert plain != path and plain.name.startswith("vision-student-plain-quick-stream-")
    plain_manifest = json.loads((plain / "manifest.json").read_text())
    assert not plain_manifest["distilled"] and plain_manifest["train_images"] == manifest["train_images"]
    assert {k for h in plain_manifest["history"] for k in h} == {"step", "ce", "patch"}
    # A build copied to another box's engine directory is found there by its inputs,
    # without the dataset it was trained on.
    shutil.copytree(path, tmp_path / path.name)
    with existing_only():
        assert build_student(tmp_path, "quick-stream", progress=False) == tmp_path / path.name


def _user_folder(root: Path) -> Path:
    """A plant's own folder: clean parts and two defect classes of its own naming, some
    defect images with masks beside them, as PNG and JPEG."""
    import cv2

    names = {"clean": "clean", "scratch": "burr", "stain": "oil"}
    for name in names.values():
        (root / name).mkdir(parents=True)
    made = 0
    for i in range(60):  # 12 of each of the three classes: every class in every split
        sample = make_sample(7, "train", i)
        cls = names.get(CLASSES[sample.label])
        if cls is None:
            continue
        bgr = np.ascontiguousarray(sample.image[:, :, ::-1])
        suffix = ".jpg" if i % 4 == 0 else ".png"
        assert cv2.imwrite(str(root / cls / f"part-{i:03d}{suffix}"), bgr)
        if cls != "clean" and i % 2 == 0:
            assert cv2.imwrite(str(root / cls / f"part-{i:03d}.mask.png"), sample.mask.astype(np.uint8) * 255)
        made += 1
    assert made == 36
    return root


def test_a_users_folder_trains_the_student_and_its_classes_serve(tmp_path: Path) -> None:
    from edge.builds import locate
    from edge.config.loader import load_profile
    from engines.vision.folder_data import scan

    folder = _user_folder(tmp_path / "plant-parts")
    classes, items = scan(folder)
    assert classes == ["burr", "clean", "oil"]
    splits = {s: sum(1 for i in items if i.split == s) for s in ("train", "val", "test")}
    assert all(splits.values()) and splits["train"] > splits["val"] + splits["test"]
    assert scan(folder)[1] == items  # the same folder always splits the same way
    models = {"inspect": {"build_size": "quick", "dataset": str(folder)}, "qa": {"enabled": False}}
    profile = write_profile(tmp_path, 1883, tmp_path / "engines", models=models)
    done = edgectl("build", "--profile", str(profile), timeout=600)
    assert done.returncode == 0, done.stderr
    student = locate(load_profile(profile), "inspect", None)  # what serving finds: this folder's build
    manifest = json.loads((student / "manifest.json").read_text())
    assert manifest["classes"] == classes and manifest["dataset"].startswith(str(folder))
    assert manifest["train_images"] == splits["train"]
    pipeline = InspectPipeline.load(student, "onnxruntime", BackendOptions(threads=1))
    out = pipeline.run([make_sample(7, "test", i).image for i in range(3)])
    assert all(o.label in classes and set(o.probabilities) == set(classes) for o in out)
    # The synthetic profile is not served this student, nor the reverse.
    (tmp_path / "s").mkdir()
    synthetic = write_profile(tmp_path / "s", 1883, tmp_path / "engines", models={"inspect": {"build_size": "quick"}})
    with pytest.raises(Exception, match="no engine for inspect"):
        locate(load_profile(synthetic), "inspect", None)


def test_a_folder_that_cannot_be_a_dataset_is_refused_by_name(tmp_path: Path) -> None:
    from engines.vision.folder_data import DatasetError, scan

    (tmp_path / "burr").mkdir()
    with pytest.raises(DatasetError, match="no 'clean' class folder"):
        scan(tmp_path)
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "a.png").write_bytes(b"")
    with pytest.raises(DatasetError, match="class 'burr' has 0 images"):
        scan(tmp_path)
