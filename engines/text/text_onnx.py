"""Export a built text checkpoint (float or AWQ INT4) to ONNX, with the KV cache as
inputs and outputs, for onnxruntime and for TensorRT plans.

    python -m engines.text.text_onnx --checkpoint DIR [--dtype float32|float16]

The graph is written node by node from the checkpoint's own tensors, not traced: the
INT4 layers become block-wise `DequantizeLinear` (opset 21, block size = the layer's
group size, blocks along the input axis) feeding a `MatMul`, so the file holds the
same 4-bit codes and scales the checkpoint does and a runtime that fuses the pair
(onnxruntime's MatMulNBits, TensorRT's weight-only INT4 GEMM) never sees a float
weight. A layer whose zero points are all 8 (the symmetric quantizer) is written as
signed INT4 codes without a zero point, which is the only INT4 form TensorRT takes;
an asymmetric layer keeps UINT4 codes and UINT4 zero points.

Interface (what engines/trt_build.py and edge/verify.py rely on):
  inputs   input_ids int64 [batch, seq]
           past_key_values.{i}.key / .value  [batch, kv_heads, past, head_dim] (dtype)
  outputs  logits float32 [batch, seq, vocab]
           present.{i}.key / .value  [batch, kv_heads, past + seq, head_dim] (dtype)
Positions continue from `past`: a prompt runs with past = 0, each decode step feeds
the previous step's presents back as its pasts. The residual stream is float32 in
either dtype, as in the torch runtime; `dtype` is what the products and the cache use.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file

from edge.text.architecture import LlamaConfig
from edge.text.model.llama import rope_tables
from engines.cache import build_cached, cache_key, file_sha256, read_manifest, stop_on_sigterm, tag_serves

logger = logging.getLogger(__name__)

EXPORTER_VERSION = 1
OPSET = 21
ONNX_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
KIND = "text-onnx"
DTYPES = {"float32": (TensorProto.FLOAT, np.float32), "float16": (TensorProto.FLOAT16, np.float16)}
SYMMETRIC_ZERO = 8
# Past this many bytes of initializers the protobuf's 2 GB limit is near: weights go
# to one external data file beside the graph.
EXTERNAL_DATA_BYTES = 1 << 30


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


class ExportError(ValueError):
    """A checkpoint this exporter cannot write as asked."""


@dataclass
class _Graph:
    """Nodes and initializers under construction, with unique names."""

    dtype: int
    np_dtype: Any
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    _count: int = 0
    consts: dict[str, str] = field(default_factory=dict)

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, inputs: list[str], hint: str = "", **attrs: Any) -> str:
        out = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n_{out}", **attrs))
        return out

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, key: str, array: np.ndarray) -> str:
        """A small constant, shared by every node that uses the same value."""
        if key not in self.consts:
            self.consts[key] = self.init(f"const_{key}", array)
        return self.consts[key]

    def int64s(self, *values: int) -> str:
        return self.const("i64_" + "_".join(str(v) for v in values).replace("-", "m"), np.array(values, np.int64))

    def scalar(self, value: float, dtype: Any = np.float32) -> str:
        return self.const(
            f"{np.dtype(dtype).name}_{value!r}".replace("-", "m").replace(".", "p"), np.array(value, dtype)
        )

    def packed_int4(self, name: str, codes: np.ndarray, signed: bool) -> str:
        """codes [K, N] in 0..15 (or -8..7 when signed) as one packed 4-bit tensor: two
        elements per byte in row-major order, the first in the low nibble."""
        flat = (codes.astype(np.int16) & 0x0F).astype(np.uint8).reshape(-1)
        if flat.size % 2:
            flat = np.concatenate([flat, np.zeros(1, np.uint8)])
        raw = (flat[0::2] | (flat[1::2] << 4)).tobytes()
        tensor = helper.make_tensor(name, TensorProto.INT4 if signed else TensorProto.UINT4, codes.shape, raw, raw=True)
        self.inits.append(tensor)
        return name


@dataclass(frozen=True)
class LinearReport:
    name: str
    precision: str  # "int4-sym", "int4-asym" or the float dtype
    group_size: int


class _Exporter:
    def __init__(self, ckpt_dir: Path, dtype: str) -> None:
        self.config = LlamaConfig.from_json(ckpt_dir / "config.json")
        options = self.config.family_options()
        if options:
            # The graph written here is Llama's (Qwen2's biases included); a family's
            # options would otherwise be dropped silently.
            raise ExportError(f"the ONNX export does not implement {', '.join(options)}")
        quant_path = ckpt_dir / "quant.json"
        self.quant: dict[str, Any] = (
            json.loads(quant_path.read_text(encoding="utf-8"))["linears"] if quant_path.exists() else {}
        )
        self.state = load_file(str(ckpt_dir / "model.safetensors"))
        with_minimums = sorted(k.removesuffix(".minimums") for k in self.state if k.endswith(".minimums"))
        if with_minimums:
            # MatMulNBits takes integer zero points; a Q4_1 block's float minimum has no place.
            raise ExportError(f"the ONNX export does not implement block minimums (GGUF Q4_1): {with_minimums[0]}, ...")
        sparse = sorted(name for name, info in self.quant.items() if info.get("sparsity"))
        if sparse:
            # MatMulNBits reads dense INT4 blocks; the packed 2:4 codes would have to be expanded.
            raise ExportError(f"the ONNX export does not implement 2:4 sparse INT4 weights: {sparse[0]}, ...")
        halves = sorted(name for name, info in self.quant.items() if info.get("halves"))
        if halves:
            raise ExportError(
                f"the ONNX export does not implement weights in two INT4 halves (GGUF Q8_0): {halves[0]}, ..."
            )
        self.g = _Graph(*DTYPES[dtype])
        self.linears: list[LinearReport] = []

    def float_weight(self, name: str) -> np.ndarray:
        return self.state[name].float().numpy()

    # -- building blocks -------------------------------------------------------------

    def cast(self, x: str, to: int) -> str:
        return (
            x
            if to == TensorProto.FLOAT and self.g.dtype == TensorProto.FLOAT
            else self.g.op("Cast", [x], "cast", to=to)
        )

    def rms_norm(self, x: str, weight: str) -> str:
        """float32 x -> the compute dtype, as RMSNorm does for a float32 residual."""
        g = self.g
        w = g.init(f"{weight}", self.float_weight(weight).astype(np.float32))
        mean = g.op("ReduceMean", [g.op("Mul", [x, x]), g.int64s(-1)], "ms", keepdims=1)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.scalar(self.config.rms_norm_eps)])])])
        return self.cast(g.op("Mul", [g.op("Mul", [x, inv]), w], "normed"), g.dtype)

    def linear(self, x: str, name: str) -> str:
        g = self.g
        if name in self.quant:
            group = int(self.quant[name]["group_size"])
            packed = self.state[f"{name}.qweight"]  # uint8 [N, K/2], even k in the low nibble
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).numpy()
            zeros = self.state[f"{name}.zeros"].numpy()  # [N, K/G]
            scales = self.state[f"{name}.scales"].float().numpy().astype(g.np_dtype)  # [N, K/G]
            symmetric = bool((zeros == SYMMETRIC_ZERO).all())
            if symmetric:
                w = g.packed_int4(f"{name}.qweight", (codes.astype(np.int16) - SYMMETRIC_ZERO).T, signed=True)
                ins = [w, g.init(f"{name}.scales", scales.T)]
            else:
                w = g.packed_int4(f"{name}.qweight", codes.T, signed=False)
                ins = [w, g.init(f"{name}.scales", scales.T), g.packed_int4(f"{name}.zeros", zeros.T, signed=False)]
            weight = g.op("DequantizeLinear", ins, "w", axis=0, block_size=group)
            self.linears.append(LinearReport(name, "int4-sym" if symmetric else "int4-asym", group))
        else:
            key = f"{name}.weight" if f"{name}.weight" in self.state else "embed_tokens.weight"
            weight = g.init(f"{name}.weight_t", self.float_weight(key).T.astype(g.np_dtype))
            self.linears.append(LinearReport(name, np.dtype(g.np_dtype).name, 0))
        out = g.op("MatMul", [x, weight], name.rsplit(".", 1)[-1])
        bias = f"{name}.bias"
        if bias in self.state:
            out = g.op("Add", [out, g.init(bias, self.float_weight(bias).astype(g.np_dtype))])
        return out

    def rope(self, x: str, cos: str, sin: str, half: int) -> str:
        g = self.g
        first, second = g.name("rope_a"), g.name("rope_b")
        g.nodes.append(
            helper.make_node("Split", [x, g.int64s(half, half)], [first, second], name=f"n_{first}", axis=-1)
        )
        rotated = g.op("Concat", [g.op("Neg", [second]), first], "rot", axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])], "roped")

    def heads(self, x: str, count: int) -> str:
        """[B, S, count*hd] -> [B, count, S, hd]"""
        g = self.g
        shaped = g.op("Reshape", [x, g.int64s(0, 0, count, self.config.head_dim)])
        return g.op("Transpose", [shaped], "heads", perm=[0, 2, 1, 3])

    def repeat_kv(self, x: str) -> str:
        """[B, kv, T, hd] -> [B, heads, T, hd]: each KV head shared by its query group."""
        c, g = self.config, self.g
        group = c.num_heads // c.num_kv_heads
        if group == 1:
            return x
        grown = g.op("Expand", [g.op("Unsqueeze", [x, g.int64s(2)]), g.int64s(1, 1, group, 1, 1)])
        return g.op("Reshape", [grown, g.int64s(0, c.num_heads, -1, c.head_dim)], "kv_rep")

    # -- the model ---------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        c, g = self.config, self.g
        hd, dt = c.head_dim, g.dtype
        batch, seq, past, total = "batch", "seq", "past", "past_plus_seq"
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq])]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq, c.vocab_size])]
        for i in range(c.num_layers):
            for name in past_names(i):
                inputs.append(helper.make_tensor_value_info(name, dt, [batch, c.num_kv_heads, past, hd]))
            for name in present_names(i):
                outputs.append(helper.make_tensor_value_info(name, dt, [batch, c.num_kv_heads, total, hd]))

        # Positions past .. past+seq-1, from the shapes of the inputs.
        first_past = past_names(0)[0]
        past_len = g.op("Squeeze", [g.op("Shape", [first_past], "past_len", start=2, end=3)])
        seq_len = g.op("Squeeze", [g.op("Shape", ["input_ids"], "seq_len", start=1, end=2)])
        end = g.op("Add", [past_len, seq_len], "end")
        one, zero = g.scalar(1, np.int64), g.scalar(0, np.int64)
        pos = g.op("Range", [past_len, end, one], "pos")
        cos_t, sin_t = rope_tables(c, c.max_position, torch.device("cpu"))
        cos = g.op("Gather", [g.init("rope_cos", cos_t.numpy()), pos], "cos", axis=0)
        sin = g.op("Gather", [g.init("rope_sin", sin_t.numpy()), pos], "sin", axis=0)
        cos = self.cast(g.op("Unsqueeze", [cos, g.int64s(0, 1)]), dt)
        sin = self.cast(g.op("Unsqueeze", [sin, g.int64s(0, 1)]), dt)
        # Causal mask [1, 1, seq, past+seq]: a query at position p sees keys up to p.
        keys_at = g.op("Range", [zero, end, one], "kpos")
        later = g.op("Greater", [g.op("Unsqueeze", [keys_at, g.int64s(0)]), g.op("Unsqueeze", [pos, g.int64s(1)])])
        mask = g.op("Where", [later, g.scalar(float("-inf")), g.scalar(0.0)], "mask")
        mask = g.op("Unsqueeze", [mask, g.int64s(0, 1)])

        embed = g.init("embed_tokens.weight", self.state["embed_tokens.weight"].numpy().astype(g.np_dtype))
        x = self.cast(g.op("Gather", [embed, "input_ids"], "embedded", axis=0), TensorProto.FLOAT)
        scale = g.scalar(hd**-0.5)
        for i in range(c.num_layers):
            p = f"layers.{i}"
            h = self.rms_norm(x, f"{p}.input_layernorm.weight")
            q = self.rope(self.heads(self.linear(h, f"{p}.self_attn.q_proj"), c.num_heads), cos, sin, hd // 2)
            k = self.rope(self.heads(self.linear(h, f"{p}.self_attn.k_proj"), c.num_kv_heads), cos, sin, hd // 2)
            v = self.heads(self.linear(h, f"{p}.self_attn.v_proj"), c.num_kv_heads)
            k_name, v_name = present_names(i)
            g.nodes.append(helper.make_node("Concat", [past_names(i)[0], k], [k_name], name=f"n_{k_name}", axis=2))
            g.nodes.append(helper.make_node("Concat", [past_names(i)[1], v], [v_name], name=f"n_{v_name}", axis=2))
            keys, values = self.repeat_kv(k_name), self.repeat_kv(v_name)
            scores = g.op("MatMul", [q, g.op("Transpose", [keys], "keys_t", perm=[0, 1, 3, 2])], "scores")
            # Softmax in float32, as the torch runtime's decode does.
            scores = g.op("Add", [g.op("Mul", [self.cast(scores, TensorProto.FLOAT), scale]), mask])
            probs = self.cast(g.op("Softmax", [scores], "probs", axis=-1), dt)
            attn = g.op("Transpose", [g.op("MatMul", [probs, values])], perm=[0, 2, 1, 3])
            attn = g.op("Reshape", [attn, g.int64s(0, 0, c.num_heads * hd)], "attn")
            x = g.op("Add", [x, self.cast(self.linear(attn, f"{p}.self_attn.o_proj"), TensorProto.FLOAT)], "resid")
            h = self.rms_norm(x, f"{p}.post_attention_layernorm.weight")
            gate = self.linear(h, f"{p}.mlp.gate_proj")
            up = self.linear(h, f"{p}.mlp.up_proj")
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up], "swiglu")
            x = g.op("Add", [x, self.cast(self.linear(act, f"{p}.mlp.down_proj"), TensorProto.FLOAT)], "resid")
        logits = self.cast(self.linear(self.rms_norm(x, "norm.weight"), "lm_head"), TensorProto.FLOAT)
        g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="n_logits"))
        graph = helper.make_graph(g.nodes, "edge_llama", inputs, outputs, g.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edge")
        model.ir_version = 10  # the IR of opset 21, which 4-bit types need
        return model


def is_symmetric(ckpt_dir: Path) -> bool:
    """Whether every INT4 layer of a checkpoint has all its zero points at 8 (a float
    checkpoint is, having none), read from the zero points alone."""
    from safetensors import safe_open

    quant_path = ckpt_dir / "quant.json"
    if not quant_path.exists():
        return True
    names = json.loads(quant_path.read_text(encoding="utf-8"))["linears"]
    with safe_open(str(ckpt_dir / "model.safetensors"), framework="pt") as f:
        return all(bool((f.get_tensor(f"{name}.zeros") == SYMMETRIC_ZERO).all()) for name in names)


def export_text_onnx(ckpt_dir: Path, out_dir: Path, dtype: str = "float32") -> dict[str, Any]:
    """Write `out_dir`/model.onnx from the checkpoint in `ckpt_dir`; returns what the
    manifest records (precision per linear, the interface's names)."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    exporter = _Exporter(ckpt_dir, dtype)
    model = exporter.build()
    size = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)
    path = out_dir / ONNX_FILE
    if size > EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_FILE)
    else:
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    precisions: dict[str, int] = {}
    for report in exporter.linears:
        precisions[report.precision] = precisions.get(report.precision, 0) + 1
    config = exporter.config
    logger.info(
        "exported %s: %d nodes, %.0f MB of weights, linears %s", path, len(model.graph.node), size / 1e6, precisions
    )
    return {
        "kind": KIND,
        "dtype": dtype,
        "opset": OPSET,
        "onnx": ONNX_FILE,
        "external_data": DATA_FILE if size > EXTERNAL_DATA_BYTES else None,
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position": config.max_position,
        "linears": {r.name: {"precision": r.precision, "group_size": r.group_size} for r in exporter.linears},
        "precisions": precisions,
        "symmetric": all(r.precision != "int4-asym" for r in exporter.linears),
    }


def export_checkpoint(ckpt_dir: Path, dtype: str = "float32") -> Path:
    """The ONNX export of a built checkpoint, cached beside it by the checkpoint's own
    inputs, the dtype and this exporter's version."""
    source = read_manifest(ckpt_dir)
    if source is None:
        raise FileNotFoundError(f"{ckpt_dir} is not a built checkpoint (no manifest)")
    inputs = {
        "checkpoint": source["inputs"],
        "weights_sha256": file_sha256(ckpt_dir / "model.safetensors"),
        "dtype": dtype,
        "exporter": EXPORTER_VERSION,
    }
    out = ckpt_dir.parent / f"{ckpt_dir.name}-onnx-{dtype}-{cache_key(inputs)}"

    def build(scratch: Path) -> dict[str, Any]:
        details = export_text_onnx(ckpt_dir, scratch, dtype)
        details["checkpoint"] = ckpt_dir.name
        for name in ("tokenizer.json", "generation.json", "config.json"):
            (scratch / name).write_bytes((ckpt_dir / name).read_bytes())
        return details

    built = build_cached(out, inputs, build)
    tag_serves(built, {"export": "onnx", "checkpoint": ckpt_dir.name, "dtype": dtype})
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a built text checkpoint to ONNX (cached by its inputs).")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a built text checkpoint directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(export_checkpoint(args.checkpoint, args.dtype))
    except (ExportError, FileNotFoundError) as err:
        print(f"text_onnx: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
