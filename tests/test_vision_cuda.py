"""The student on torch-cuda: images resized and normalised on the GPU give what the
host-side preprocessing gives, in any mix of sizes within one batch; a batch's device
working memory is measured at warm-up."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge.backends import BackendOptions, get_backend
from edge.config.backends import TorchCudaConfig
from edge.vision.inspect import InspectPipeline, preprocess
from edge.vision.student import INPUT, StudentArtifact
from engines.vision.factory_data import make_sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # EDGE_TEST_STUDENT_DIR: a built student's directory (config.json, student.pt,
    # manifest.json). Otherwise one with random weights: these tests compare two paths
    # through the same weights, which need not be trained ones.
    given = os.environ.get("EDGE_TEST_STUDENT_DIR")
    if given:
        return Path(given)
    from engines.vision.random_student import write_random_student

    return write_random_student(tmp_path_factory.mktemp("engines") / "student")


def _images() -> list[np.ndarray]:
    base = [make_sample(11, "test", i).image for i in range(4)]
    big = np.ascontiguousarray(np.kron(base[1], np.ones((2, 2, 1), np.uint8)))  # 448 x 448: shrunk on the GPU
    wide = np.ascontiguousarray(np.repeat(base[2], 2, axis=1))  # 224 x 448
    return [base[0], big, base[3], wide, base[1]]


def _options() -> BackendOptions:
    return BackendOptions(max_batch=8, config=TorchCudaConfig())


def test_stages_are_timed_on_the_gpus_clock(student: Path) -> None:
    """A GPU session times its own stages with CUDA events: a session that takes images
    reports its upload and resize as "preprocess", both within the host's wall time."""
    import time

    from edge.timing import StageClock

    session = get_backend("torch-cuda").load(StudentArtifact.open(student).source(), _options())
    images = _images()
    session.run_images(images)  # warm: the graphs are captured on first use
    clock = StageClock()
    t0 = time.perf_counter()
    got = session.run_images_staged(images, clock)
    wall_ms = (time.perf_counter() - t0) * 1000.0
    assert sorted(clock.ms) == ["model", "preprocess"]
    assert all(ms > 0.0 for ms in clock.ms.values())
    assert sum(clock.ms.values()) <= wall_ms
    for g, r in zip(got, session.run_images(images), strict=True):
        np.testing.assert_array_equal(g, r)
    tensor = {INPUT: preprocess(images, 224)}
    clock = StageClock()
    t0 = time.perf_counter()
    session.run_staged(tensor, clock)
    assert list(clock.ms) == ["model"] and 0.0 < clock.ms["model"] <= (time.perf_counter() - t0) * 1000.0


def test_gpu_preprocessing_matches_the_host_path(student: Path) -> None:
    session = get_backend("torch-cuda").load(StudentArtifact.open(student).source(), _options())
    assert session.accepts_images and session.device.startswith("cuda")
    images = _images()
    got = session.run_images(images)
    ref = session.run({INPUT: preprocess(images, 224)})
    for g, r in zip(got, ref, strict=True):
        assert g.shape[0] == len(images)
        # Same-size images: identical inputs, so FP16 rounding only. Shrunk ones: the
        # GPU's antialiased bilinear filter against the host's area filter.
        np.testing.assert_allclose(g[[0, 2, 4]], r[[0, 2, 4]], atol=2e-3)
        np.testing.assert_allclose(g[[1, 3]], r[[1, 3]], atol=5e-2)
    # Each image lands in its own slot: a batch of mixed shapes agrees with one at a time.
    alone = [session.run_images([img]) for img in images]
    for i in range(len(images)):
        np.testing.assert_allclose(got[0][i], alone[i][0][0], atol=2e-3)


def test_pipeline_on_cuda_labels_as_on_the_host_and_measures_its_batches(student: Path) -> None:
    cuda = InspectPipeline.load(student, "torch-cuda", _options())
    images = [make_sample(12, "test", i).image for i in range(8)]
    found = cuda.run(images)
    probs = cuda.session.run({INPUT: preprocess(images, 224)})[0]
    assert [f.label for f in found] == [cuda.classes[int(np.argmax(p))] for p in probs]
    # Measured at warm-up for every size it ran, growing with the batch; what a batch
    # between two sizes reserves is the larger size's figure.
    sizes = sorted(cuda.device_batch_bytes)
    assert sizes == [1, 2, 4, 8]
    assert all(cuda.device_batch_bytes[n] > 0 for n in sizes)
    assert cuda.device_batch_bytes[8] > cuda.device_batch_bytes[1]
    assert cuda.device_bytes_for(3) == cuda.device_batch_bytes[4]
    assert not cuda.host_preprocessing
