"""The CPU's decode step: every layer in one call of our C kernel (ops/cpu/cpu_step.c)
where the model is Llama's graph (with whatever options of today's families it sets,
IMPLEMENTED) over INT4 products of our kernels (float32 or int8 activations; q, k and v
fused or apart, a GGUF file's Q8_0 weights in their two INT4 halves), else the model's
own step, op by op.

Op by op, a step of SmolLM2-135M is about 5,500 torch operators; their dispatch, not
their arithmetic, was a third of the step at two threads. The kernel runs the same
arithmetic (the same INT4 products, float32 elsewhere) in one call; the embedding
before it and the final norm and head after it stay torch's (one operator each, the head
being most of a step's bytes)."""

from __future__ import annotations

import logging
import weakref

import torch

from edge.text.kv.float_cache import KVCache
from edge.text.model.llama import DecoderLayer, LlamaModel, RMSNorm
from edge.text.ops import sparse24
from edge.text.ops.cpu import cpu_step
from edge.text.ops.int4 import Int4Linear
from edge.text.ops.sparse24 import Sparse24Linear

logger = logging.getLogger(__name__)

# The family options (LlamaConfig.family_options, by their first word) the C step takes:
# Qwen3's q/k head norms, a sliding window (Mistral's, Phi-3's), Gemma 3's options and
# Phi-4-mini's partial rotary; the embedding's scale and the logits' cap are the
# embedding's and the head's, around it.
IMPLEMENTED = (
    "qk_norm",
    "sliding_window",
    "rope_local_theta",
    "mlp_activation",
    "embedding_scale",
    "output_norms",
    "attention_scale",
    "final_logit_softcap",
    "rotary_dim",
)
# A layer's projections where the loader did not fuse them (llama.py's names), in the
# order of their outputs in the fused product.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# Each model's layout for the kernel, made on its first step; or why it cannot serve it.
_plans: weakref.WeakKeyDictionary[LlamaModel, cpu_step.Plan | str] = weakref.WeakKeyDictionary()


def refusal(model: LlamaModel) -> str | None:
    """Why the kernel cannot run this model's step, by name; None where it can."""
    config = model.config
    options = [name for name in config.family_options() if name.split()[0] not in IMPLEMENTED]
    if options:
        return f"it does not implement {', '.join(options)}"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"it runs float32 on the CPU, not {model.dtype} on {model.device.type}"
    if config.head_dim % 2 or config.head_dim > cpu_step.MAX_HEAD_DIM:
        return f"head size {config.head_dim}: it takes even sizes up to {cpu_step.MAX_HEAD_DIM}"
    for i, layer in enumerate(model.layers):
        if not isinstance(layer, DecoderLayer):
            return f"layer {i} is not a decoder layer"
        for name, parts in _products(layer).items():
            for part in parts:
                if isinstance(part, Sparse24Linear):
                    # Its products would need the packed codes' own matrix in cpu_step.c.
                    return f"layer {i}'s {name} product holds {sparse24.REFUSED.split(' (')[0]}"
                if not isinstance(part, Int4Linear) or part.kernel not in ("cpu-f32", "cpu-int8"):
                    return f"layer {i}'s {name} product is not on our CPU INT4 kernels"
                if part.bias is not None:
                    return f"layer {i}'s {name} product has a bias"
                if part.exact_top:
                    return f"layer {i}'s {name} product refines its top outputs"
    if not cpu_step.available():
        return "it did not build (see the log)"
    return None


def can_run(model: LlamaModel) -> bool:
    """Whether the kernel serves this model's decode steps (decided once per model)."""
    plan = _plans.get(model)
    if plan is None:
        refused = refusal(model)
        if refused:
            logger.info("CPU decode step refused, the model's steps run op by op: %s", refused)
            plan = refused
        else:
            plan = _layout(model)
        _plans[model] = plan
    return isinstance(plan, cpu_step.Plan)


def _products(layer: DecoderLayer) -> dict[str, list[torch.nn.Module | None]]:
    """A layer's four products by name, each the weights it is made of in their output
    order: fused (qkv_proj, gate_up_proj) or, where the loader kept them apart (weights in
    two INT4 halves, group sizes that differ), q, k and v and the gate and the up."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv: list[torch.nn.Module | None] = [attn.qkv_proj]
    if attn.qkv_proj is None:
        qkv = [getattr(attn, n, None) for n in QKV]
    gate_up: list[torch.nn.Module | None] = [mlp.gate_up_proj]
    if mlp.gate_up_proj is None:
        gate_up = [getattr(mlp, n, None) for n in GATE_UP]
    return {"qkv": qkv, "o": [attn.o_proj], "gate/up": gate_up, "down": [mlp.down_proj]}


def _product(parts: list[torch.nn.Module | None], keep: list[torch.Tensor]) -> cpu_step.Int4Product:
    matrices = []
    for part in parts:
        assert isinstance(part, Int4Linear)
        tensors = (part.qweight, part.scales, part.zeros)
        keep.extend(tensors)
        if part.minimums is not None:
            keep.append(part.minimums)
        int8 = part.kernel == "cpu-int8"
        matrices.append(cpu_step.matrix(*tensors, part.group_size, int8, part.minimums, part.halves))
    return cpu_step.product(*matrices)


def _weights(*norms: RMSNorm | None) -> list[torch.Tensor]:
    """The float32 weights of the norms a layer has (of a pair: both or neither)."""
    return [n.weight.detach().float().contiguous() for n in norms if n is not None]


def _layout(model: LlamaModel) -> cpu_step.Plan:
    config = model.config
    keep: list[torch.Tensor] = []
    layers = (cpu_step.StepLayer * config.num_layers)()
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        products = {name: _product(parts, keep) for name, parts in _products(layer).items()}
        norms = _weights(layer.input_layernorm, layer.post_attention_layernorm)
        head_norms = _weights(attn.q_norm, attn.k_norm)
        out_norms = _weights(layer.attn_output_norm, layer.mlp_output_norm)
        local = (
            (model.rope_local[0].float().contiguous(), model.rope_local[1].float().contiguous())
            if layer.local_rope and model.rope_local is not None
            else None
        )
        keep.extend(norms + head_norms + out_norms + list(local or ()))
        layers[i] = cpu_step.StepLayer(
            norms[0].data_ptr(),
            norms[1].data_ptr(),
            products["qkv"],
            products["o"],
            products["gate/up"],
            products["down"],
            head_norms[0].data_ptr() if head_norms else 0,
            head_norms[1].data_ptr() if head_norms else 0,
            attn.window,
            local[0].data_ptr() if local else 0,
            local[1].data_ptr() if local else 0,
            out_norms[0].data_ptr() if out_norms else 0,
            out_norms[1].data_ptr() if out_norms else 0,
            int(mlp.gelu),
        )
    cos, sin = model.rope_cos.float().contiguous(), model.rope_sin.float().contiguous()
    keep.extend((cos, sin))
    first = model.layers[0]
    assert isinstance(first, DecoderLayer)
    described = cpu_step.StepModel(
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.rms_norm_eps,
        first.self_attn.scale,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        config.rotated,
    )
    return cpu_step.Plan(described, layers, keep)


def decode_step(model: LlamaModel, ids: torch.Tensor, cache: KVCache, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Logits [B, V] float32 for one token per sequence (ids [B, 1]) at positions pos [B],
    batch row b on cache row b attending below kv_len. The caller has checked can_run(model)
    and made room in the sliding buffers (KVCache.make_room_for_step), as for every step;
    a position past them is refused by the kernel."""
    plan = _plans[model]
    assert isinstance(plan, cpu_step.Plan)
    x = model._embed(ids.view(-1)).float()
    rows = torch.arange(ids.shape[0])
    x = cpu_step.decode_layers(plan, x, _parts(cache), rows, pos, kv_len)
    return model._head(x.unsqueeze(1))[:, -1].float()


def verify(model: LlamaModel, ids: list[int], cache: KVCache, row: int, start: int) -> torch.Tensor:
    """Logits [T, V] float32 of a sequence's tokens `ids` at positions start.. of cache
    row `row` (its newest token and its drafts), in one call: each token a batch row of
    the step, attending causally. The products read each weight once for all of them,
    and every row's sums run in the order a decode step's do, so each position's logits
    are those decoding it alone would give, bit for bit. The caller has checked
    can_run(model)."""
    plan = _plans[model]
    assert isinstance(plan, cpu_step.Plan)
    count = len(ids)
    x = model._embed(torch.tensor(ids)).float()
    pos = torch.arange(start, start + count)
    cache.make_room(row, start, start + count)
    x = cpu_step.decode_layers(plan, x, _parts(cache), torch.full((count,), row), pos, start + count)
    return model._head(x.unsqueeze(1))[:, -1].float()


def attention(model: LlamaModel, cache: KVCache, q: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Every layer's attention alone as the step runs it, batch row b on cache row b at
    pos[b], over the cache as it stands: q [layers, B, heads x head dim] float32 query
    heads turned by the rotary, out likewise. For the benchmarks, which time it apart
    from the layers' products; the caller has checked can_run(model)."""
    plan = _plans[model]
    assert isinstance(plan, cpu_step.Plan)
    return cpu_step.attention(plan, q, _parts(cache), torch.arange(q.shape[1]), pos, kv_len)


def _parts(cache: KVCache) -> cpu_step.CacheParts:
    index = [-1 - ix if local else ix for ix, local in zip(cache.index, cache.is_local, strict=True)]
    sparse = None
    if cache.summary is not None and cache.summarized is not None:
        # The summaries are kept up to date whether or not the cache's policy selects now
        # (a benchmark turns it off and on over one cache).
        policy = cache.sparse
        if policy is not None and policy.block_tokens != cache.block_tokens:
            raise ValueError(f"blocks of {policy.block_tokens} tokens: the cache summarizes {cache.block_tokens}")
        sparse = cpu_step.Summaries(
            cache.summary,
            torch.tensor(cache.summary_index, dtype=torch.int64),
            cache.summarized,
            cache.block_tokens,
            policy.top_k_blocks if policy is not None else 0,
            policy.min_context if policy is not None else 0,
        )
    return cpu_step.CacheParts(
        cache.k,
        cache.v,
        cache.local_k,
        cache.local_v,
        cache.offsets,
        torch.tensor(index, dtype=torch.int64),
        sparse,
    )
