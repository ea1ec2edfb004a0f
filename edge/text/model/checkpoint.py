"""Load a text checkpoint written by the engines pipeline (float or INT4).

Layout of a checkpoint directory:
  config.json        LlamaConfig
  model.safetensors  float tensors by module name; for each INT4 linear
                     `<name>.qweight`, `<name>.scales`, `<name>.zeros` instead of
                     `<name>.weight`
  quant.json         present for INT4 checkpoints: {"linears": {name: {"group_size": G}}}
  tokenizer.json, generation.json (the chat template, special tokens, end-of-turn ids)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from edge.text.architecture import LlamaConfig
from edge.text.model.chat import ChatTemplate
from edge.text.model.embedding import EmbeddingFormat, compact_embedding
from edge.text.model.llama import LlamaModel, fuse_projections
from edge.text.ops.cpu import cpu_int4
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import EXACT_TOP, Int4Linear, QuantizedWeight, concat_rows, cpu_kernel_available
from edge.text.ops.triton.triton_int4 import TRITON_SUPPORT

# Files every checkpoint carries beside its weights; build steps copy them forward.
SIDE_FILES = ("config.json", "tokenizer.json", "generation.json")

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

logger = logging.getLogger(__name__)


@dataclass
class TextCheckpoint:
    model: LlamaModel
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    path: Path
    int4_kernel: str | None = None
    chat: ChatTemplate | None = None  # the model's own template, where its source had one


def default_int4_kernel(device: torch.device, exact_cpu: bool = True) -> str:
    if device.type == "cuda":
        # Ours: the CUDA tensor-core GEMV where nvcc built it for this GPU, else the
        # Triton one; torch's tiled kernel decodes slower and prefills ten times slower.
        # Without Triton (JetPack's torch) the CUDA GEMV still serves, in the per-op step.
        if cuda_int4.available(device):
            return "cuda-mma"
        return "triton" if TRITON_SUPPORT else "cuda"
    # Ours computes the quantized model exactly in float32; torch's rounds to bfloat16.
    if exact_cpu and cpu_int4.available():
        return "cpu-f32"
    return "cpu" if cpu_kernel_available() else "dequant"


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def load_checkpoint(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    int4_kernel: str | None = None,
    fuse: bool = True,
    exact_cpu: bool = True,
    embedding: EmbeddingFormat = "float",
) -> TextCheckpoint:
    """Load for serving. `fuse` merges q/k/v and gate/up into single linears. Without
    `int4_kernel` the device's default serves; `exact_cpu=False` takes torch's bfloat16
    kernel on the CPU instead of ours. `embedding` "int8" or "int4" keeps the token table
    compact (edge/text/model/embedding.py)."""
    device = torch.device(device)
    config = LlamaConfig.from_json(path / "config.json")
    with torch.device("meta"):
        model = LlamaModel(config)
    # Straight onto the device, a tensor at a time: no whole host copy of the weights
    # first (on a Jetson that copy would sit in the same DRAM as the GPU's).
    state = load_file(str(path / "model.safetensors"), device=str(device))
    quant_path = path / "quant.json"
    kernel = None
    if quant_path.exists():
        kernel = int4_kernel or default_int4_kernel(device, exact_cpu)
        linears = json.loads(quant_path.read_text(encoding="utf-8"))["linears"]
        quantized = {
            name: QuantizedWeight(
                qweight=state.pop(f"{name}.qweight").to(device),
                scales=state.pop(f"{name}.scales").to(device),
                zeros=state.pop(f"{name}.zeros").to(device),
                group_size=int(info["group_size"]),
            )
            for name, info in linears.items()
        }
        biases = {
            name: state.pop(f"{name}.bias").to(device=device, dtype=dtype)
            for name in quantized
            if f"{name}.bias" in state
        }
        if fuse:
            _fuse_quantized(model, quantized, biases, kernel)
        for name, q in quantized.items():
            exact_top = EXACT_TOP if name == "lm_head" else 0
            _set_module(model, name, Int4Linear(q, kernel, biases.get(name), exact_top=exact_top))
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    # assign=True adopts the loaded tensors instead of copying into meta placeholders.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # INT4 layers got their buffers (codes, scales, bias) when they were built.
    int4 = {name for name, module in model.named_modules() if isinstance(module, Int4Linear)}
    missing = [m for m in missing if not m.startswith("rope_") and m.rpartition(".")[0] not in int4]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        assert isinstance(model.embed_tokens, nn.Embedding)  # not yet compacted
        model.lm_head.weight = model.embed_tokens.weight
    if fuse:
        fuse_projections(model)
    state.clear()  # the float table goes once the compact one is made, not at return
    compact_embedding(model, embedding)
    model.rope_cos = model.rope_cos.to(device)
    model.rope_sin = model.rope_sin.to(device)
    model.eval()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    gen = json.loads((path / "generation.json").read_text(encoding="utf-8"))
    eos = {int(gen["eos_token_id"]), *(int(e) for e in gen.get("eos_token_ids", []))}
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    if end_of_text is not None:
        eos.add(end_of_text)
    chat = None
    if gen.get("chat_template"):
        specials = {"bos_token": gen.get("bos_token"), "eos_token": gen.get("eos_token")}
        for key, id_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
            if specials[key] is None and gen.get(id_key) is not None:
                specials[key] = tokenizer.id_to_token(int(gen[id_key]))
        chat = ChatTemplate(gen["chat_template"], specials)
    return TextCheckpoint(
        model=model, tokenizer=tokenizer, eos_ids=frozenset(eos), path=path, int4_kernel=kernel, chat=chat
    )


def _fuse_quantized(
    model: LlamaModel, quantized: dict[str, QuantizedWeight], biases: dict[str, torch.Tensor], kernel: str
) -> None:
    """Concatenate q/k/v and gate/up INT4 weights (popping them from `quantized`), and
    their biases where they have them."""
    for i in range(model.config.num_layers):
        for fused, parts in FUSED.items():
            names = [f"layers.{i}.{p}" for p in parts]
            if not all(n in quantized for n in names):
                continue
            groups = {quantized[n].group_size for n in names}
            if len(groups) != 1 or len({n in biases for n in names}) != 1:
                continue
            bias = torch.cat([biases.pop(n) for n in names]) if names[0] in biases else None
            weight = concat_rows([quantized.pop(n) for n in names])
            gated = fused == "mlp.gate_up_proj"
            _set_module(model, f"layers.{i}.{fused}", Int4Linear(weight, kernel, bias, gated=gated))
            parent = model.get_submodule(f"layers.{i}.{parts[0].rsplit('.', 1)[0]}")
            for n in parts:
                delattr(parent, n.rsplit(".", 1)[1])
