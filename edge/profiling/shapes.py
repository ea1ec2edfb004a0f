"""Bytes a text model's work moves, from its shapes (what bench/text.py's roofline and
graph profile count):

- each INT4 product reads its whole weight (codes, scales, zero points, minimums: the
  layer's `weight_bytes`) once a forward, at decode and at prefill alike; its activations
  are small beside it at decode and are not counted;
- attention at a decode step reads each row's keys and values so far; a prefill writes
  its prompt's (the KV manager's bytes per token, which knows an int8 or int4 cache).

A forward calls the products in one order: per layer qkv, o, gate_up, down, then the
head; `products` lists them so, where the model is laid out as the served builds are
(fused qkv and gate/up projections). Elsewhere (projections kept apart, a weight in
halves) it is None and the kernels' bytes are left unknown rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.text.ops.int4 import Int4Linear
from edge.text.ops.sparse24 import Sparse24Linear

ORDER = ("qkv", "o", "gate_up", "down")
_ATTRIBUTES = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"),
               "gate_up": ("mlp", "gate_up_proj"), "down": ("mlp", "down_proj")}  # fmt: skip


@dataclass(frozen=True)
class Product:
    label: str  # qkv, o, gate_up, down or lm_head
    layer: int | None
    nbytes: int


def products(model: Any) -> list[Product] | None:
    """The INT4 products of one forward, in the order it calls them; None where some
    block linear is not one Int4Linear of the served layout."""
    out: list[Product] = []
    for index, layer in enumerate(getattr(model, "layers", ())):
        for label in ORDER:
            part, name = _ATTRIBUTES[label]
            linear = getattr(getattr(layer, part, None), name, None)
            if not isinstance(linear, Int4Linear | Sparse24Linear) or getattr(linear, "halves", None):
                return None
            out.append(Product(label, index, int(linear.weight_bytes)))
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int4Linear):
        out.append(Product("lm_head", None, int(head.weight_bytes)))
    return out or None


def weight_bytes(model: Any) -> int:
    """Every INT4 weight's bytes (2:4 ones as packed): what one forward streams of them."""
    return sum(int(m.weight_bytes) for m in model.modules() if isinstance(m, Int4Linear | Sparse24Linear))
