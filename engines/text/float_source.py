"""A float model read a few tensors at a time: what the build's steps read their weights
from, so that none of them holds a whole float model.

A source knows its model's config and the names of its tensors (ours: `layers.3.mlp.up_proj.weight`)
before reading any, reads the tensors asked for in float32, and writes the side files
(config, tokenizer, generation settings) a checkpoint made from it carries. Sources: a
Hugging Face directory (engines/text/import_hf.py), a GGUF file
(engines/text/import_gguf.py), a float checkpoint of ours (here), and any of them with a
LoRA adapter merged in as its tensors are read (engines/text/peft_adapter.py).

Each `read` opens the files it needs and closes them before it returns: a file mapped
into memory counts in the process's resident memory for every page read through it, so a
mapping kept open across the whole model would hold as much as the model itself.
"""

from __future__ import annotations

import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from edge.text.architecture import LlamaConfig
from edge.text.model.checkpoint import carried_files

_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to, None for the embeddings, final norm and head."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


class FloatSource(ABC):
    def __init__(self, config: LlamaConfig, label: str) -> None:
        self.config = config
        self.label = label  # for progress and messages

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor's name (a head tied to the embeddings is not one)."""

    @abstractmethod
    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """The tensors named, in float32."""

    @abstractmethod
    def write_side_files(self, out: Path) -> None:
        """config.json, tokenizer.json and generation.json of a checkpoint made from this source."""

    def top_names(self) -> list[str]:
        return [n for n in self.names() if layer_of(n) is None]

    def layer_names(self, i: int) -> list[str]:
        return [n for n in self.names() if layer_of(n) == i]


class CheckpointSource(FloatSource):
    """A float checkpoint of ours (an import or a merge: model.safetensors by our names)."""

    def __init__(self, path: Path) -> None:
        if (path / "quant.json").exists():
            raise ValueError(f"{path} is an INT4 checkpoint, not a float one")
        super().__init__(LlamaConfig.from_json(path / "config.json"), path.name)
        self.path = path
        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            self._names = list(fh.keys())

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path / "model.safetensors"), framework="pt") as fh:
            return {name: fh.get_tensor(name).to(torch.float32) for name in names}

    def write_side_files(self, out: Path) -> None:
        for name in carried_files(self.path):
            shutil.copy2(self.path / name, out / name)
