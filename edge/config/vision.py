"""The vision branch's model sections: the OCR models and the inspection student."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from edge.config.backends import BACKEND_DEVICES, BackendConfig, OnnxRuntimeConfig, TensorRTConfig, backend_section
from edge.config.base import Device, StrictModel


def _fill_backend(data: Any) -> Any:
    """`backend: NAME` is short for `backend: {type: NAME}`; no backend at all means the
    default for the model's device."""
    if isinstance(data, dict):
        data = dict(data)
        data["backend"] = backend_section(data.get("backend"), str(data.get("device", "cpu")))
    return data


def _backend_on_device(backend: str, device: str) -> None:
    if device not in BACKEND_DEVICES.get(backend, (device,)):
        raise ValueError(f"backend {backend!r} does not run on device {device!r}")


class OCRModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `ocr` task.")
    keep_alive_s: float | None = Field(
        default=None,
        ge=0.0,
        title="Keep-alive",
        description="Seconds the OCR model stays loaded after its last use before it may be evicted to make "
        "room for another job; unset keeps it loaded for good. An evicted model is loaded again (and measured "
        "again) when a job needs it.",
    )
    device: Device = Field(
        default="cpu",
        title="Device",
        description="Where the OCR models run: 'cpu' (onnxruntime's CPU build), or 'cuda' with the tensorrt "
        "backend (FP16 plans built on the box).",
    )
    backend: Annotated[OnnxRuntimeConfig | TensorRTConfig, Field(discriminator="type")] = Field(
        default_factory=OnnxRuntimeConfig,
        title="Backend",
        description="Inference backend for the detection, angle and recognition models, with its own settings "
        "(`onnxruntime`, `tensorrt`, or `{type: NAME, ...}`); for device 'cuda' it is tensorrt.",
    )
    det_limit_side_len: int = Field(
        default=960,
        ge=32,
        le=4096,
        title="Detection size limit",
        description="Longest image side fed to the detector; larger images are scaled "
        "down (never up, which costs time for no gain on labels).",
    )
    use_angle_cls: bool = Field(
        default=True,
        title="Angle classifier",
        description="Run the 0/180 degree text-line classifier before recognition.",
    )
    text_score: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        title="Minimum line score",
        description="Recognised lines below this mean character confidence are dropped.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        title="Threads",
        description="Intra-op threads per model on the CPU; 0: the vision branch's share of this box's cores "
        "(what the text branch on the CPU leaves).",
    )

    @model_validator(mode="before")
    @classmethod
    def _backend_form(cls, data: Any) -> Any:
        # The OCR models have no PyTorch weights: on CUDA they run as TensorRT plans.
        if isinstance(data, dict) and data.get("device") == "cuda" and data.get("backend") is None:
            data = {**data, "backend": "tensorrt"}
        return _fill_backend(data)

    @model_validator(mode="after")
    def _backend_runs_here(self) -> OCRModelConfig:
        _backend_on_device(self.backend.type, self.device)
        if self.backend.type == "tensorrt" and self.backend.precision != "fp16":
            raise ValueError("the OCR models are built as fp16 plans only (backend.precision)")
        return self


class InspectModelConfig(StrictModel):
    enabled: bool = Field(default=True, title="Enabled", description="Serve the `inspect` task.")
    keep_alive_s: float | None = Field(
        default=None,
        ge=0.0,
        title="Keep-alive",
        description="Seconds the inspection model stays loaded after its last use before it may be evicted to make "
        "room for another job; unset keeps it loaded for good. An evicted model is loaded again (and measured "
        "again) when a job needs it.",
    )
    device: Device = Field(
        default="cpu",
        title="Device",
        description="Where the student runs: 'cpu', or 'cuda' (its FP16 weights on the GPU, images resized "
        "and normalised there).",
    )
    backend: BackendConfig = Field(
        default_factory=OnnxRuntimeConfig,
        title="Backend",
        description="The backend and its own settings: onnxruntime runs the student's ONNX export (the CPU "
        "default); torch-cuda runs its weights on a CUDA GPU (the default for device 'cuda'), by default "
        "in FP16 with one CUDA graph per batch size; tensorrt runs its FP16 or INT8 plan built on the box. "
        "`backend: NAME` is short for `{type: NAME}`.",
    )
    engine: Path | None = Field(
        default=None,
        title="Engine directory",
        description="A student build to serve as it is (its manifest says what it is), instead of the one "
        "built for build_size in paths.engine_dir.",
    )
    dataset: str = Field(
        default="synthetic",
        title="Training images",
        description="What the student is distilled on when it is built: 'synthetic' (the built-in factory "
        "parts), or a path to a folder of labelled images, one sub-folder per class (one named 'clean'), PNG "
        "or JPEG, each defect image optionally with its mask beside it as <name>.mask.png; split by file "
        "name into train, validation and test.",
    )
    build_size: Literal["default", "quick", "stream", "stream-long"] = Field(
        default="stream",
        title="Build size",
        description="Training set the student is distilled on when it is built: 'stream' (256,000 "
        "freshly generated images with the teacher on the GPU: the accurate one; it ships trained, "
        "so a first start installs it in under a minute wherever it runs), 'default' (600 images, "
        "about ten minutes on two cores, much less accurate), 'stream-long' (768,000 generated "
        "images: a little more accurate again; built on a CUDA machine, on the CPU it would take "
        "hours; a build directory copied from another machine is found by its inputs) or 'quick' "
        "(a smoke-sized build for tests). With a dataset, 'default' or 'quick' give the training length.",
    )
    max_batch: int = Field(
        default=8,
        ge=1,
        le=64,
        title="Maximum batch",
        description="Most inspect jobs run through the model at once.",
    )
    preferred_batch_sizes: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=list,
        max_length=8,
        title="Preferred batch sizes",
        description="Batch sizes worth dispatching at once when reached, without waiting out the queue delay.",
    )
    max_queue_delay_ms: float = Field(
        default=5.0,
        ge=0.0,
        le=1000.0,
        title="Maximum queue delay",
        description="How long the first job of a batch may wait for others to join it.",
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        title="Threads",
        description="Intra-op threads for the student on the CPU; 0: the vision branch's share of this box's "
        "cores (what the text branch on the CPU leaves).",
    )
    decode_threads: int = Field(
        default=4,
        ge=1,
        le=32,
        title="Decode threads",
        description="Threads that decode a batch's images at once (decoding runs outside the interpreter "
        "lock, so they work in parallel with each other and with the text branch).",
    )

    _backend_form = model_validator(mode="before")(_fill_backend)

    @model_validator(mode="before")
    @classmethod
    def _size_for_a_dataset(cls, data: Any) -> Any:
        # The shipped 'stream' student is the default for the built-in parts; a user's
        # own images are distilled at the 'default' length unless a size is given.
        if isinstance(data, dict) and data.get("dataset", "synthetic") != "synthetic" and "build_size" not in data:
            return {**data, "build_size": "default"}
        return data

    @field_validator("dataset")
    @classmethod
    def _dataset_exists(cls, value: str) -> str:
        if value == "synthetic":
            return value
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"{value!r} is neither 'synthetic' nor a folder of labelled images")
        if not (path / "clean").is_dir():
            raise ValueError(f"{value!r} has no 'clean' class folder")
        return str(path.resolve())

    @model_validator(mode="after")
    def _preferred_within_max(self) -> InspectModelConfig:
        too_big = [b for b in self.preferred_batch_sizes if b > self.max_batch]
        if too_big:
            raise ValueError(f"preferred_batch_sizes {too_big} exceed max_batch {self.max_batch}")
        _backend_on_device(self.backend.type, self.device)
        return self
