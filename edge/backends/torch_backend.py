"""torch CUDA backend for the inspection student: FP16 weights, fused SDPA attention,
and one CUDA graph per batch size.

A batch is padded up to the next captured size (1, 2, 4, ... max) and replayed, so the
launch work of the ~150 kernels of a ViT forward is paid once at capture instead of on
every batch. Registered only where torch sees a CUDA device.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edge.backends.base import Backend, BackendOptions, InferenceSession, register_backend
from edge.vision.vit import IMAGE_MEAN, IMAGE_STD, ExportWrapper, load_student

logger = logging.getLogger(__name__)

TORCH_CUDA_SUPPORT = torch.cuda.is_available()
INPUT_NAME = "pixels"
OUTPUT_NAMES = ("class_probs", "patch_probs")


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(min(sizes[-1] * 2, max_batch))
    return sizes


class TorchCudaSession(InferenceSession):
    def __init__(self, model: ExportWrapper, max_batch: int, use_graphs: bool = True) -> None:
        self._model = model
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        self._sizes = graph_sizes(max_batch)
        self._use_graphs = use_graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._size = model.model.config.image_size
        self._mean = torch.tensor(IMAGE_MEAN, device=self._device).view(1, 3, 1, 1)
        self._std = torch.tensor(IMAGE_STD, device=self._device).view(1, 3, 1, 1)
        # Camera jobs have deadlines; the text branch's decode kernels do not. A stream of
        # higher priority lets the GPU start this model's blocks ahead of queued decode
        # blocks instead of after them (the text branch uses the default stream).
        self._stream = torch.cuda.Stream(self._device, priority=-1)

    @property
    def input_names(self) -> list[str]:
        return [INPUT_NAME]

    @property
    def output_names(self) -> list[str]:
        return list(OUTPUT_NAMES)

    def metadata(self) -> dict[str, str]:
        return {"dtype": str(self._dtype), "graph_sizes": ",".join(map(str, self._sizes))}

    def _capture(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, ...]]:
        static_in = torch.zeros(batch, 3, self._size, self._size, device=self._device, dtype=self._dtype)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture: lazy init and kernel selection
                self._model(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the text branch's thread may be launching its own work meanwhile;
        # the default (global) mode would fail its calls during the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self._model(static_in)
        logger.debug("captured the student for batch %d", batch)
        return graph, static_in, tuple(outputs)

    @torch.inference_mode()
    def run_tensor(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device-side entry point: pixels [B, 3, H, W] on the GPU -> outputs on the GPU,
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

    def _forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = pixels.shape[0]
        if not self._use_graphs:
            return tuple(t.float() for t in self._model(pixels.to(self._dtype)))
        out: list[list[torch.Tensor]] = [[] for _ in OUTPUT_NAMES]
        for start in range(0, n, self._sizes[-1]):
            chunk = pixels[start : start + self._sizes[-1]]
            size = next(s for s in self._sizes if s >= chunk.shape[0])
            if size not in self._graphs:
                self._graphs[size] = self._capture(size)
            graph, static_in, static_out = self._graphs[size]
            static_in[: chunk.shape[0]].copy_(chunk)
            graph.replay()
            for slot, t in zip(out, static_out, strict=True):
                slot.append(t[: chunk.shape[0]].float())
        return tuple(torch.cat(parts) for parts in out)

    @torch.inference_mode()
    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.cuda.stream(self._stream):
            pixels = torch.from_numpy(inputs[INPUT_NAME]).to(self._device)
            return [t.cpu().numpy() for t in self._forward(pixels)]

    accepts_images = True

    @torch.inference_mode()
    def run_images(self, images: list[np.ndarray], size: int) -> list[np.ndarray]:
        """Uploads uint8 pixels (a third of float32's bytes) and resizes and normalises on
        the GPU. Images of one shape go up as one tensor, one resize for all of them."""
        with torch.cuda.stream(self._stream):
            return self._run_images(images, size)

    def _run_images(self, images: list[np.ndarray], size: int) -> list[np.ndarray]:
        pixels = torch.empty(len(images), 3, size, size, device=self._device, dtype=self._dtype)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, img in enumerate(images):
            groups.setdefault(img.shape, []).append(i)
        for shape, index in groups.items():
            host = torch.from_numpy(np.stack([images[i] for i in index]))
            batch = host.to(self._device, non_blocking=False).permute(0, 3, 1, 2).float()
            if tuple(shape[:2]) != (size, size):
                # Antialiased when shrinking, as the CPU path's area filter: a defect a few
                # pixels wide must not vanish between samples.
                batch = F.interpolate(batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            batch = (batch / 255.0 - self._mean) / self._std
            pixels[torch.tensor(index, device=self._device)] = batch.to(self._dtype)
        return [t.cpu().numpy() for t in self._forward(pixels)]


if TORCH_CUDA_SUPPORT:

    @register_backend
    class TorchCudaBackend(Backend):
        name = "torch-cuda"

        def load(self, model_path: Path, options: BackendOptions) -> InferenceSession:
            """`model_path` is the student's directory (config.json + student.pt)."""
            directory = model_path if model_path.is_dir() else model_path.parent
            model = load_student(directory, "cuda").half()
            return TorchCudaSession(ExportWrapper(model).eval(), max_batch=options.max_batch or 32)
