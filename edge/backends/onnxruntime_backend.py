"""onnxruntime backend: the CPU default."""

from __future__ import annotations

import logging

import numpy as np

from edge.backends.base import (
    Backend,
    BackendOptions,
    BackendUnavailable,
    InferenceSession,
    ModelSource,
    register_backend,
)
from edge.config.backends import OnnxRuntimeConfig

logger = logging.getLogger(__name__)

try:
    import onnxruntime as ort

    ORT_SUPPORT = True
except ImportError:  # pragma: no cover - onnxruntime is a hard dependency on the CPU default
    ORT_SUPPORT = False


class OrtSession(InferenceSession):
    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
        self._inputs = [i.name for i in session.get_inputs()]
        self._outputs = [o.name for o in session.get_outputs()]

    @property
    def input_names(self) -> list[str]:
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(o) for o in self._session.run(self._outputs, inputs)]

    def metadata(self) -> dict[str, str]:
        return dict(self._session.get_modelmeta().custom_metadata_map)


if ORT_SUPPORT:

    @register_backend
    class OrtBackend(Backend):
        name = "onnxruntime"

        def load(self, source: ModelSource, options: BackendOptions) -> InferenceSession:
            if source.onnx is None:
                raise BackendUnavailable(f"{source.name} has no ONNX file for onnxruntime")
            config = options.config if isinstance(options.config, OnnxRuntimeConfig) else OnnxRuntimeConfig()
            opts = ort.SessionOptions()
            opts.enable_cpu_mem_arena = config.cpu_arena
            opts.log_severity_level = 3
            if options.threads:
                opts.intra_op_num_threads = options.threads
                opts.inter_op_num_threads = 1
            session = ort.InferenceSession(str(source.onnx), sess_options=opts, providers=["CPUExecutionProvider"])
            logger.info("loaded %s (%s) on onnxruntime's CPU provider", source.name, source.onnx.name)
            return OrtSession(session)
