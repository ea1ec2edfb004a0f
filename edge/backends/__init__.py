"""Inference backends; importing this package registers every one this machine supports."""

from edge.backends import onnxruntime_backend as _onnxruntime_backend  # noqa: F401  (registers)
from edge.backends import torch_backend as _torch_backend  # noqa: F401  (registers where CUDA is)
from edge.backends.base import (
    Backend,
    BackendOptions,
    BackendUnavailable,
    ImageInput,
    InferenceSession,
    ModelSource,
    available_backends,
    get_backend,
)

__all__ = [
    "Backend",
    "BackendOptions",
    "BackendUnavailable",
    "ImageInput",
    "InferenceSession",
    "ModelSource",
    "available_backends",
    "get_backend",
]
