"""Inference backends. Each plugin registers itself when imported; `get_backend` imports
them on first use, so reading a profile (the backends' config sections) costs no
onnxruntime or torch import."""

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
