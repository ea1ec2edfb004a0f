"""How the text engine resolves a profile's qa section: the CUDA INT4 kernel it names,
checked against what the box can build (the kernels' availability is the hardware seam
faked here; the GPU tests load them for real)."""

from __future__ import annotations

import pytest

from edge.config.text import QAModelConfig
from edge.text.engine import cuda_kernel
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.triton import triton_int4


def test_auto_leaves_the_kernel_to_the_device() -> None:
    assert cuda_kernel(QAModelConfig(device="cuda")) is None
    # On the CPU the CUDA field is not read (cpu_kernel decides).
    assert cuda_kernel(QAModelConfig(device="cpu", cuda_kernel="triton")) is None


def test_a_named_kernel_is_the_one_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_int4, "available", lambda device="cuda": True)
    monkeypatch.setattr(triton_int4, "TRITON_SUPPORT", True)
    assert cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="cuda-mma")) == "cuda-mma"
    assert cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="triton")) == "triton"
    assert cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="torch")) == "cuda"


def test_a_kernel_the_box_cannot_run_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_int4, "available", lambda device="cuda": False)
    monkeypatch.setattr(triton_int4, "TRITON_SUPPORT", False)
    with pytest.raises(RuntimeError, match="cuda_kernel cuda-mma is not built here"):
        cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="cuda-mma"))
    with pytest.raises(RuntimeError, match="cuda_kernel triton needs Triton"):
        cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="triton"))
    assert cuda_kernel(QAModelConfig(device="cuda", cuda_kernel="torch")) == "cuda"


def test_an_unknown_kernel_is_refused_by_the_schema() -> None:
    with pytest.raises(ValueError, match="cuda_kernel"):
        QAModelConfig.model_validate({"device": "cuda", "cuda_kernel": "cublas"})
