"""The backend seam: a model's artifacts in, a session that maps named arrays to arrays out.

Vision models go through this interface so the same pipeline code runs on onnxruntime
(CPU default), torch CUDA, or TensorRT plans, chosen by the profile. A backend knows
nothing of a particular model: what it gets is a `ModelSource` (the files a build wrote
and, for the torch backends, a function that builds the module), which the model's own
artifact contract fills in (edge/vision/student.py, edge/vision/ocr.py).
"""

from __future__ import annotations

import abc
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge.config.backends import BackendConfig, OnnxRuntimeConfig
from edge.timing import StageClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageInput:
    """A model whose one input is normalised RGB images: what a session needs to take raw
    uint8 images and prepare them itself (on the GPU, say)."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass(frozen=True)
class ModelSource:
    """What a backend may load a model from. `torch_module` returns the float module
    (an nn.Module whose forward maps the inputs to a tuple of the outputs, in order)."""

    name: str
    onnx: Path | None = None
    torch_module: Callable[[], Any] | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    image: ImageInput | None = None
    # What a TensorRT plan built from this model serves (its manifest's `serves`, less
    # the precision and target), for the tensorrt backend to find it by.
    plan: dict[str, Any] | None = None


@dataclass(frozen=True)
class BackendOptions:
    threads: int = 0
    max_batch: int = 0  # largest batch the caller will send (0: unknown)
    config: BackendConfig = field(default_factory=OnnxRuntimeConfig)
    # Where built plans live (paths.engine_dir), for backends that load them.
    engine_dir: Path | None = None


class InferenceSession(abc.ABC):
    """One loaded model. `run` is called from one worker thread at a time."""

    # Where the session's working memory lives: "cpu", or a CUDA device ("cuda:0").
    device = "cpu"

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

    def run_images(self, images: list[np.ndarray]) -> list[np.ndarray]:
        """RGB uint8 images of any size in, the model's outputs out (sessions that set
        `accepts_images`, for a source with an `image` input)."""
        raise NotImplementedError(f"{type(self).__name__} takes preprocessed arrays only")

    def run_staged(self, inputs: dict[str, np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """run(), its time added to `clock` as stage "model": on the host's clock here; a
        session on a GPU times it with CUDA events on its stream instead."""
        with clock.stage("model"):
            return self.run(inputs)

    def run_images_staged(self, images: list[np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """run_images(), its time added to `clock`: all of it as "model" on the host's
        clock here; a session on a GPU adds "preprocess" (upload, resize, normalise) and
        "model" on the device's clock."""
        with clock.stage("model"):
            return self.run_images(images)


class BackendUnavailable(RuntimeError):
    """A backend that cannot load this model on this machine, with the reason."""


class Backend(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def load(self, source: ModelSource, options: BackendOptions) -> InferenceSession: ...


_REGISTRY: dict[str, type[Backend]] = {}
# Plugins that cannot run here, with why (said when a profile asks for one).
_UNAVAILABLE: dict[str, str] = {}
# The plugins, by backend name; each registers itself on import, where its runtime is
# installed and usable.
PLUGINS = {
    "onnxruntime": "edge.backends.onnxruntime_backend",
    "torch-cuda": "edge.backends.torch_backend",
    "tensorrt": "edge.backends.tensorrt_backend",
}
_discovered = False


def _discover() -> None:
    """Import every plugin once. One whose runtime is not installed at all (its module
    fails to import it) is unavailable with that reason; the others serve as ever: a box
    with onnxruntime and no torch still runs the ONNX models. A missing module of our own
    is a broken install, not a missing runtime: that error goes up."""
    global _discovered
    if not _discovered:
        for name, module in PLUGINS.items():
            try:
                importlib.import_module(module)
            except ImportError as err:
                if (err.name or "").split(".")[0] == __name__.split(".")[0]:
                    raise
                logger.debug("backend %s not loaded: %s", name, err)
                mark_unavailable(name, f"{err.name or err} is not installed")
        _discovered = True


def register_backend(cls: type[Backend]) -> type[Backend]:
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def mark_unavailable(name: str, reason: str) -> None:
    """A plugin whose runtime is missing here says why, for get_backend to repeat."""
    _UNAVAILABLE[name] = reason


def available_backends() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    _discover()
    try:
        return _REGISTRY[name]()
    except KeyError:
        why = f" ({_UNAVAILABLE[name]})" if name in _UNAVAILABLE else ""
        raise BackendUnavailable(
            f"backend {name!r} is not available here{why}; available: {', '.join(available_backends())}"
        ) from None
