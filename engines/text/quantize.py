"""INT4 weight quantization of a Llama checkpoint: round-to-nearest and AWQ.

AWQ (activation-aware weight quantization): input channels that carry large
activations matter more, so before rounding each linear's weights are multiplied per
input channel by s = mean|x|^alpha (the inverse folded into the previous operation,
so the float model is unchanged), with alpha searched per layer group to minimise
that group's output error on calibration activations. A second search then clips each
weight group's range where that lowers the output error. Round-to-nearest with the
same grouping is the baseline.

Layers a rule prunes to 2:4 (engines/text/prune.py) are pruned on the same calibration
captures before AWQ's searches, so the scales and clips are searched for the pruned
weights (AWQ's per-channel rescaling keeps a zero a zero), and are packed in the 2:4
format (edge/text/ops/sparse24.py). Quantization-aware training (engines/text/qat.py)
changes the pruned float weights with their mask fixed before AWQ: the packing reads the
mask back from the weights' zeros (the pruning method "given").
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from edge.text.model.llama import DecoderLayer, LlamaModel
from edge.text.ops.int4 import fake_quantize, group_size_for, pack
from edge.text.ops.sparse24 import PackedLinear, pack_sparse
from engines.text.prune import METHODS, Method, prune

logger = logging.getLogger(__name__)

ALPHA_GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5
CLIP_SKIP = ("q_proj", "k_proj")  # rotary dot products are sensitive to clipping


@dataclass(frozen=True)
class QuantRecipe:
    method: str = "awq"  # "awq" | "rtn"
    group_size: int = 128
    # Per-layer overrides, as module-name patterns (fnmatch: "*.self_attn.*", "lm_head"):
    # `keep` layers stay in floating point; `groups` are ordered rules (pattern, group
    # size), the first match deciding, a group size of 0 meaning floating point. Every
    # other layer is INT4 at group_size.
    keep: tuple[str, ...] = ()
    groups: tuple[tuple[str, int], ...] = ()
    calib_tokens: int = 8192
    sample_tokens: int = 512  # tokens used to score candidate scales and clips
    seq_len: int = 256
    clip: bool = True
    # The output projection reads vocab x hidden weights every token: on a small model it
    # is the largest matrix by far (SmolLM2: 113 MB in float32 of 135M params). Rounded to
    # INT4 (a copy when tied to the embedding, which stays float for lookups).
    lm_head: bool = True
    # Zero points fixed at 8 (edge/text/ops/int4.py quantize_codes): what TensorRT takes.
    symmetric: bool = False
    # Ordered rules (pattern, pruning method or "" for dense), the first match deciding, as
    # `groups`: a layer whose first match names a method is pruned to 2:4 by it.
    sparse: tuple[tuple[str, str], ...] = ()

    def sparsity_for(self, name: str) -> Method | None:
        """The method that prunes linear `name` to 2:4, or None (dense)."""
        method = next((m for pattern, m in self.sparse if fnmatch.fnmatchcase(name, pattern)), "")
        if not method:
            return None
        if method not in METHODS:
            raise ValueError(f"unknown pruning method {method!r}")
        return method

    @property
    def calibrates(self) -> bool:
        """Whether the build runs calibration activations: for AWQ, or for a pruned layer."""
        return self.method == "awq" or any(m for _p, m in self.sparse)

    def _rule(self, name: str) -> int | None:
        return next((g for pattern, g in self.groups if fnmatch.fnmatchcase(name, pattern)), None)

    def kept(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep) or self._rule(name) == 0

    def group_for(self, name: str) -> int:
        return self._rule(name) or self.group_size

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "group_size": self.group_size,
            "keep": list(self.keep),
            "calib_tokens": self.calib_tokens,
            "sample_tokens": self.sample_tokens,
            "seq_len": self.seq_len,
            "clip": self.clip,
            "lm_head": self.lm_head,
        }
        if self.groups:  # only then: the key of every build without them stays as it was
            out["groups"] = [[pattern, g] for pattern, g in self.groups]
        if self.symmetric:  # likewise
            out["symmetric"] = True
        if any(m for _p, m in self.sparse):  # likewise
            out["sparse"] = [[pattern, m] for pattern, m in self.sparse]
        return out


@dataclass
class QuantReport:
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)


def _weight(module: nn.Module) -> torch.Tensor:
    """The weight tensor of a linear or norm, for in-place rescaling."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.data


def linear_names(model: LlamaModel) -> list[str]:
    names = []
    for i in range(model.config.num_layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            names.append(f"layers.{i}.{part}")
        for part in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names.append(f"layers.{i}.{part}")
    return names


@dataclass
class _Capture:
    """Per-channel mean |x| over all calibration tokens, plus a fixed token sample; for 2:4
    pruning the per-channel sum of squares (Wanda's norms) and, where asked, X^T X over all
    tokens (SparseGPT's Hessian: [K, K] float32, so only for the inputs it prunes)."""

    abs_sum: torch.Tensor | None = None
    count: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)
    sampled: int = 0
    hessian_wanted: bool = False
    norms_wanted: bool = False
    sq_sum: torch.Tensor | None = None
    gram: torch.Tensor | None = None

    def add(self, x: torch.Tensor, keep_tokens: int, generator: torch.Generator) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        idx = None
        if self.sampled < keep_tokens:
            take = min(keep_tokens - self.sampled, max(1, flat.shape[0] // 4))
            idx = torch.randperm(flat.shape[0], generator=generator)[:take]
        self._add(flat, idx)

    def add_sampled(self, x: torch.Tensor, idx: torch.Tensor | None) -> None:
        """As `add`, with the sample's rows drawn beforehand (sample_plan)."""
        self._add(x.detach().reshape(-1, x.shape[-1]).float(), idx)

    def _add(self, flat: torch.Tensor, idx: torch.Tensor | None) -> None:
        s = flat.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        if self.norms_wanted:
            sq = flat.square().sum(0)
            self.sq_sum = sq if self.sq_sum is None else self.sq_sum + sq
        if self.hessian_wanted:
            gram = flat.T @ flat
            self.gram = gram if self.gram is None else self.gram + gram
        self.count += flat.shape[0]
        if idx is not None:
            self.sample.append(flat[idx].clone())
            self.sampled += idx.numel()

    @property
    def mean_abs(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return self.abs_sum / self.count

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.sample)

    @property
    def input_norm(self) -> torch.Tensor:
        """Each input channel's L2 norm over all calibration tokens."""
        assert self.sq_sum is not None
        return self.sq_sum.sqrt()


def new_capture(layer_index: int, members: list[str], recipe: QuantRecipe) -> _Capture:
    """The capture of one input group of decoder layer `layer_index`: with the Hessian
    where one of its linears is pruned by SparseGPT, the input norms where one is by Wanda
    (neither for a dense build, whose AWQ reads the mean magnitudes and the sample only)."""
    methods = {recipe.sparsity_for(f"layers.{layer_index}.{m}") for m in members}
    return _Capture(hessian_wanted="sparsegpt" in methods, norms_wanted="wanda" in methods)


def _groups(layer: DecoderLayer, n_heads: int, n_kv: int) -> list[tuple[str, list[str], nn.Module | None]]:
    """Linears sharing one input, and the operation whose output that input is."""
    groups: list[tuple[str, list[str], nn.Module | None]] = [
        ("self_attn.q_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], layer.input_layernorm),
        # With grouped-query attention, o_proj's input channels repeat v_proj's outputs
        # across heads, so a per-channel scale cannot be folded back: search none.
        ("self_attn.o_proj", ["self_attn.o_proj"], layer.self_attn.v_proj if n_heads == n_kv else None),
        ("mlp.gate_proj", ["mlp.gate_proj", "mlp.up_proj"], layer.post_attention_layernorm),
        ("mlp.down_proj", ["mlp.down_proj"], layer.mlp.up_proj),
    ]
    return groups


GROUPS_PER_LAYER = 4  # _groups' entries, each one capture


def sample_plan(batch_tokens: list[int], layers: int, keep_tokens: int) -> list[list[torch.Tensor]]:
    """The rows each capture samples from each calibration batch, [batch][layer * 4 + group],
    as capture_inputs draws them: one generator, drawn from in the order the whole
    model's forward passes reach the captures (every capture of batch 0, layer by layer,
    then batch 1's). A build that runs the batches through one layer at a time draws
    them here first and samples the same rows."""
    gen = torch.Generator().manual_seed(0)
    plan: list[list[torch.Tensor]] = []
    sampled = 0
    for tokens in batch_tokens:
        if sampled >= keep_tokens:
            break
        take = min(keep_tokens - sampled, max(1, tokens // 4))
        plan.append([torch.randperm(tokens, generator=gen)[:take] for _ in range(layers * GROUPS_PER_LAYER)])
        sampled += take
    return plan


def calibration_batches(token_ids: list[int], seq_len: int, total: int) -> Iterator[torch.Tensor]:
    usable = min(total, len(token_ids)) // seq_len * seq_len
    if usable == 0:
        raise ValueError(f"need at least {seq_len} calibration tokens, got {len(token_ids)}")
    ids = torch.tensor(token_ids[:usable]).reshape(-1, seq_len)
    for row in ids:
        yield row.unsqueeze(0)


def capture_inputs(
    model: LlamaModel,
    batches: Iterable[torch.Tensor],
    sample_tokens: int,
    progress: bool,
    recipe: QuantRecipe | None = None,
) -> dict[str, _Capture]:
    captures: dict[str, _Capture] = {}
    gen = torch.Generator().manual_seed(0)
    hooks = []
    modules = dict(model.named_modules())
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        for first, members, _prev in _groups(layer, model.config.num_heads, model.config.num_kv_heads):
            name = f"layers.{i}.{first}"
            cap = captures.setdefault(name, new_capture(i, members, recipe or QuantRecipe()))

            def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], cap: _Capture = cap) -> None:
                cap.add(args[0], sample_tokens, gen)

            hooks.append(modules[name].register_forward_pre_hook(hook))
    try:
        batch_list = list(batches)
        for ids in tqdm(batch_list, desc="calibrate", unit="seq", disable=not progress):
            cache = model.new_cache(1, ids.shape[1], window_sized=False)  # each sequence in one pass
            model(ids, cache, 0)
    finally:
        for h in hooks:
            h.remove()
    return captures


def _output_error(x: torch.Tensor, weights: list[torch.Tensor], approx: list[torch.Tensor]) -> float:
    err = 0.0
    for w, a in zip(weights, approx, strict=True):
        err += float(((x @ (a - w).T) ** 2).mean())
    return err


def search_scales(
    x: torch.Tensor, mean_abs: torch.Tensor, weights: list[torch.Tensor], group_size: int, symmetric: bool = False
) -> torch.Tensor:
    """Per-input-channel scales s minimising ||x W^T - x (Q(W s)/s)^T||."""
    best_err, best = math.inf, torch.ones_like(mean_abs)
    base = mean_abs.clamp(min=1e-4)
    for step in range(ALPHA_GRID):
        alpha = step / ALPHA_GRID
        s = base.pow(alpha)
        s = s / torch.sqrt(s.max() * s.min())
        approx = [fake_quantize(w * s, group_size, symmetric=symmetric) / s for w in weights]
        err = _output_error(x, weights, approx)
        if err < best_err:
            best_err, best = err, s
    return best


def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int, symmetric: bool = False) -> torch.Tensor:
    """Per (output row, group) range ratio minimising that group's share of output error.

    A group's error is the mean over tokens of (x_g . delta)^2 = delta^T G_g delta / T,
    with G_g = x_g^T x_g: one [group_size, group_size] matrix per group, built once,
    instead of every token's product for every candidate ratio (16x less arithmetic at
    512 tokens and groups of 32). float64, so the quadratic form ranks the candidates as
    the per-token sums would.
    """
    n, k = weight.shape
    groups = k // group_size
    xg = x.double().reshape(x.shape[0], groups, group_size).transpose(0, 1)  # [g, t, c]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [g, c, c]
    best_err = torch.full((n, groups), math.inf, dtype=torch.float64)
    best = torch.ones(n, groups)
    for ratio in CLIP_RATIOS:
        clip = torch.full((n, groups), ratio)
        delta = (fake_quantize(weight, group_size, clip, symmetric) - weight).double().reshape(n, groups, group_size)
        delta = delta.transpose(0, 1)  # [g, n, c]
        err = (torch.bmm(delta, gram) * delta).sum(-1).transpose(0, 1)  # [n, g]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


def check_sparse_rules(recipe: QuantRecipe) -> None:
    """Raises where a rule prunes what the build does not: the output projection (no
    calibration capture reaches it, and the CPU's exact top-logit refinement reads the
    dense layout)."""
    if recipe.sparsity_for("lm_head") is not None:
        raise ValueError("the output projection is not pruned: no rule may give lm_head 2:4 sparsity")


def prune_layer(
    layer: DecoderLayer, i: int, captures: dict[str, _Capture], recipe: QuantRecipe, n_heads: int, n_kv: int
) -> dict[str, str]:
    """Prune decoder layer `i`'s linears that the recipe's rules name to 2:4, in place, on
    their calibration captures; returns the method of each, by module name."""
    pruned: dict[str, str] = {}
    for first, members, _prev in _groups(layer, n_heads, n_kv):
        cap = captures[f"layers.{i}.{first}"]
        for member in members:
            name = f"layers.{i}.{member}"
            method = recipe.sparsity_for(name)
            if method is None:
                continue
            if recipe.kept(name):
                raise ValueError(f"{name}: a layer kept in float is not pruned (2:4 is an INT4 format here)")
            weight = _weight(layer.get_submodule(member))
            hessian = cap.gram if method == "sparsegpt" else None
            norms = cap.input_norm if method == "wanda" else None
            weight.copy_(prune(method, weight.float(), norms, hessian).to(weight.dtype))
            pruned[name] = method
    return pruned


def awq_layer(
    layer: DecoderLayer, i: int, captures: dict[str, _Capture], recipe: QuantRecipe, n_heads: int, n_kv: int
) -> dict[str, torch.Tensor]:
    """AWQ's searches for decoder layer `i` on its calibration captures: the scales are
    folded into `layer` in place (a float-exact change); returns the clip ratios found,
    by module name."""
    clips: dict[str, torch.Tensor] = {}
    for first, members, prev in _groups(layer, n_heads, n_kv):
        names = [f"layers.{i}.{m}" for m in members]
        if any(recipe.kept(n) for n in names):
            continue
        cap = captures[f"layers.{i}.{first}"]
        linears = [layer.get_submodule(m) for m in members]
        weights = [_weight(lin).float() for lin in linears]
        k = weights[0].shape[1]
        g = group_size_for(k, recipe.group_for(names[0]))
        x = cap.x
        if prev is not None:
            s = search_scales(x, cap.mean_abs, weights, g, recipe.symmetric)
            for lin in linears:
                _weight(lin).mul_(s.to(_weight(lin).dtype))
            prev_w = _weight(prev)
            prev_w.div_(s.to(prev_w.dtype).view(-1, *([1] * (prev_w.dim() - 1))))
            prev_bias = getattr(prev, "bias", None)
            if isinstance(prev, nn.Linear) and prev_bias is not None:
                prev_bias.data.div_(s.to(prev_bias.dtype))  # v_proj's outputs, bias included
            x = x / s
        del weights
        for name, lin in zip(names, linears, strict=True):
            if recipe.clip and not name.endswith(CLIP_SKIP):
                group = group_size_for(k, recipe.group_for(name))
                clips[name] = search_clip(x, _weight(lin).float(), group, recipe.symmetric)
    return clips


def pack_linear(
    name: str, weight: torch.Tensor, recipe: QuantRecipe, clip: torch.Tensor | None, report: QuantReport
) -> PackedLinear:
    """The linear's INT4 weight: in the 2:4 format where the recipe pruned it."""
    g = group_size_for(weight.shape[1], recipe.group_for(name))
    report.layers[name] = {"bits": 4, "group_size": g, "clipped": clip is not None}
    method = recipe.sparsity_for(name)
    if method is not None:
        report.layers[name].update({"sparsity": "2:4", "pruning": method})
        return pack_sparse(weight.float(), g, clip, recipe.symmetric)
    return pack(weight.float(), g, clip, recipe.symmetric)


def quantize_model(
    model: LlamaModel, recipe: QuantRecipe, calib_ids: list[int] | None, progress: bool = True
) -> tuple[dict[str, PackedLinear], QuantReport]:
    """Quantize every linear not kept by the recipe. AWQ rescales `model` in place
    (a float-exact change) before rounding; returns the packed weights by module name.

    The whole model at once: engines/text/layerwise.py does the same a decoder layer at a
    time (what a build runs), and is held to this one bit for bit (tests/test_build_memory.py)."""
    modules = dict(model.named_modules())
    report = QuantReport()
    clips: dict[str, torch.Tensor] = {}
    check_sparse_rules(recipe)
    if recipe.calibrates:
        if not calib_ids:
            raise ValueError("AWQ and pruning need calibration tokens")
        batches = calibration_batches(calib_ids, recipe.seq_len, recipe.calib_tokens)
        captures = capture_inputs(model, batches, recipe.sample_tokens, progress, recipe)
        layers = list(enumerate(model.layers))
        heads, kv_heads = model.config.num_heads, model.config.num_kv_heads
        for i, layer in tqdm(layers, desc="awq search", unit="layer", disable=not progress):
            assert isinstance(layer, DecoderLayer)
            prune_layer(layer, i, captures, recipe, heads, kv_heads)
            if recipe.method == "awq":
                clips.update(awq_layer(layer, i, captures, recipe, heads, kv_heads))
    packed: dict[str, PackedLinear] = {}
    for name in linear_names(model):
        if recipe.kept(name):
            report.layers[name] = {"bits": 16}
            continue
        packed[name] = pack_linear(name, _weight(modules[name]), recipe, clips.get(name), report)
    if recipe.lm_head and not recipe.kept("lm_head"):
        weight = _weight(model.lm_head).float()
        g = group_size_for(weight.shape[1], recipe.group_for("lm_head"))
        packed["lm_head"] = pack(weight, g, symmetric=recipe.symmetric)
        report.layers["lm_head"] = {"bits": 4, "group_size": g, "clipped": False}
    return packed, report
