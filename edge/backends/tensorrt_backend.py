"""TensorRT backend: a model's plan, built on this box (engines/trt_build.py), run with
the TensorRT 10/11 runtime API on the branch's CUDA stream.

Loading finds the plan by its manifest (edge/artifacts.py), refusing one built for another
GPU or TensorRT version, deserializes it and creates one execution context per
optimisation profile. Buffers are torch CUDA tensors: their addresses go to
`set_tensor_address`, the input shapes to `set_input_shape`, and `execute_async_v3`
enqueues on the session's stream. Where input shapes are fixed (the student at a
padded batch size) the enqueue is captured once per batch size in a CUDA graph and
replayed, as the torch-cuda backend does.

The device memory a session holds is the engine's own figure for its contexts
(`device_memory_size_v2`) plus the weights and whatever else loading took, which the
model manager measures around the load; `device_bytes` reports the engine's part.

Registered only where `tensorrt` imports and torch sees a CUDA device
(`TRT_SUPPORT`); elsewhere a profile that asks for it is refused by name. This module
runs only on a box with TensorRT (a Jetson under JetPack): plans are built and checked
elsewhere, but not run.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.artifacts import Plan, PlanMismatch, Target, find_plan, unsupported_tensorrt
from edge.backends.base import (
    Backend,
    BackendOptions,
    BackendUnavailable,
    InferenceSession,
    ModelSource,
    mark_unavailable,
    register_backend,
)
from edge.backends.torch_backend import graph_sizes, images_on_gpu, staged_on_stream
from edge.config.backends import TensorRTConfig
from edge.timing import StageClock

logger = logging.getLogger(__name__)

trt: Any
try:
    trt = importlib.import_module("tensorrt")
    TRT_REFUSED = unsupported_tensorrt(str(trt.__version__))
    TRT_SUPPORT = bool(torch.cuda.is_available()) and TRT_REFUSED is None
except ImportError:
    trt = None
    TRT_REFUSED = None
    TRT_SUPPORT = False

RUNTIME = "tensorrt"


def runtime_target(device: int = 0) -> Target:
    """What this box runs plans on: the TensorRT runtime, its version, the GPU."""
    if trt is None:
        raise BackendUnavailable("TensorRT is not installed here (on a Jetson it comes with JetPack)")
    major, minor = torch.cuda.get_device_capability(device)
    return Target(RUNTIME, str(trt.__version__), f"sm{major}{minor}")


def _torch_dtype(dtype: Any) -> torch.dtype:
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.INT8: torch.int8,
        trt.DataType.BOOL: torch.bool,
    }
    if dtype not in table:
        raise BackendUnavailable(f"plan tensor of type {dtype} has no torch equivalent")
    return table[dtype]


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: torch.dtype
    is_input: bool


class PlanEngine:
    """A deserialized plan with one execution context per optimisation profile."""

    def __init__(self, plan: Plan, device: torch.device, stream: torch.cuda.Stream) -> None:
        self.plan = plan
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        blob = plan.plan_file.read_bytes()
        with torch.cuda.device(device):
            self.engine = self._runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise BackendUnavailable(f"TensorRT could not deserialize {plan.plan_file} (its log is above)")
        self.device = device
        self.stream = stream
        self.tensors = []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            mode = self.engine.get_tensor_mode(name)
            self.tensors.append(
                _Tensor(name, _torch_dtype(self.engine.get_tensor_dtype(name)), mode == trt.TensorIOMode.INPUT)
            )
        self.inputs = [t for t in self.tensors if t.is_input]
        self.outputs = [t for t in self.tensors if not t.is_input]
        self.contexts = []
        for profile in range(self.engine.num_optimization_profiles):
            context = self.engine.create_execution_context()
            if context is None:
                raise BackendUnavailable(f"TensorRT could not create an execution context for {plan.plan_file}")
            context.set_optimization_profile_async(profile, stream.cuda_stream)
            self.contexts.append(context)
        stream.synchronize()
        self._placeholder = torch.zeros(64, dtype=torch.float32, device=device)
        # The engine's own figure for what its contexts hold (activations, scratch);
        # the weights are in what the manager measures around the load.
        self.device_bytes = int(self.engine.device_memory_size_v2) * len(self.contexts)

    def profile_range(self, name: str, profile: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        low, _, high = self.engine.get_tensor_profile_shape(name, profile)
        return tuple(low), tuple(high)

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The first profile whose ranges hold every input's shape."""
        for profile in range(len(self.contexts)):
            if all(self._fits(shapes[t.name], *self.profile_range(t.name, profile)) for t in self.inputs):
                return profile
        raise ValueError(f"no optimisation profile of {self.plan.directory.name} takes shapes {shapes}")

    @staticmethod
    def _fits(shape: tuple[int, ...], low: tuple[int, ...], high: tuple[int, ...]) -> bool:
        return len(shape) == len(low) and all(a <= s <= b for s, a, b in zip(shape, low, high, strict=True))

    def bind(self, profile: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set shapes and addresses of `inputs` (contiguous CUDA tensors of the plan's
        types) on the profile's context and allocate the outputs; returns them."""
        context = self.contexts[profile]
        for spec in self.inputs:
            tensor = inputs[spec.name]
            if tensor.dtype != spec.dtype or not tensor.is_contiguous():
                raise ValueError(f"input {spec.name}: needs a contiguous {spec.dtype} tensor, got {tensor.dtype}")
            context.set_input_shape(spec.name, tuple(tensor.shape))
            # An empty tensor (a prompt's past of length 0) has no storage; the address
            # must still be a valid one.
            address = tensor.data_ptr() if tensor.numel() else self._placeholder.data_ptr()
            context.set_tensor_address(spec.name, address)
        outputs = {}
        for spec in self.outputs:
            shape = tuple(context.get_tensor_shape(spec.name))
            out = torch.empty(shape, dtype=spec.dtype, device=self.device)
            context.set_tensor_address(spec.name, out.data_ptr())
            outputs[spec.name] = out
        return outputs

    def enqueue(self, profile: int) -> None:
        if not self.contexts[profile].execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT could not enqueue {self.plan.directory.name} (its log is above)")

    def capturable(self, profile: int) -> bool:
        return bool(self.contexts[profile].is_stream_capturable(self.stream.cuda_stream))


class TensorRTSession(InferenceSession):
    """A vision model's plan: one input, named outputs, a batch axis first."""

    def __init__(self, engine: PlanEngine, source: ModelSource, max_batch: int, use_graphs: bool) -> None:
        if len(engine.inputs) != 1:
            raise BackendUnavailable(f"{source.name}: the tensorrt backend runs vision plans of one input")
        self._engine = engine
        self._input = engine.inputs[0]
        self._outputs = [t.name for t in engine.outputs]
        self.device = str(engine.device)
        self.device_bytes = engine.device_bytes
        self._source = source
        low, high = engine.profile_range(self._input.name, 0)
        self._max_batch = high[0]
        fixed = low[1:] == high[1:]
        # A graph per padded batch size where only the batch varies (the student).
        self._sizes = graph_sizes(min(max_batch or high[0], high[0])) if use_graphs and fixed else []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._image = source.image
        self.accepts_images = source.image is not None
        if source.image is not None:
            self._mean = torch.tensor(source.image.mean, device=engine.device).view(1, 3, 1, 1)
            self._std = torch.tensor(source.image.std, device=engine.device).view(1, 3, 1, 1)

    @property
    def input_names(self) -> list[str]:
        return [self._input.name]

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def metadata(self) -> dict[str, str]:
        stored = self._engine.plan.manifest.get("metadata")
        return {str(k): str(v) for k, v in stored.items()} if isinstance(stored, dict) else {}

    def _capture(
        self, batch: int, example: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, torch.Tensor]]:
        engine = self._engine
        static_in = torch.zeros((batch, *example.shape[1:]), dtype=self._input.dtype, device=engine.device)
        outputs = engine.bind(0, {self._input.name: static_in})
        engine.enqueue(0)  # once outside capture: TensorRT allocates lazily on the first run
        engine.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=engine.stream, capture_error_mode="thread_local"):
            engine.enqueue(0)
        return graph, static_in, outputs

    def _forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        engine = self._engine
        x = x.to(self._input.dtype).contiguous()
        parts: list[list[torch.Tensor]] = [[] for _ in self._outputs]
        for start in range(0, x.shape[0], self._max_batch):
            chunk = x[start : start + self._max_batch]
            n = chunk.shape[0]
            if self._sizes and engine.capturable(0):
                size = next(s for s in self._sizes if s >= n)
                if size not in self._graphs:
                    self._graphs[size] = self._capture(size, chunk)
                graph, static_in, static_out = self._graphs[size]
                static_in[:n].copy_(chunk)
                graph.replay()
                outs = [static_out[name][:n].clone() for name in self._outputs]
            else:
                bound = engine.bind(0, {self._input.name: chunk})
                engine.enqueue(0)
                outs = [bound[name] for name in self._outputs]
            for slot, t in zip(parts, outs, strict=True):
                slot.append(t.float())
        return [torch.cat(p) for p in parts]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.run_staged(inputs, StageClock())

    @torch.inference_mode()
    def run_staged(self, inputs: dict[str, np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """The upload, the plan and the copy back, as "model" on the GPU's clock."""
        array = np.ascontiguousarray(inputs[self._input.name])
        upload = lambda: torch.from_numpy(array).to(self._engine.device)  # noqa: E731
        return staged_on_stream(self._engine.stream, clock, upload, self._forward)

    def run_images(self, images: list[np.ndarray]) -> list[np.ndarray]:
        return self.run_images_staged(images, StageClock())

    @torch.inference_mode()
    def run_images_staged(self, images: list[np.ndarray], clock: StageClock) -> list[np.ndarray]:
        """Resized and normalised on the GPU ("preprocess"), then the plan ("model"),
        both on the GPU's clock."""
        spec = self._image
        if spec is None:
            raise NotImplementedError("this model does not take images")
        upload = lambda: images_on_gpu(images, spec.size, self._mean, self._std, torch.float32)  # noqa: E731
        return staged_on_stream(self._engine.stream, clock, upload, self._forward, upload_stage="preprocess")


class TensorRTTextModel:
    """The text model's plan (engines/text/text_onnx.py's interface): a prompt through the
    prefill profile, each further token through the decode profile, the KV cache as
    plan inputs and outputs (the presents of one call are the pasts of the next)."""

    def __init__(self, engine: PlanEngine) -> None:
        self._engine = engine
        names = [t.name for t in engine.inputs]
        self.num_layers = sum(1 for n in names if n.endswith(".key"))
        first = next(t for t in engine.inputs if t.name.startswith("past_key_values."))
        low, _ = engine.profile_range(first.name, 0)
        self._kv_shape = (low[1], low[3])
        self._kv_dtype = first.dtype
        self._past: dict[str, torch.Tensor] = {}

    def reset(self, batch: int = 1) -> None:
        heads, dim = self._kv_shape
        empty = torch.empty((batch, heads, 0, dim), dtype=self._kv_dtype, device=self._engine.device)
        self._past = {t.name: empty for t in self._engine.inputs if t.name != "input_ids"}

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] int64 -> logits [B, S, V] float32; the cache grows by S."""
        engine = self._engine
        if not self._past:
            self.reset(ids.shape[0])
        # Everything on the plan's stream: the ids' copy must land before the enqueue reads it.
        with torch.cuda.stream(engine.stream):
            feeds = {"input_ids": ids.to(engine.device, torch.int64).contiguous(), **self._past}
            profile = engine.profile_for({k: tuple(v.shape) for k, v in feeds.items()})
            out = engine.bind(profile, feeds)
            engine.enqueue(profile)
        engine.stream.synchronize()
        self._past = {name: out[name.replace("past_key_values", "present")] for name in self._past}
        return out["logits"]

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation of `prompt`: the tokens and each step's last logits."""
        self.reset(1)
        logits = self.step(torch.tensor([prompt]))[:, -1]
        tokens, steps = [], [logits[0].float().cpu()]
        for _ in range(new_tokens):
            token = int(logits.argmax(-1))
            tokens.append(token)
            logits = self.step(torch.tensor([[token]]))[:, -1]
            steps.append(logits[0].float().cpu())
        return tokens, steps[:-1]


def load_plan(engine_dir: Path, wanted: dict[str, Any], device: int = 0) -> Plan:
    """The plan that serves `wanted` on this box, or why not (PlanMismatch, EngineMissing)."""
    return find_plan(engine_dir, wanted, runtime_target(device))


def open_text_plan(engine_dir: Path, checkpoint: str, device: int = 0) -> TensorRTTextModel:
    plan = load_plan(engine_dir, {"task": "qa", "checkpoint": checkpoint, "precision": "int4-fp16"}, device)
    stream = torch.cuda.Stream(torch.device("cuda", device))
    return TensorRTTextModel(PlanEngine(plan, torch.device("cuda", device), stream))


if TRT_SUPPORT:

    @register_backend
    class TensorRTBackend(Backend):
        name = "tensorrt"

        def load(self, source: ModelSource, options: BackendOptions) -> InferenceSession:
            config = options.config if isinstance(options.config, TensorRTConfig) else TensorRTConfig()
            if source.plan is None:
                raise BackendUnavailable(f"{source.name} has no TensorRT plan to look for")
            if options.engine_dir is None:
                raise BackendUnavailable(f"{source.name}: the tensorrt backend needs the engine directory")
            device = torch.device("cuda", torch.cuda.current_device())
            try:
                plan = load_plan(options.engine_dir, {**source.plan, "precision": config.precision}, device.index or 0)
            except PlanMismatch as err:
                raise BackendUnavailable(str(err)) from err
            stream = torch.cuda.Stream(device, priority=-1 if config.high_priority_stream else 0)
            engine = PlanEngine(plan, device, stream)
            logger.info(
                "loaded %s from %s (%s, %d profiles, %d bytes of context memory)",
                source.name,
                plan.directory.name,
                config.precision,
                len(engine.contexts),
                engine.device_bytes,
            )
            return TensorRTSession(engine, source, options.max_batch, config.cuda_graphs)

else:
    mark_unavailable(
        "tensorrt",
        "TensorRT's Python runtime is not installed; on a Jetson it comes with JetPack (python3-libnvinfer)"
        if trt is None
        else TRT_REFUSED or "TensorRT is installed but no CUDA device is visible",
    )
