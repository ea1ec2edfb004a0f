"""Offline build pipeline: turn source models into the engines the daemon loads.

One package per branch: `engines.text` (the text model: import, QLoRA, adapter merge,
AWQ, ONNX export), `engines.vision` (the inspection student: data, teacher, distillation,
ONNX) and `engines.retrieval` (the retrieval encoder and its evaluation set). Shared at
the top: `engines.cache` (builds keyed by their inputs) and `engines.trt_build`
(TensorRT plans of every branch's models)."""
