"""Load a text checkpoint written by `engines.import_gguf` (or any later build step)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from edge.text.llama import LlamaConfig, LlamaModel

logger = logging.getLogger(__name__)


@dataclass
class TextCheckpoint:
    model: LlamaModel
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    path: Path


def load_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> TextCheckpoint:
    config = LlamaConfig.from_json(path / "config.json")
    with torch.device("meta"):
        model = LlamaModel(config)
    state = load_file(str(path / "model.safetensors"))
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    # assign=True adopts the loaded tensors instead of copying into meta placeholders.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not m.startswith("rope_")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(dtype).eval()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    gen = json.loads((path / "generation.json").read_text(encoding="utf-8"))
    eos = {int(gen["eos_token_id"])}
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    if end_of_text is not None:
        eos.add(end_of_text)
    return TextCheckpoint(model=model, tokenizer=tokenizer, eos_ids=frozenset(eos), path=path)
