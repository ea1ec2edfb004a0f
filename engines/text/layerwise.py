"""The INT4 build a decoder layer at a time, straight from the float source.

What `edgectl build` runs for an INT4 text engine: the source (a Hugging Face directory,
a GGUF file, a float checkpoint of ours, with an adapter merged as its tensors are read:
engines/text/float_source.py) is read one decoder layer at a time; AWQ runs on that
layer alone, on the calibration activations carried from the layer before; its linears
are packed and written to their place in the INT4 checkpoint (engines/text/safetensors_writer.py),
and the layer is let go before the next is read. So the build holds one float layer, the
calibration activations and AWQ's working copies of one group of linears: never the
float model, nor the INT4 one.

The numbers are those of engines/text/quantize.py's quantize_model on the whole model,
bit for bit (tests/test_build_memory.py): the calibration activations a layer sees are the
float model's (each layer runs on the previous float layer's outputs, before AWQ
rescales it, as the whole model's one forward pass computes them), and each capture
samples the rows the whole model's pass would have sampled (quantize.sample_plan).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from edge.text.kv.float_cache import KVCache
from edge.text.model.llama import DecoderLayer, LlamaModel
from edge.text.ops.int4 import QuantizedWeight, concat_rows, group_size_for, pack
from edge.text.ops.sparse24 import SPARSITY, PackedLinear, Sparse24Weight, stored_specs
from engines.text.corpus import calibration_text
from engines.text.float_source import FloatSource
from engines.text.quantize import (
    GROUPS_PER_LAYER,
    QuantRecipe,
    QuantReport,
    _Capture,
    _groups,
    awq_layer,
    calibration_batches,
    check_sparse_rules,
    linear_names,
    new_capture,
    pack_linear,
    prune_layer,
    sample_plan,
)
from engines.text.safetensors_writer import SafetensorsWriter, Spec

logger = logging.getLogger(__name__)

# The output projection is rounded this many rows at a time: rounding works row by row,
# and a whole 128k-row head's working copies would be the build's largest allocation.
HEAD_ROWS = 8192


def _packed_groups(model: LlamaModel, recipe: QuantRecipe, prepacked: Mapping[str, QuantizedWeight]) -> dict[str, int]:
    """The linears stored in INT4, with their group sizes, in quantize_model's order."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[str, int] = {}
    for name in [*linear_names(model), "lm_head"]:
        shape = shapes[f"{name}.weight"]
        if name in prepacked:
            # Its shape from the file's tensor list where the mapping has one (KeptWeights):
            # each weight is then read once, when it is written.
            header = getattr(prepacked, "header", None)
            if header is not None:
                given_shape, group = header(name)
            else:
                given = prepacked[name]
                given_shape, group = given.shape, given.group_size
                del given
            if tuple(given_shape) != shape:
                raise ValueError(f"{name} is {list(given_shape)} as given, {list(shape)} in the model's config")
            groups[name] = group
        elif name == "lm_head" and not recipe.lm_head:
            continue
        elif not recipe.kept(name):
            groups[name] = group_size_for(shape[1], recipe.group_for(name))
    return groups


def _kept_with(prepacked: Mapping[str, QuantizedWeight], groups: dict[str, int], form: str) -> set[str]:
    """The given linears kept in `form`: "minimums" (block minimums, a GGUF file's Q4_1
    weights) or "halves" (two INT4 halves, a GGUF file's Q8_0 weights)."""
    told = getattr(prepacked, f"has_{form}", None)  # KeptWeights: from the file's tensor list
    names = [n for n in groups if n in prepacked]
    if told is not None:
        return {n for n in names if told(n)}
    if form == "minimums":
        return {n for n in names if prepacked[n].minimums is not None}
    return {n for n in names if prepacked[n].halves}


def _specs(
    model: LlamaModel, groups: dict[str, int], minimums: set[str], halves: set[str], sparse: set[str]
) -> dict[str, Spec]:
    """Every tensor of the INT4 checkpoint, as engines/text/int4_checkpoint.save_int4 writes
    them: the packed linears' codes, scales and zeros (and block minimums, where given;
    twice the rows for a weight in halves; the 2:4 format's tensors for a `sparse` one),
    every other tensor in float16."""
    specs: dict[str, Spec] = {}
    for name, tensor in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        if name == "lm_head.weight" and model.config.tie_embeddings and module not in groups:
            continue  # a float head tied to the embeddings is the embeddings
        if module in sparse and kind == "weight":
            rows, cols = tensor.shape
            specs.update(stored_specs(module, rows, cols, groups[module]))
            continue
        if module in groups and kind == "weight":
            n, k = tensor.shape
            n *= 2 if module in halves else 1
            g = groups[module]
            specs[f"{module}.qweight"] = (torch.uint8, (n, k // 2))
            specs[f"{module}.scales"] = (torch.float16, (n, k // g))
            specs[f"{module}.zeros"] = (torch.uint8, (n, k // g))
            if module in minimums:
                specs[f"{module}.minimums"] = (torch.float16, (n, k // g))
            continue
        specs[name] = (torch.float16, tuple(tensor.shape))
    return specs


def _pack_rows(weight: torch.Tensor, group: int, symmetric: bool) -> QuantizedWeight:
    """pack() of `weight`, HEAD_ROWS rows at a time (the same codes: rounding is per row)."""
    parts = [pack(weight[r : r + HEAD_ROWS], group, symmetric=symmetric) for r in range(0, weight.shape[0], HEAD_ROWS)]
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def write_layerwise(
    source: FloatSource,
    out: Path,
    recipe: QuantRecipe,
    progress: bool,
    prepacked: Mapping[str, QuantizedWeight] | None = None,
    recorded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The INT4 checkpoint of `source` under `recipe` into `out`; returns the manifest's
    description of it. `prepacked`: linears already in INT4 (a GGUF file's Q4_0 weights),
    stored as given in place of rounding them; `recorded`: the recipe the manifest names,
    if not `recipe`'s own."""
    config = source.config
    prepacked = prepacked or {}
    started = time.monotonic()
    source.write_side_files(out)
    with torch.device("meta"):
        model = LlamaModel(config)  # shapes, the rotary tables and the embedding's scale; no weights
    groups = _packed_groups(model, recipe, prepacked)
    check_sparse_rules(recipe)
    # Pruned to 2:4 and packed so: the linears a rule names that are not given in INT4.
    sparse = {name for name in groups if name not in prepacked and recipe.sparsity_for(name) is not None}
    report = QuantReport()
    heads, kv_heads = config.num_heads, config.num_kv_heads
    with_minimums = _kept_with(prepacked, groups, "minimums")
    with_halves = _kept_with(prepacked, groups, "halves")
    specs = _specs(model, groups, with_minimums, with_halves, sparse)
    writer = SafetensorsWriter(out / "model.safetensors", specs)

    def put_packed(name: str, q: PackedLinear) -> None:
        if isinstance(q, Sparse24Weight) != (name in sparse):
            raise ValueError(f"{name}: its 2:4 format does not agree with its header")
        if isinstance(q, Sparse24Weight):
            for key, tensor in q.stored(name).items():
                writer.write(key, tensor)
            return
        if (q.minimums is not None) != (name in with_minimums):
            raise ValueError(f"{name}: its block minimums do not agree with its header")
        if q.halves != (name in with_halves):
            raise ValueError(f"{name}: its halves do not agree with its header")
        for key, tensor in q.stored(name).items():
            writer.write(key, tensor)

    def put_float(name: str, tensor: torch.Tensor) -> None:
        # Norms and embeddings stay float; fp16 halves their bytes at no cost in accuracy.
        writer.write(name, tensor.detach().to(torch.float16).contiguous())

    with writer, torch.inference_mode():
        # The token table and the output projection are the largest tensors (an 8B
        # model's are 2 GB each in float32): read one at a time, each let go when written.
        embed = source.read(["embed_tokens.weight"])["embed_tokens.weight"]
        xs: list[torch.Tensor] = []
        plan: list[list[torch.Tensor]] = []
        if recipe.calibrates:
            tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
            ids = tokenizer.encode(calibration_text(), add_special_tokens=False).ids
            if not ids:
                raise ValueError("AWQ and pruning need calibration tokens")
            batches = list(calibration_batches(ids, recipe.seq_len, recipe.calib_tokens))
            model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
            # The residual stream in float32, as LlamaModel.forward keeps it.
            xs = [model._embed(batch).float() for batch in batches]
            plan = sample_plan([b.numel() for b in batches], config.num_layers, recipe.sample_tokens)
            logger.info("%s: %d calibration tokens embedded", source.label, sum(b.numel() for b in batches))
        model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device="meta")
        put_float("embed_tokens.weight", embed)
        tied = embed if config.tie_embeddings else None
        del embed
        if "lm_head" in prepacked:
            put_packed("lm_head", prepacked["lm_head"])
            report.layers["lm_head"] = {"bits": 4, "group_size": groups["lm_head"], "clipped": False}
        elif "lm_head" in groups or tied is None:
            head = tied if tied is not None else source.read(["lm_head.weight"])["lm_head.weight"]
            if "lm_head" in groups:
                put_packed("lm_head", _pack_rows(head, groups["lm_head"], recipe.symmetric))
                report.layers["lm_head"] = {"bits": 4, "group_size": groups["lm_head"], "clipped": False}
            else:
                put_float("lm_head.weight", head)
            del head
        del tied
        rest = [n for n in source.top_names() if n not in ("embed_tokens.weight", "lm_head.weight")]
        for name, tensor in source.read(rest).items():
            put_float(name, tensor)
        logger.info("%s: token table and output projection written", source.label)

        tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        cache = None
        if xs:
            seq = xs[0].shape[1]
            cos = model.rope_cos[:seq].to(torch.float32)
            sin = model.rope_sin[:seq].to(torch.float32)
            tables = model._tables(cos, sin, slice(0, seq))
            # One batch row of keys and values per layer, as a whole model's cache lays them out.
            # Every position of every layer: a calibration sequence is written whole.
            cache = KVCache(
                config, 1, min(seq, config.max_position), torch.float32, torch.device("cpu"), window_sized=False
            )
            if seq > cache.max_len:
                raise ValueError(f"sequence of {seq} tokens exceeds the cache ({cache.max_len})")
        layer_rows = tqdm(range(config.num_layers), desc=f"quantize {source.label}", unit="layer", disable=not progress)
        for i in layer_rows:
            layer_started = time.monotonic()
            prefix = f"layers.{i}."
            wanted = source.layer_names(i)
            if cache is None:  # no AWQ: a linear given in INT4 is not read in float too
                wanted = [n for n in wanted if n.removesuffix(".weight") not in prepacked]
            skipped = {n.removeprefix(prefix) for n in source.layer_names(i)} - {n.removeprefix(prefix) for n in wanted}
            state = {name.removeprefix(prefix): t for name, t in source.read(wanted).items()}
            with torch.device("meta"):
                layer = DecoderLayer(config, i)
            # The given linears' weights stay on the meta device (written from `prepacked`);
            # anything else missing is the source's fault, as with strict loading.
            loaded = layer.load_state_dict(state, strict=False, assign=True)
            if set(loaded.missing_keys) != skipped or loaded.unexpected_keys:
                raise ValueError(
                    f"layer {i}: missing {sorted(set(loaded.missing_keys) - skipped)[:5]}, "
                    f"unexpected {loaded.unexpected_keys[:5]}"
                )
            layer.eval()
            del state
            clips: dict[str, torch.Tensor] = {}
            if cache is not None:
                captures = _capture_layer(layer, i, xs, plan, tables[i], cache, heads, kv_heads, recipe)
                prune_layer(layer, i, captures, recipe, heads, kv_heads)
                if recipe.method == "awq":
                    clips = awq_layer(layer, i, captures, recipe, heads, kv_heads)
                del captures
            for name in [n for n in linear_names(model) if n.startswith(prefix)]:
                if name in prepacked:
                    put_packed(name, prepacked[name])
                    report.layers[name] = {"bits": 4, "group_size": groups[name], "clipped": False}
                elif name in groups:
                    weight = layer.get_submodule(name.removeprefix(prefix)).weight
                    assert isinstance(weight, torch.Tensor)
                    put_packed(name, pack_linear(name, weight.data, recipe, clips.get(name), report))
                else:
                    report.layers[name] = {"bits": 16}
            for name, tensor in layer.state_dict().items():
                module, _, kind = f"{prefix}{name}".rpartition(".")
                if not (module in groups and kind == "weight"):
                    put_float(f"{prefix}{name}", tensor)
            # The loops' last weight and tensor point into the layer: gone with it, not held
            # through the next layer's AWQ (one float linear more at the peak).
            weight = tensor = torch.empty(0)
            del layer, clips, weight, tensor
            logger.info(
                "%s: layer %d/%d quantized in %.1f s",
                source.label,
                i + 1,
                config.num_layers,
                time.monotonic() - layer_started,
            )
    # quantize_model's order: the layers, then the output projection.
    layers = {name: report.layers[name] for name in [*linear_names(model), "lm_head"] if name in report.layers}
    linears = {name: {"group_size": g, "bits": 4, **({"halves": True} if name in with_halves else {}),
                      **({"sparsity": SPARSITY} if name in sparse else {})}
               for name, g in groups.items()}  # fmt: skip
    (out / "quant.json").write_text(json.dumps({"linears": linears}, indent=1) + "\n", encoding="utf-8")
    logger.info("%s: INT4 checkpoint written in %.0f s", source.label, time.monotonic() - started)
    return {
        "kind": "llama-int4",
        "recipe": recorded if recorded is not None else recipe.to_dict(),
        "layers": layers,
        "weight_bytes": writer.nbytes,
        "kv_bytes_per_token_fp16": config.kv_bytes_per_token(torch.float16),
    }


def _capture_layer(
    layer: DecoderLayer,
    i: int,
    xs: list[torch.Tensor],
    plan: list[list[torch.Tensor]],
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    heads: int,
    kv_heads: int,
    recipe: QuantRecipe,
) -> dict[str, _Capture]:
    """Run every calibration batch through float layer `i`, its input groups' inputs
    captured on the way; each batch's activations are replaced by the layer's outputs,
    the next layer's inputs."""
    captures: dict[str, _Capture] = {}
    batch = 0
    hooks = []
    for j, (first, members, _prev) in enumerate(_groups(layer, heads, kv_heads)):
        cap = captures.setdefault(f"layers.{i}.{first}", new_capture(i, members, recipe))
        slot = i * GROUPS_PER_LAYER + j

        def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], cap: _Capture = cap, slot: int = slot) -> None:
            cap.add_sampled(args[0], plan[batch][slot] if batch < len(plan) else None)

        hooks.append(layer.get_submodule(first).register_forward_pre_hook(hook))
    k_cache, v_cache = cache.layer(i)
    try:
        for batch in range(len(xs)):
            xs[batch] = layer(xs[batch], *rope, k_cache, v_cache, 0)
    finally:
        for h in hooks:
            h.remove()
    return captures
