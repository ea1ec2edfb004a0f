"""Each backend's own profile section, told apart by its `type`.

A model's `backend` in the profile is one of these (`backend: onnxruntime` is short for
`backend: {type: onnxruntime}`). They live in one light module, not beside each backend's
runtime, so that reading a profile (as `edgectl status` does) never imports onnxruntime
or torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from edge.config.base import StrictModel


class OnnxRuntimeConfig(StrictModel):
    type: Literal["onnxruntime"] = Field(default="onnxruntime", description="Run the model's ONNX file in onnxruntime.")
    cpu_arena: bool = Field(
        default=False,
        title="CPU memory arena",
        description="Keep onnxruntime's CPU arena. Off by default: input shapes vary per image, and an arena "
        "sized for the largest one is never given back.",
    )


class TorchCudaConfig(StrictModel):
    type: Literal["torch-cuda"] = Field(
        default="torch-cuda", description="Run the model's PyTorch weights on a CUDA GPU."
    )
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", title="Weights and activations", description="Precision the model runs in on the GPU."
    )
    cuda_graphs: bool = Field(
        default=True,
        title="CUDA graphs",
        description="Capture one CUDA graph per batch size at load and replay it: the launch work of a "
        "forward pass is paid once instead of on every batch.",
    )
    high_priority_stream: bool = Field(
        default=True,
        title="High-priority stream",
        description="Run on a CUDA stream of higher priority than the text branch's, so camera jobs with "
        "deadlines are not queued behind decode kernels.",
    )


class TensorRTConfig(StrictModel):
    type: Literal["tensorrt"] = Field(
        default="tensorrt",
        description="Run the model's TensorRT plan, built on this box by `edgectl build --backend tensorrt` "
        "(or at the first start) for its GPU and TensorRT version.",
    )
    precision: Literal["fp16", "int8"] = Field(
        default="fp16",
        title="Plan precision",
        description="Which plan serves: 'fp16', or 'int8' (explicit Q/DQ calibrated on the student's own "
        "images; the inspection student only).",
    )
    cuda_graphs: bool = Field(
        default=True,
        title="CUDA graphs",
        description="Capture the plan's enqueue in one CUDA graph per batch size where input shapes are "
        "fixed (the student), and replay it.",
    )
    high_priority_stream: bool = Field(
        default=True,
        title="High-priority stream",
        description="Run on a CUDA stream of higher priority than the text branch's.",
    )


BackendConfig = Annotated[OnnxRuntimeConfig | TorchCudaConfig | TensorRTConfig, Field(discriminator="type")]

DEFAULT_BACKEND = {"cpu": "onnxruntime", "cuda": "torch-cuda"}
BACKEND_DEVICES = {"onnxruntime": ("cpu",), "torch-cuda": ("cuda",), "tensorrt": ("cuda",)}


def backend_section(value: object, device: str) -> object:
    """The profile's `backend` value in its full form: a name alone becomes {type: name};
    none at all becomes the default for the model's device."""
    if value is None:
        return {"type": DEFAULT_BACKEND[device]}
    if isinstance(value, str):
        return {"type": value}
    return value
