"""onnxruntime backend: the CPU default, and CUDA where an onnxruntime-gpu build exists."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge.backends.base import Backend, BackendOptions, InferenceSession, register_backend

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

        def load(self, model_path: Path, options: BackendOptions) -> InferenceSession:
            opts = ort.SessionOptions()
            # Shapes vary per image; an arena sized for the largest one is never returned.
            opts.enable_cpu_mem_arena = False
            opts.log_severity_level = 3
            if options.threads:
                opts.intra_op_num_threads = options.threads
                opts.inter_op_num_threads = 1
            providers = ["CPUExecutionProvider"]
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, "CUDAExecutionProvider")
            session = ort.InferenceSession(str(model_path), sess_options=opts, providers=providers)
            logger.info("loaded %s on %s", model_path.name, session.get_providers()[0])
            return OrtSession(session)
