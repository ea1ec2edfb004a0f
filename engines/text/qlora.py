"""QLoRA: train a low-rank adapter on a frozen 4-bit base, then merge it in.

The base's linear weights are held as INT4 groups (our own format) and dequantized on
the fly in each forward pass; only the adapter matrices A [r, in] and B [out, r] train.
Merging dequantizes the base once and adds (alpha / r) * B @ A, so the served model
carries no adapter and no extra latency.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from edge.config.text import DEFAULT_SYSTEM_PROMPT
from edge.text.model.checkpoint import load_checkpoint
from edge.text.model.llama import LlamaModel
from edge.text.ops.int4 import QuantizedWeight, dequantize, group_size_for, pack
from edge.text.prompt import chatml, user_message
from engines.text.clinic_data import Example, examples

logger = logging.getLogger(__name__)

QLORA_VERSION = 1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORE = -100


@dataclass(frozen=True)
class LoraRecipe:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05
    lr: float = 2e-3
    epochs: int = 4
    batch: int = 4
    base_group: int = 64
    seed: int = 0


class LoRALinear(nn.Module):
    """Frozen INT4 base weight plus a trainable low-rank update."""

    def __init__(self, base: QuantizedWeight, rank: int, alpha: int, dropout: float, gen: torch.Generator) -> None:
        super().__init__()
        out_features, in_features = base.shape
        self.base = base
        self.scale = alpha / rank
        # A starts random and B at zero, so training starts from the base model exactly.
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = dequantize(self.base, x.dtype)
        update: torch.Tensor = self.dropout(x) @ self.lora_a.T @ self.lora_b.T
        return x @ w.T + update * self.scale

    def merged_weight(self) -> torch.Tensor:
        with torch.no_grad():
            return dequantize(self.base) + self.scale * (self.lora_b @ self.lora_a)


def attach_adapters(model: LlamaModel, recipe: LoraRecipe) -> list[LoRALinear]:
    gen = torch.Generator().manual_seed(recipe.seed)
    adapters = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            weight = module.weight.detach().float()
            base = pack(weight, group_size_for(weight.shape[1], recipe.base_group))
            lora = LoRALinear(base, recipe.rank, recipe.alpha, recipe.dropout, gen)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lora)
            adapters.append(lora)
    for p in model.parameters():
        p.requires_grad_(False)
    for a in adapters:
        a.lora_a.requires_grad_(True)
        a.lora_b.requires_grad_(True)
    return adapters


def encode(tokenizer: Any, ex: Example, system: str = DEFAULT_SYSTEM_PROMPT) -> tuple[list[int], list[int]]:
    """Token ids and labels; only the answer (and its end-of-turn) is learned."""
    prompt = tokenizer.encode(chatml(system, user_message(ex.question, ex.context)), add_special_tokens=False).ids
    answer = tokenizer.encode(ex.answer + "<|im_end|>", add_special_tokens=False).ids
    return prompt + answer, [IGNORE] * len(prompt) + answer


def _batches(
    data: list[tuple[list[int], list[int]]], size: int, rng: random.Random, pad: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    order = list(range(len(data)))
    rng.shuffle(order)
    for i in range(0, len(order), size):
        yield padded([data[j] for j in order[i : i + size]], pad)


def padded(chunk: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's token ids and labels, each row padded to the longest (ids with `pad`,
    labels with IGNORE, which the loss skips)."""
    width = max(len(ids) for ids, _ in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
    for row, (x, y) in enumerate(chunk):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
    return ids, labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over the labelled positions (in float32)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )


def train(model: LlamaModel, tokenizer: Any, recipe: LoraRecipe, progress: bool = True) -> dict[str, Any]:
    adapters = attach_adapters(model, recipe)
    data = [encode(tokenizer, ex) for ex in examples("train")]
    params = [p for a in adapters for p in (a.lora_a, a.lora_b)]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    steps = recipe.epochs * math.ceil(len(data) / recipe.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(recipe.seed)
    torch.manual_seed(recipe.seed)
    pad = tokenizer.token_to_id("<|im_end|>")
    model.train()
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(total=steps, desc="qlora", unit="step", disable=not progress)
    for _ in range(recipe.epochs):
        for ids, labels in _batches(data, recipe.batch, rng, pad):
            logits = model.forward_train(ids)
            loss = lm_loss(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    return {
        "examples": len(data),
        "steps": steps,
        "first_loss": losses[0],
        "final_loss": sum(losses[-3:]) / min(3, len(losses)),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "trainable_params": sum(p.numel() for p in params),
    }


def merge(model: LlamaModel) -> None:
    """Replace every LoRALinear by a plain linear holding dequant(base) + scale * B @ A."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            w = module.merged_weight()
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight = nn.Parameter(w, requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)


# The clinic adapter as the repo ships it: a PEFT LoRA directory, so a first start merges
# it (seconds) instead of training it (minutes). `python -m engines.text.qlora --export DIR`
# trains it again and writes it, with its hash.
CLINIC_ADAPTER = Path(__file__).parent / "adapters" / "clinic"


def export_peft(model: LlamaModel, recipe: LoraRecipe, out: Path) -> dict[str, Any]:
    """The trained LoRA factors of `model` (before merge) as a PEFT adapter directory,
    with `base_quantization.json` naming the INT4 base they were trained against."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            key = f"base_model.model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = module.lora_a.detach().float().contiguous()
            tensors[f"{key}.lora_B.weight"] = module.lora_b.detach().float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "smollm2-135m-instruct",
        "r": recipe.rank,
        "lora_alpha": recipe.alpha,
        "lora_dropout": recipe.dropout,
        "target_modules": list(TARGETS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    base = {"format": "edge-int4", "group_size": recipe.base_group}
    (out / "base_quantization.json").write_text(json.dumps(base) + "\n", encoding="utf-8")
    return {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engines.cache import file_sha256, stop_on_sigterm
    from engines.text.import_gguf import import_smollm2

    parser = argparse.ArgumentParser(description="Train the clinic QLoRA adapter and write it as a PEFT directory.")
    parser.add_argument("--export", type=Path, default=CLINIC_ADAPTER, help="adapter directory to write")
    parser.add_argument("--engine-dir", type=Path, default=Path(".edge/engines"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = LoraRecipe()
    ckpt = load_checkpoint(import_smollm2(args.engine_dir, not args.no_progress), fuse=False)
    stats = train(ckpt.model, ckpt.tokenizer, recipe, not args.no_progress)
    written = export_peft(ckpt.model, recipe, args.export)
    provenance = {
        "command": "python -m engines.text.qlora --export " + str(args.export),
        "sha256": {"adapter_model.safetensors": file_sha256(args.export / "adapter_model.safetensors")},
        "recipe": asdict(recipe),
        "training": {k: v for k, v in stats.items() if k != "train_seconds"},
        **written,
    }
    (args.export / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(provenance["sha256"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
