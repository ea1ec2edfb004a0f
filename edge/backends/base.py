"""The backend seam: a model file in, a session that maps named arrays to arrays out.

Vision models go through this interface so the same pipeline code runs on onnxruntime
(CPU default), TensorRT plans on a Jetson, or torch CUDA, chosen by the profile.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendOptions:
    threads: int = 0
    max_batch: int = 0  # largest batch the caller will send (0: unknown)


class InferenceSession(abc.ABC):
    """One loaded model. `run` is called from one worker thread at a time."""

    @property
    @abc.abstractmethod
    def input_names(self) -> list[str]: ...

    @property
    @abc.abstractmethod
    def output_names(self) -> list[str]: ...

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]: ...

    @abc.abstractmethod
    def metadata(self) -> dict[str, str]:
        """Custom metadata stored with the model (e.g. the recogniser's character list)."""

    # A session on an accelerator may take raw images and resize/normalise them there:
    # on the host that work caps a batch's throughput long before the model does.
    accepts_images = False

    def run_images(self, images: list[np.ndarray], size: int) -> list[np.ndarray]:
        """RGB uint8 images of any size in, the model's outputs out (sessions that set
        `accepts_images`)."""
        raise NotImplementedError(f"{type(self).__name__} takes preprocessed arrays only")


class Backend(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def load(self, model_path: Path, options: BackendOptions) -> InferenceSession: ...


_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise KeyError(
            f"backend {name!r} is not available here; available: {', '.join(available_backends())}"
        ) from None


BackendFactory = Callable[[], Backend]
