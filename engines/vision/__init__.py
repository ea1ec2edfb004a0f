"""Inspection student builds: synthetic or folder data, the teacher, distillation, ONNX."""
