"""The student on torch-cuda: images resized and normalised on the GPU give what the
host-side preprocessing gives, in any mix of sizes within one batch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge.backends import BackendOptions, get_backend
from edge.vision.inspect import InspectPipeline, preprocess
from engines.factory_data import make_sample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # EDGE_TEST_STUDENT_DIR: a built student's directory (config.json, student.pt,
    # manifest.json), e.g. on a GPU host without the teacher's wheel to build one.
    given = os.environ.get("EDGE_TEST_STUDENT_DIR")
    if given:
        return Path(given)
    from engines.vision_build import build_student

    return build_student(tmp_path_factory.mktemp("engines"), "quick", progress=False)


def _images() -> list[np.ndarray]:
    base = [make_sample(11, "test", i).image for i in range(4)]
    big = np.ascontiguousarray(np.kron(base[1], np.ones((2, 2, 1), np.uint8)))  # 448 x 448: shrunk on the GPU
    wide = np.ascontiguousarray(np.repeat(base[2], 2, axis=1))  # 224 x 448
    return [base[0], big, base[3], wide, base[1]]


def test_gpu_preprocessing_matches_the_host_path(student: Path) -> None:
    session = get_backend("torch-cuda").load(student, BackendOptions(max_batch=8))
    assert session.accepts_images
    images = _images()
    got = session.run_images(images, 224)
    ref = session.run({"pixels": preprocess(images, 224)})
    for g, r in zip(got, ref, strict=True):
        assert g.shape[0] == len(images)
        # Same-size images: identical inputs, so FP16 rounding only. Shrunk ones: the
        # GPU's antialiased bilinear filter against the host's area filter.
        np.testing.assert_allclose(g[[0, 2, 4]], r[[0, 2, 4]], atol=2e-3)
        np.testing.assert_allclose(g[[1, 3]], r[[1, 3]], atol=5e-2)
    # Each image lands in its own slot: a batch of mixed shapes agrees with one at a time.
    alone = [session.run_images([img], 224) for img in images]
    for i in range(len(images)):
        np.testing.assert_allclose(got[0][i], alone[i][0][0], atol=2e-3)


def test_pipeline_on_cuda_labels_as_on_the_host(student: Path) -> None:
    cuda = InspectPipeline.load(student, "torch-cuda", BackendOptions(max_batch=8))
    images = [make_sample(12, "test", i).image for i in range(8)]
    found = cuda.run(images)
    probs = cuda.session.run({"pixels": preprocess(images, 224)})[0]
    assert [f.label for f in found] == [cuda.classes[int(np.argmax(p))] for p in probs]
