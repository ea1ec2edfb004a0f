"""Text model builds: import (GGUF, Hugging Face), QLoRA and adapter merge, AWQ, ONNX export."""
