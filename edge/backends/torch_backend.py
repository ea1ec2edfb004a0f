"""torch CUDA backend: a model's PyTorch module on a CUDA GPU, in FP16 by default, with
one CUDA graph per batch size.

A batch is padded up to the next captured size (1, 2, 4, ... max) and replayed, so the
launch work of a forward pass (about 150 kernels for a small ViT) is paid once at capture
instead of on every batch. For a model that takes normalised images, raw uint8 images go
up and are resized and normalised on the GPU. A model of several inputs (token ids and
their mask, say) runs each batch as it comes, without a graph: its batches differ in
length as well as size, and integer inputs keep their type. Registered only where torch
sees a CUDA device; knows nothing of any particular model (the `ModelSource` says what
to build).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from edge.backends.base import (
    Backend,
    BackendOptions,
    BackendUnavailable,
    ImageInput,
    InferenceSession,
    ModelSource,
    register_backend,
)
from edge.config.backends import TorchCudaConfig
from edge.gpu_streams import side_stream
from edge.timing import DeviceStages, StageClock

logger = logging.getLogger(__name__)

TORCH_CUDA_SUPPORT = torch.cuda.is_available()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
T = TypeVar("T")


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(min(sizes[-1] * 2, max_batch))
    return sizes


class TorchCudaSession(InferenceSession):
    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        image: ImageInput | None = None,
        use_graphs: bool = True,
        high_priority: bool = True,
    ) -> None:
        if not inputs or (image is not None and len(inputs) != 1):
            raise BackendUnavailable(f"torch-cuda runs an image model of one input, not {len(inputs)}")
        self._model = model
        self._inputs = inputs
        self._outputs = outputs
        self._device = next(model.parameters()).device
        self.device = str(self._device)
        self._dtype = next(model.parameters()).dtype
        self._sizes = graph_sizes(max_batch)
        self._use_graphs = use_graphs and len(inputs) == 1
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._use_graphs else None
        self._image = image
        self.accepts_images = image is not None
        if image is not None:
            self._mean = torch.tensor(image.mean, device=self._device).view(1, 3, 1, 1)
            self._std = torch.tensor(image.std, device=self._device).view(1, 3, 1, 1)
        # Camera jobs have deadlines; the text branch's decode kernels do not. A stream of
        # higher priority lets the GPU start this model's blocks ahead of queued decode
        # blocks instead of after them (the text branch uses the default stream).
        self._stream = torch.cuda.Stream(self._device, priority=-1 if high_priority else 0)

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def metadata(self) -> dict[str, str]:
        return {"dtype": str(self._dtype), "graph_sizes": ",".join(map(str, self._sizes))}

    def _capture(
        self, batch: int, example: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, ...]]:
        static_in = torch.zeros((batch, *example.shape[1:]), device=self._device, dtype=self._dtype)
        stream = side_stream(self._device)  # one cuBLAS workspace for all captures
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture: lazy init and kernel selection
                self._model(static_in)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the text branch's thread may be launching its own work meanwhile;
        # the default (global) mode would fail its calls during the capture.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            outputs = self._model(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        logger.debug("captured batch %d", batch)
        return graph, static_in, tuple(outputs)

    @torch.inference_mode()
    def run_tensor(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device-side entry point: the input [B, ...] on the GPU -> outputs on the GPU,
        ready for the caller's stream."""
        caller = torch.cuda.current_stream(self._device)
        if caller == self._stream:
            return self._forward(pixels)
        self._stream.wait_stream(caller)
        pixels.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            out = self._forward(pixels)
        caller.wait_stream(self._stream)
        for t in out:
            t.record_stream(caller)
        return out

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        if not self._use_graphs:
            return tuple(t.float() for t in self._model(x.to(self._dtype)))
        out: list[list[torch.Tensor]] = [[] for _ in self._outputs]
        for start in range(0, n, self._sizes[-1]):
            chunk = x[start : start + self._sizes[-1]]
            size = next(s for s in self._sizes if s >= chunk.shape[0])
            if size not in self._graphs:
                self._graphs[size] = self._capture(size, chunk)
            graph, static_in, static_out = self._graphs[size]
            static_in[: chunk.shape[0]].copy_(chunk)
            graph.replay()
            for slot, t in zip(out, static_out, strict=True):
                slot.append(t[: chunk.shape[0]].float())
        return tuple(torch.cat(parts) for parts in out)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.run_staged(inputs, StageClock())

    @torch.inference_mode()
    def run_staged(self, inputs: dict[str, np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """The upload, the model and the copy back, as "model" on the GPU's clock."""
        missing = [name for name in self._inputs if name not in inputs]
        if missing:
            raise ValueError(f"missing model inputs: {', '.join(missing)}")
        if len(self._inputs) == 1:
            array = inputs[self._inputs[0]]
            return staged_on_stream(
                self._stream, clock, lambda: torch.from_numpy(array).to(self._device), self._forward
            )
        return staged_on_stream(self._stream, clock, lambda: self._upload(inputs), self._forward_inputs)

    def _upload(self, inputs: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        """The named arrays on the GPU in the model's order: floating ones in the model's
        type, integer ones (token ids, masks) as they are."""
        tensors = []
        for name in self._inputs:
            t = torch.from_numpy(np.ascontiguousarray(inputs[name])).to(self._device)
            tensors.append(t.to(self._dtype) if t.is_floating_point() else t)
        return tuple(tensors)

    def _forward_inputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(t.float() for t in self._model(*tensors))

    def run_images(self, images: list[np.ndarray]) -> list[np.ndarray]:
        return self.run_images_staged(images, StageClock())

    @torch.inference_mode()
    def run_images_staged(self, images: list[np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """Uploads uint8 pixels (a third of float32's bytes) and resizes and normalises on
        the GPU ("preprocess"), then runs the model and copies its outputs back ("model"),
        both on the GPU's clock. Images of one shape go up as one tensor, one resize for
        all of them."""
        spec = self._image
        if spec is None:
            raise NotImplementedError("this model does not take images")
        return staged_on_stream(
            self._stream,
            clock,
            lambda: images_on_gpu(images, spec.size, self._mean, self._std, self._dtype),
            self._forward,
            upload_stage="preprocess",
        )


def staged_on_stream(
    stream: torch.cuda.Stream,
    clock: StageClock,
    upload: Callable[[], T],
    forward: Callable[[T], Sequence[torch.Tensor]],
    upload_stage: str | None = None,
) -> list[np.ndarray]:
    """upload() then forward() on `stream`, the outputs copied back, each stage timed on
    the GPU's clock (CUDA events on the stream) into `clock`: the upload as
    `upload_stage` where one is named, else as part of "model"."""
    with torch.cuda.stream(stream):
        marks = DeviceStages(stream)
        x = upload()
        if upload_stage is not None:
            marks.end(upload_stage)
        out = [t.cpu().numpy() for t in forward(x)]
        marks.end("model")
    marks.add_to(clock)
    return out


def images_on_gpu(
    images: list[np.ndarray], size: int, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """RGB uint8 images of any size -> a normalised [N, 3, size, size] batch on the
    device of `mean`, resized there. Images of one shape go up as one tensor."""
    device = mean.device
    pixels = torch.empty(len(images), 3, size, size, device=device, dtype=dtype)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, img in enumerate(images):
        groups.setdefault(img.shape, []).append(i)
    for shape, index in groups.items():
        host = torch.from_numpy(np.stack([images[i] for i in index]))
        batch = host.to(device, non_blocking=False).permute(0, 3, 1, 2).float()
        if tuple(shape[:2]) != (size, size):
            # Antialiased when shrinking, as the CPU path's area filter: a defect a few
            # pixels wide must not vanish between samples.
            batch = F.interpolate(batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        batch = (batch / 255.0 - mean) / std
        pixels[torch.tensor(index, device=device)] = batch.to(dtype)
    return pixels


if TORCH_CUDA_SUPPORT:

    @register_backend
    class TorchCudaBackend(Backend):
        name = "torch-cuda"

        def load(self, source: ModelSource, options: BackendOptions) -> InferenceSession:
            if source.torch_module is None:
                raise BackendUnavailable(f"{source.name} has no PyTorch weights for torch-cuda")
            config = options.config if isinstance(options.config, TorchCudaConfig) else TorchCudaConfig()
            module = source.torch_module().to("cuda").to(DTYPES[config.dtype]).eval()
            return TorchCudaSession(
                module,
                max_batch=options.max_batch or 32,
                inputs=source.inputs,
                outputs=source.outputs,
                image=source.image,
                use_graphs=config.cuda_graphs,
                high_priority=config.high_priority_stream,
            )
