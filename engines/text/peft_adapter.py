"""Merge a PEFT LoRA adapter directory into a base checkpoint at build time.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes them. Each targeted linear becomes W + s * B @ A with
s = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`), r being that module's own
rank (PEFT's rank_pattern included). What this merge does not handle is refused by name:
DoRA, modules_to_save, trained biases, alpha_pattern, layers_to_transform, fan_in_fan_out,
LoRA on the embeddings, and LoRA on a head tied to the embeddings.

An adapter trained on a 4-bit base (QLoRA) is merged into the dequantized base it was
trained against, not the float one: a `base_quantization.json` beside the adapter says
which (engines/text/base_quantization.py: our own INT4 groups, or a bitsandbytes NF4/FP4
base). Each adapted linear is merged into its rounded weight; the others keep their
full-precision weights. The served model carries no adapter and no extra latency.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from edge.text.model.llama import LlamaModel
from engines.cache import build_cached, cache_key, file_sha256, read_manifest
from engines.text.base_quantization import FILE as BASE_QUANTIZATION
from engines.text.base_quantization import BaseQuantization, BaseQuantizationError, read_base_quantization
from engines.text.float_checkpoint import write_float_streamed
from engines.text.float_source import CheckpointSource, FloatSource

logger = logging.getLogger(__name__)

MERGER_VERSION = 1
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter this merge cannot apply, with what is wrong."""


@dataclass(frozen=True)
class LoraUpdate:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    def delta(self) -> torch.Tensor:
        return self.scale * (self.b.double() @ self.a.double())


@dataclass(frozen=True)
class Adapter:
    directory: Path
    updates: dict[str, LoraUpdate]  # by our module name (layers.3.self_attn.q_proj)
    base: BaseQuantization | None  # the 4-bit base it was trained on, if any
    config: dict[str, Any]


_PARTS = "lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector"
_KEY = re.compile(rf"^(?:base_model\.model\.)?(.*)\.({_PARTS})(?:\.[\w-]+)?(?:\.weight)?$")


def _our_module(key: str) -> tuple[str, str]:
    """(module, part) from a PEFT key: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    match = _KEY.match(key)
    if match is None:
        if "embed_tokens" in key:
            raise AdapterError("LoRA on the embeddings (embed_tokens, saved with the adapter) is not supported")
        raise AdapterError(f"{WEIGHTS} carries {key}, not LoRA factors: full weights saved with it are not supported")
    module = match.group(1).removeprefix("model.")
    return module, match.group(2)


def read_adapter(directory: Path, model: LlamaModel) -> Adapter:
    config_path, weights_path = directory / CONFIG, directory / WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{directory} is not a PEFT adapter directory: it needs {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise AdapterError(f"{CONFIG} is not JSON: {err}") from err
    refused: list[str] = []
    if config.get("peft_type", "LORA") != "LORA":
        refused.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        refused.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        refused.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        refused.append(f"bias {config['bias']!r} (trained biases)")
    if config.get("alpha_pattern"):
        refused.append("alpha_pattern")
    if config.get("layers_to_transform") is not None:
        refused.append("layers_to_transform")
    if config.get("fan_in_fan_out"):
        refused.append("fan_in_fan_out")
    if refused:
        raise AdapterError(f"adapter {directory.name}: not supported: {'; '.join(refused)}")
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        module, part = _our_module(key)
        if part.startswith("lora_embedding"):
            raise AdapterError(f"adapter {directory.name}: LoRA on the embeddings ({module}) is not supported")
        if part == "lora_magnitude_vector":
            raise AdapterError(f"adapter {directory.name}: DoRA magnitudes ({module}) are not supported")
        parts.setdefault(module, {})[part] = tensor.float()
    modules = dict(model.named_modules())
    updates: dict[str, LoraUpdate] = {}
    for module, ab in parts.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {directory.name}: {module} has {sorted(ab)}, not lora_A and lora_B")
        target = modules.get(module)
        if not isinstance(target, nn.Linear):
            raise AdapterError(f"adapter {directory.name}: {module} is not a linear layer of this model")
        if module == "lm_head" and model.config.tie_embeddings:
            raise AdapterError(f"adapter {directory.name}: LoRA on lm_head of a model with tied embeddings")
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if a.shape[1] != target.in_features or b.shape != (target.out_features, r):
            raise AdapterError(
                f"adapter {directory.name}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the model's "
                f"layer is {target.out_features}x{target.in_features}: trained for another base model"
            )
        updates[module] = LoraUpdate(a, b, alpha / math.sqrt(r) if rslora else alpha / r)
    if not updates:
        raise AdapterError(f"adapter {directory.name} holds no LoRA weights")
    _check_targets(directory, config.get("target_modules"), set(updates))
    try:
        base = read_base_quantization(directory)
    except BaseQuantizationError as err:
        raise AdapterError(str(err)) from err
    return Adapter(directory, updates, base, config)


def _check_targets(directory: Path, targets: Any, merged: set[str]) -> None:
    """Every module the adapter carries weights for is one its target_modules names."""
    if targets is None:
        return
    if isinstance(targets, str):
        stray = [m for m in merged if not re.fullmatch(targets, m) and not re.fullmatch(targets, f"model.{m}")]
    else:
        names = set(targets)
        stray = [m for m in merged if m.rsplit(".", 1)[-1] not in names and m not in names]
    if stray:
        raise AdapterError(f"adapter {directory.name}: weights for {sorted(stray)[:3]} outside its target_modules")


def merged_weight(adapter: Adapter, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Linear `name`'s weight with the adapter's update added, in the weight's dtype."""
    update = adapter.updates[name]
    base = weight.detach().float()
    if adapter.base is not None:
        # The weights the adapter was trained against: the rounded base.
        try:
            base = adapter.base.dequantized(base)
        except BaseQuantizationError as err:
            raise AdapterError(f"adapter {adapter.directory.name}: {err}") from err
    return (base.double() + update.delta()).to(weight.dtype)


def merge_adapter(model: LlamaModel, adapter: Adapter) -> int:
    """Merge in place (an unfused float model); returns how many linears changed."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in adapter.updates:
            linear = modules[name]
            assert isinstance(linear, nn.Linear)
            linear.weight = nn.Parameter(merged_weight(adapter, name, linear.weight), requires_grad=False)
    return len(adapter.updates)


class MergedSource(FloatSource):
    """`base` with the adapter in `directory` merged into each linear as it is read: the
    merge a layer at a time, as merge_adapter does it to a whole model."""

    def __init__(self, base: FloatSource, directory: Path) -> None:
        super().__init__(base.config, f"{base.label}+{directory.name}")
        with torch.device("meta"):
            model = LlamaModel(base.config)  # the layers' shapes, to check the adapter against
        self.adapter = read_adapter(directory, model)
        self.base = base

    def names(self) -> list[str]:
        return self.base.names()

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        tensors = self.base.read(names)
        for name, tensor in tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in self.adapter.updates:
                tensors[name] = merged_weight(self.adapter, module, tensor)
        return tensors

    def write_side_files(self, out: Path) -> None:
        self.base.write_side_files(out)

    def describe(self) -> dict[str, Any]:
        """The manifest's account of the merge."""
        adapter = self.adapter
        return {
            "directory": adapter.directory.name,
            "linears": len(adapter.updates),
            "lora_alpha": adapter.config.get("lora_alpha"),
            "r": adapter.config.get("r"),
            "use_rslora": bool(adapter.config.get("use_rslora", False)),
            "base_quantization": adapter.base.to_dict() if adapter.base is not None else None,
        }


def adapter_inputs(directory: Path) -> dict[str, Any]:
    files = [directory / CONFIG, directory / WEIGHTS]
    if (directory / BASE_QUANTIZATION).is_file():
        files.append(directory / BASE_QUANTIZATION)
    return {f.name: file_sha256(f) for f in files}


def _build(src: Path, directory: Path, out: Path, progress: bool) -> dict[str, Any]:
    source = MergedSource(CheckpointSource(src), directory)
    return {**write_float_streamed(source, out, progress), "merged_adapter": source.describe()}


def merge_target(src: Path, src_inputs: dict[str, Any], directory: Path) -> tuple[Path, dict[str, Any]]:
    """Where the merge of `directory` into the checkpoint `src` (built from `src_inputs`)
    is cached, and its inputs; `src` need not be built."""
    inputs = {"source": src_inputs, "adapter": adapter_inputs(directory.resolve()), "merger": MERGER_VERSION}
    return src.parent / f"{src.name}-lora-{cache_key(inputs)}", inputs


def merge_checkpoint(src: Path, directory: Path, progress: bool = False) -> Path:
    """The base checkpoint with the adapter merged; cached by both's inputs."""
    source = read_manifest(src)
    if source is None:
        raise FileNotFoundError(f"{src} is not a built checkpoint (no manifest)")
    directory = directory.resolve()
    out, inputs = merge_target(src, source["inputs"], directory)
    return build_cached(out, inputs, lambda scratch: _build(src, directory, scratch, progress))
