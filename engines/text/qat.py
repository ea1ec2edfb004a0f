"""Quantization-aware training of a pruned model: the build step between 2:4 pruning and
AWQ's packing (models.qa.qat).

The float model is pruned as the one-shot build prunes it (the same calibration captures
and method, so the same masks and weights: engines/text/prune.py), then its decoder
linears are fine-tuned with the INT4 rounding in the forward pass: each linear computes
with fake_quantize(W * mask), the weight the INT4 model will use, and the rounding's
gradient is taken as the identity (the straight-through estimator, Bengio et al. 2013),
so W learns to sit where its rounded self serves the loss. The 2:4 mask is fixed: the
pruned weights enter the product multiplied by 0, so their gradient is 0, AdamW (with no
weight decay) never moves them, and they are set to 0 again after every step so that no
rounding of the optimizer's can leave one a hair from zero. Dense INT4 linears train the
same way without a mask; embeddings, norms and the output projection stay as they are.

The data: the adapter's own training examples (engines/text/clinic_data.py, answers
learned as engines/text/qlora.py learns them) where the build merges the clinic adapter,
mixed with windows of the general text corpus the calibration reads (engines/text/corpus.py:
the calibration split only, so perplexity is still measured on text no step saw). Both
ship with the code: the step runs offline.

Then the trained float model goes through the layer-at-a-time build as any source does
(engines/text/layerwise.py), its pruned linears marked "given" (the mask read from the
weights' zeros, not chosen again), so AWQ searches scales and clips for the trained
weights and the packing stores the same 2:4 format. The whole step is one cached build
(engines/cache.py), keyed by the source, the INT4 recipe and this recipe.

Gradient checkpointing (`recompute`): each decoder layer's activations are recomputed in
the backward pass instead of kept from the forward one, trading a second forward pass for
one layer's activations in place of all of them (bench/sparsity.py measures both). The
gradients are the same either way (tests/test_qat.py), so it is not part of the cache key.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from edge.text.kv.float_cache import KVCache
from edge.text.model.llama import DecoderLayer, LlamaModel
from edge.text.ops.int4 import fake_quantize, group_size_for
from edge.text.ops.sparse24 import kept_mask
from engines.text.corpus import calibration_text
from engines.text.float_source import FloatSource
from engines.text.qlora import lm_loss, padded
from engines.text.quantize import QuantRecipe, calibration_batches, linear_names, prune_layer, sample_plan

logger = logging.getLogger(__name__)

QAT_VERSION = 1
LOG_EVERY = 10  # steps between progress lines in the log


@dataclass(frozen=True)
class QATRecipe:
    """The training's settings (models.qa.qat)."""

    steps: int = 40
    batch: int = 4
    seq_len: int = 128
    lr: float = 1e-4
    # Of each batch's sequences, this share are general text, the rest the adapter's examples.
    general_fraction: float = 0.5
    seed: int = 0
    recompute: bool = True

    def to_dict(self) -> dict[str, Any]:
        """What decides the trained weights: the cache key's part (recompute changes only
        memory and time, not the result)."""
        out = asdict(self)
        del out["recompute"]
        return out


class FakeQuantLinear(nn.Module):
    """A linear that computes with its weight rounded to INT4 as the build will round it
    (group size, zero points), the rounding passed through by the straight-through
    estimator; `mask` (bool, True where kept) holds a 2:4 weight's pruned entries at 0."""

    def __init__(self, linear: nn.Linear, group_size: int, symmetric: bool, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().float().clone())
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.group_size = group_size
        self.symmetric = symmetric
        self.mask: torch.Tensor | None
        self.register_buffer("mask", mask, persistent=False)

    def effective(self) -> torch.Tensor:
        """The weight as trained: masked, the rounding a straight-through identity."""
        w = self.weight if self.mask is None else self.weight * self.mask
        with torch.no_grad():
            rounded = fake_quantize(w.detach(), self.group_size, symmetric=self.symmetric)
        return w + (rounded - w).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective().to(x.dtype), self.bias)

    @torch.no_grad()
    def apply_mask(self) -> None:
        if self.mask is not None:
            self.weight.mul_(self.mask)

    def to_linear(self) -> nn.Linear:
        out_features, in_features = self.weight.shape
        linear = nn.Linear(in_features, out_features, bias=self.bias is not None)
        with torch.no_grad():
            self.apply_mask()
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                assert linear.bias is not None
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)


def attach_fake_quant(model: LlamaModel, recipe: QuantRecipe) -> dict[str, FakeQuantLinear]:
    """Every decoder linear the recipe stores in INT4 replaced by its FakeQuantLinear (the
    pruned ones masked by their zeros); every other parameter frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: dict[str, FakeQuantLinear] = {}
    for name in linear_names(model):
        if recipe.kept(name):
            continue
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        weight = linear.weight.detach()
        group = group_size_for(weight.shape[1], recipe.group_for(name))
        mask = kept_mask(weight) if recipe.sparsity_for(name) is not None else None
        fq = FakeQuantLinear(linear, group, recipe.symmetric, mask)
        fq.apply_mask()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fq)
        wrapped[name] = fq
    return wrapped


def detach_fake_quant(model: LlamaModel) -> None:
    """Each FakeQuantLinear back to a plain linear holding its trained (masked) weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FakeQuantLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.to_linear())


def forward_logits(model: LlamaModel, ids: torch.Tensor, recompute: bool) -> torch.Tensor:
    """LlamaModel.forward_train's logits, each decoder layer's activations recomputed in
    the backward pass where `recompute`."""
    seq = ids.shape[1]
    cos = model.rope_cos[:seq].to(model.dtype)
    sin = model.rope_sin[:seq].to(model.dtype)
    x = model._embed(ids)
    tables = model._tables(cos, sin, slice(0, seq))
    for i, layer in enumerate(model.layers):
        if recompute:
            # Non-reentrant: the form torch recommends, and the one that gives the frozen
            # inputs' graph no special treatment.
            out = checkpoint(layer, x, *tables[i], None, None, 0, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            x = out
        else:
            x = layer(x, *tables[i], None, None, 0)
    logits: torch.Tensor = model._head(x)
    return logits


Sequence = tuple[list[int], list[int]]


def general_windows(tokenizer: Tokenizer, seq_len: int) -> list[Sequence]:
    """The calibration corpus cut into windows of seq_len tokens, every token learned."""
    ids = tokenizer.encode(calibration_text(), add_special_tokens=False).ids
    return [(ids[i : i + seq_len], ids[i : i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]


def adapter_sequences(tokenizer: Tokenizer) -> list[Sequence]:
    """The clinic adapter's training examples, answers learned (engines/text/qlora.encode),
    each whole: cut to seq_len, over a third of SmolLM2's would lose every answer token
    (a question with its passages runs to about 250 tokens)."""
    from engines.text.clinic_data import examples
    from engines.text.qlora import encode

    return [encode(tokenizer, ex) for ex in examples("train")]


def batches(
    general: list[Sequence], adapter: list[Sequence], recipe: QATRecipe, pad: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """recipe.steps batches of recipe.batch sequences, the mix as the recipe says (all
    general text where there are no adapter examples), drawn in an order the seed fixes."""
    rng = random.Random(recipe.seed)
    n_general = recipe.batch if not adapter else round(recipe.batch * recipe.general_fraction)
    if n_general and not general:
        raise ValueError("QAT needs general text of at least seq_len tokens")

    def draw(pool: list[Sequence], order: list[int], n: int) -> list[Sequence]:
        out = []
        for _ in range(n):
            if not order:
                order.extend(rng.sample(range(len(pool)), len(pool)))  # a new pass, reshuffled
            out.append(pool[order.pop()])
        return out

    g_order: list[int] = []
    a_order: list[int] = []
    made = []
    for _ in range(recipe.steps):
        chunk = draw(general, g_order, n_general) + draw(adapter, a_order, recipe.batch - n_general)
        made.append(padded(chunk, pad))
    return made


def train(
    model: LlamaModel,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    quant: QuantRecipe,
    recipe: QATRecipe,
    progress: bool = False,
) -> dict[str, Any]:
    """Fine-tune `model`'s INT4 linears in place on `data` (batches of ids and labels)
    with the INT4 rounding in the loop and the 2:4 masks fixed; returns the losses."""
    torch.manual_seed(recipe.seed)
    wrapped = attach_fake_quant(model, quant)
    params = [fq.weight for fq in wrapped.values()]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)  # decay would move nothing masked, but why risk it
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, len(data)) / max(len(data), 1)))
    )
    model.train()
    losses: list[float] = []
    started = time.monotonic()
    bar = tqdm(total=len(data), desc="qat", unit="step", disable=not progress)
    try:
        for step, (ids, labels) in enumerate(data, 1):
            loss = lm_loss(forward_logits(model, ids, recipe.recompute), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            for fq in wrapped.values():
                fq.apply_mask()
            losses.append(float(loss.detach()))
            bar.update(1)
            if step % LOG_EVERY == 0 or step == len(data):
                logger.info(
                    "qat step %d/%d: loss %.4f (%.1f s)", step, len(data), losses[-1], time.monotonic() - started
                )
    finally:
        bar.close()
        model.eval()
        detach_fake_quant(model)
    return {
        "steps": len(data),
        "first_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(sum(losses[-5:]) / len(losses[-5:]), 4) if losses else None,
        "train_seconds": round(time.monotonic() - started, 1),
        "trained_parameters": sum(p.numel() for p in params),
    }


def load_model(source: FloatSource) -> LlamaModel:
    """The whole float model of `source`, in float32 (the step trains it whole)."""
    model = LlamaModel(source.config)
    loaded = model.load_state_dict(source.read(source.names()), strict=False)
    missing = set(loaded.missing_keys) - ({"lm_head.weight"} if source.config.tie_embeddings else set())
    if missing or loaded.unexpected_keys:
        raise ValueError(f"{source.label}: missing {sorted(missing)[:5]}, unexpected {loaded.unexpected_keys[:5]}")
    return model.float().eval()


@torch.no_grad()
def prune_model(model: LlamaModel, tokenizer: Tokenizer, recipe: QuantRecipe) -> None:
    """Prune `model`'s linears that the recipe's rules name to 2:4, in place, as the
    layer-at-a-time build prunes them (its captures: each layer on the float model's
    activations before it, the same sampled rows), so the masks and weights are the
    one-shot build's."""
    from engines.text.layerwise import _capture_layer

    config = model.config
    ids = tokenizer.encode(calibration_text(), add_special_tokens=False).ids
    calib = list(calibration_batches(ids, recipe.seq_len, recipe.calib_tokens))
    xs = [model._embed(b).float() for b in calib]
    plan = sample_plan([b.numel() for b in calib], config.num_layers, recipe.sample_tokens)
    seq = xs[0].shape[1]
    tables = model._tables(model.rope_cos[:seq].float(), model.rope_sin[:seq].float(), slice(0, seq))
    cache = KVCache(config, 1, min(seq, config.max_position), torch.float32, torch.device("cpu"), window_sized=False)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        captures = _capture_layer(layer, i, xs, plan, tables[i], cache, config.num_heads, config.num_kv_heads, recipe)
        prune_layer(layer, i, captures, recipe, config.num_heads, config.num_kv_heads)
        del captures


def given_masks(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with every pruning rule's method "given": the packing build reads the
    trained weights' masks from their zeros instead of pruning again (which would move
    the trained weights: SparseGPT updates the ones it keeps)."""
    return replace(recipe, sparse=tuple((pattern, "given" if m else "") for pattern, m in recipe.sparse))


class ModelSource(FloatSource):
    """A model held in memory as a float source, its side files (config, tokenizer) those
    of the source it was loaded from."""

    def __init__(self, model: LlamaModel, side: FloatSource) -> None:
        super().__init__(side.config, f"{side.label} (qat)")
        self.side = side
        self.state = {k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}

    def names(self) -> list[str]:
        return self.side.names()

    def read(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        # Copies: the build rescales what it reads in place (AWQ).
        return {name: self.state[name].detach().float().clone() for name in names}

    def write_side_files(self, out: Path) -> None:
        self.side.write_side_files(out)


def write_qat(
    source: FloatSource,
    out: Path,
    quant: QuantRecipe,
    recipe: QATRecipe,
    adapter_data: bool,
    progress: bool,
) -> dict[str, Any]:
    """The INT4 checkpoint of `source` pruned, trained with the INT4 rounding in the loop,
    and packed (engines/text/layerwise.write_layerwise), into `out`; returns the manifest's
    description, with the training's figures."""
    from engines.text.layerwise import write_layerwise

    if not any(m for _p, m in quant.sparse):
        logger.info("%s: no 2:4 rule; QAT trains the dense INT4 linears", source.label)
    started = time.monotonic()
    model = load_model(source)
    source.write_side_files(out)  # the tokenizer, read from where the build reads it
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    prune_model(model, tokenizer, quant)
    logger.info("%s: pruned in %.0f s", source.label, time.monotonic() - started)
    general = general_windows(tokenizer, recipe.seq_len)
    adapter = adapter_sequences(tokenizer) if adapter_data else []
    pad = tokenizer.token_to_id("<|im_end|>") or 0
    stats = train(model, batches(general, adapter, recipe, pad), quant, recipe, progress)
    logger.info("%s: QAT %s", source.label, stats)
    given = given_masks(quant)
    recorded = {**quant.to_dict(), "qat": {**recipe.to_dict(), "adapter_data": adapter_data}}
    described = write_layerwise(ModelSource(model, source), out, given, progress, recorded=recorded)
    for name, layer in described["layers"].items():
        if layer.get("pruning") == "given":
            layer["pruning"] = quant.sparsity_for(name)
            layer["qat"] = True
    described["qat"] = stats
    return described
