"""Load a text checkpoint written by the engines pipeline (float or INT4).

Layout of a checkpoint directory:
  config.json        LlamaConfig
  model.safetensors  float tensors by module name; for each INT4 linear
                     `<name>.qweight`, `<name>.scales`, `<name>.zeros` (and
                     `<name>.minimums` for a GGUF Q4_1 weight) instead of `<name>.weight`
  quant.json         present for INT4 checkpoints: {"linears": {name: {"group_size": G}}},
                     with "halves": true for a GGUF Q8_0 weight stored as two INT4
                     halves (twice the rows: QuantizedWeight.halves), "sparsity": "2:4"
                     for a weight in the packed 2:4 format (`<name>.codes24`,
                     `<name>.index24`, `<name>.scales`, `<name>.zeros`:
                     edge/text/ops/sparse24.py)
  tokenizer.json, generation.json (the chat template, special tokens, end-of-turn ids)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from edge.text.architecture import LlamaConfig
from edge.text.model.chat import ChatTemplate
from edge.text.model.embedding import EmbeddingFormat, compact_embedding
from edge.text.model.llama import LlamaModel, fuse_projections
from edge.text.ops.cpu import cpu_int4
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import EXACT_TOP, Int4Linear, QuantizedWeight, concat_rows, cpu_kernel_available
from edge.text.ops.sparse24 import (
    SPARSITY,
    Sparse24Linear,
    Sparse24Weight,
    concat_sparse_rows,
    sparse_kernel,
)
from edge.text.ops.triton.triton_int4 import TRITON_SUPPORT

# Files every checkpoint carries beside its weights; build steps copy them forward.
SIDE_FILES = ("config.json", "tokenizer.json", "generation.json")
# The image part of a model that reads images (its vision tower, projector and image
# preprocessing: edge/vlm), where its source had one: carried forward by every build step
# with the side files, so the INT4 language model keeps the eye it was trained with. The
# language model's loader leaves them to edge/vlm (edge/tasks/image_questions.py loads them).
IMAGE_PART = ("vision.json", "vision.safetensors")


def carried_files(src: Path) -> list[str]:
    """The files of checkpoint `src` a build step made from it copies: the side files,
    and its image part where it has one."""
    return [*SIDE_FILES, *(name for name in IMAGE_PART if (src / name).is_file())]


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


CPU_KERNELS = {"exact": "cpu-f32", "int8": "cpu-int8"}  # models.qa.cpu_kernel -> our CPU INT4 kernel


def default_int4_kernel(device: torch.device, cpu_kernel: str = "exact") -> str:
    """The INT4 kernel a device serves; on the CPU `cpu_kernel` (models.qa.cpu_kernel)
    picks ours, float32 or int8 activations, or torch's bfloat16 one ("bf16")."""
    if device.type == "cuda":
        # Ours: the CUDA tensor-core GEMV where nvcc built it for this GPU, else the
        # Triton one; torch's tiled kernel decodes slower and prefills ten times slower.
        # Without Triton (JetPack's torch) the CUDA GEMV still serves, in the per-op step.
        if cuda_int4.available(device):
            return "cuda-mma"
        return "triton" if TRITON_SUPPORT else "cuda"
    ours = CPU_KERNELS.get(cpu_kernel)
    if ours is not None and cpu_int4.available(int8=ours == "cpu-int8"):
        return ours
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
    cpu_kernel: str = "exact",
    embedding: EmbeddingFormat = "float",
) -> TextCheckpoint:
    """Load for serving. `fuse` merges q/k/v and gate/up into single linears. Without
    `int4_kernel` the device's default serves, on the CPU as `cpu_kernel` says
    (default_int4_kernel). `embedding` "int8" or "int4" keeps the token table
    compact (edge/text/model/embedding.py).

    On `device` the load holds what the model keeps and little more at any moment, so a
    model that fits its memory budget once loaded also fits it while loading: the
    checkpoint is read on the host a tensor at a time, never whole; each INT4 linear
    (q/k/v and gate/up concatenated on the host first) is made on the device before the
    next is read, the cuda-mma kernel's tiles a slab at a time from the host's codes
    (cuda_int4.repack); float tensors reach the device already in `dtype`; and a token
    table to be compacted is compacted on the device from the host's float one, which
    never goes there."""
    device = torch.device(device)
    config = LlamaConfig.from_json(path / "config.json")
    with torch.device("meta"):
        model = LlamaModel(config)
    quant_path = path / "quant.json"
    kernel = None
    state: dict[str, torch.Tensor] = {}
    # Read a tensor at a time, never a whole host copy of the weights (on a Jetson that
    # copy would sit in the same DRAM as the GPU's).
    with safe_open(str(path / "model.safetensors"), framework="pt", device="cpu") as weights:
        keys: list[str] = list(weights.keys())
        taken: set[str] = set()

        def read(key: str) -> torch.Tensor:
            taken.add(key)
            tensor: torch.Tensor = weights.get_tensor(key)
            return tensor

        if quant_path.exists():
            kernel = int4_kernel or default_int4_kernel(device, cpu_kernel)
            linears = json.loads(quant_path.read_text(encoding="utf-8"))["linears"]
            groups = {name: int(info["group_size"]) for name, info in linears.items()}
            halves = {name for name, info in linears.items() if info.get("halves")}  # GGUF Q8_0 weights
            sparse = _sparse_linears(linears)
            # 2:4 layers are served by their own kernel; a device without one refuses the model here.
            sparse_with = sparse_kernel(device) if sparse else None

            def packed_module(target: str, parts: tuple[str, ...], kernel: str) -> nn.Module:
                """The module of one unit, its host tensors let go on return (before the
                next unit's are read)."""
                bias = None
                if f"{parts[0]}.bias" in keys:
                    bias = torch.cat([read(f"{n}.bias") for n in parts]).to(device=device, dtype=dtype)
                if parts[0] in sparse:
                    assert sparse_with is not None
                    parts_24 = [
                        Sparse24Weight(read(f"{n}.codes24"), read(f"{n}.index24"), read(f"{n}.scales"),
                                       read(f"{n}.zeros"), groups[n])
                        for n in parts
                    ]  # fmt: skip
                    q24 = parts_24[0] if len(parts_24) == 1 else concat_sparse_rows(parts_24)
                    return Sparse24Linear(q24, sparse_with, bias, device=device)
                sources = [
                    QuantizedWeight(
                        read(f"{n}.qweight"), read(f"{n}.scales"), read(f"{n}.zeros"), groups[n],
                        read(f"{n}.minimums") if f"{n}.minimums" in keys else None,  # a GGUF Q4_1 weight's
                        n in halves,
                    )
                    for n in parts
                ]  # fmt: skip
                q = sources[0] if len(sources) == 1 else concat_rows(sources)
                exact_top = EXACT_TOP if target == "lm_head" else 0
                gated = target.endswith("mlp.gate_up_proj")
                return Int4Linear(q, kernel, bias, exact_top, gated, device=device)

            for target, parts in _int4_units(groups, set(keys), config.num_layers, fuse, halves, sparse):
                _set_module(model, target, packed_module(target, parts, kernel))
                if len(parts) > 1:
                    parent = model.get_submodule(target.rpartition(".")[0])
                    for n in parts:
                        delattr(parent, n.rpartition(".")[2])
        for key in keys:
            if key in taken:
                continue
            tensor = weights.get_tensor(key)
            # A table to be compacted stays on the host: compact_embedding makes its
            # compact form on the device from there.
            on_host = key == "embed_tokens.weight" and embedding != "float"
            state[key] = tensor.to(dtype) if on_host else tensor.to(device=device, dtype=dtype)
    if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    # assign=True adopts the loaded tensors instead of copying into meta placeholders.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # The model holds them now: fusing below frees each layer's parts as it goes.
    state.clear()
    # INT4 layers got their buffers (codes, scales, bias) when they were built.
    int4 = {name for name, module in model.named_modules() if isinstance(module, Int4Linear | Sparse24Linear)}
    missing = [m for m in missing if not m.startswith("rope_") and m.rpartition(".")[0] not in int4]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
        assert isinstance(model.embed_tokens, nn.Embedding)  # not yet compacted
        model.lm_head.weight = model.embed_tokens.weight
    if fuse:
        fuse_projections(model)
    compact_embedding(model, embedding, device=device)
    table = model.embed_tokens
    if isinstance(table, nn.Embedding) and embedding != "float":
        # Kept in float after all (a tied float output layer reads it): now to the device.
        table.weight = nn.Parameter(table.weight.detach().to(device), requires_grad=table.weight.requires_grad)
        if config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
            model.lm_head.weight = table.weight
    model.move_rope(device)
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


def _sparse_linears(linears: dict[str, dict[str, object]]) -> set[str]:
    """The linears quant.json marks as 2:4 sparse; raises on a sparsity it does not know."""
    sparse = set()
    for name, info in linears.items():
        sparsity = info.get("sparsity")
        if sparsity is None:
            continue
        if sparsity != SPARSITY:
            raise ValueError(f"{name}: sparsity {sparsity!r} is not a format this runtime reads ({SPARSITY!r})")
        sparse.add(name)
    return sparse


def _int4_units(
    groups: dict[str, int],
    keys: set[str],
    num_layers: int,
    fuse: bool,
    halves: frozenset[str] | set[str] = frozenset(),
    sparse: frozenset[str] | set[str] = frozenset(),
) -> list[tuple[str, tuple[str, ...]]]:
    """(module, the checkpoint's INT4 linears it is made of) in the checkpoint's order:
    with `fuse`, a layer's q/k/v and gate/up as one module each where their group sizes
    agree, all or none of them have biases, none is in `halves` (a fused module at its
    first part) and all or none are 2:4 (`sparse`)."""
    fused: dict[str, tuple[str, tuple[str, ...]]] = {}
    for i in range(num_layers if fuse else 0):
        for target, parts in FUSED.items():
            names = tuple(f"layers.{i}.{p}" for p in parts)
            if not all(n in groups for n in names) or any(n in halves for n in names):
                continue
            if len({groups[n] for n in names}) != 1 or len({f"{n}.bias" in keys for n in names}) != 1:
                continue
            if len({n in sparse for n in names}) != 1:
                continue
            for n in names:
                fused[n] = (f"layers.{i}.{target}", names)
    units: dict[str, tuple[str, ...]] = {}
    for name in groups:
        target, names = fused.get(name, (name, (name,)))
        units.setdefault(target, names)
    return list(units.items())
