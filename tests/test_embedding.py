"""The compact token table (edge/text/model/embedding.py): its rows within the rounding its
format promises, its size, where it is refused, and the real model served with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from edge.config.text import QAModelConfig
from edge.protocol.jobs import QAJob
from edge.tasks import qa
from edge.text.architecture import LlamaConfig
from edge.text.engine import TextEngine, resolve_embedding
from edge.text.model.checkpoint import load_checkpoint
from edge.text.model.embedding import GROUPS, LEVELS, QuantizedEmbedding, compact_embedding
from edge.text.model.llama import LlamaModel
from edge.text.runtime.generate import SamplingParams, generate


def _table(vocab: int = 300, hidden: int = 128, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    # Rows of different magnitudes, a few outliers: what real tables look like.
    rows = torch.randn(vocab, hidden, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.1
    rows[::17, 5] = 1.5
    return rows.to(dtype)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rows_are_within_half_a_step_of_the_float_table(fmt: str) -> None:
    weight = _table()
    table = QuantizedEmbedding(weight, fmt)  # type: ignore[arg-type]
    ids = torch.tensor([[0, 17, 299], [5, 5, 100]])
    got = table(ids)
    assert got.shape == (2, 3, 128) and got.dtype == torch.bfloat16
    ref = weight[ids].float()
    group = GROUPS[fmt]
    step = ref.view(2, 3, -1, group).abs().amax(-1, keepdim=True) / LEVELS[fmt]
    err = (got.float() - ref).view(2, 3, -1, group).abs()
    # Half a code step, plus the float16 scale's and the bfloat16 output's own rounding.
    assert bool((err <= step * 0.5 * 1.01 + ref.view(2, 3, -1, group).abs() * 2**-8).all())
    assert float(err.max()) > 0  # it is a compact table, not a copy


@pytest.mark.parametrize(("fmt", "per_value"), [("int8", 1 + 2 / 64), ("int4", 0.5 + 2 / 32)])
def test_sizes(fmt: str, per_value: float) -> None:
    table = QuantizedEmbedding(_table(256, 256), fmt)  # type: ignore[arg-type]
    assert table.nbytes == int(256 * 256 * per_value)
    assert {n for n, _ in table.named_buffers()} == {"codes", "scales"}


def test_a_twin_in_another_dtype_shares_the_codes() -> None:
    table = QuantizedEmbedding(_table(), "int8")
    twin = table.with_dtype(torch.float32)
    assert twin.codes.data_ptr() == table.codes.data_ptr() and twin.scales.data_ptr() == table.scales.data_ptr()
    ids = torch.tensor([3, 17, 250])
    assert twin(ids).dtype == torch.float32 and table(ids).dtype == torch.bfloat16
    assert torch.equal(twin(ids).to(torch.bfloat16), table(ids))


def test_a_width_the_groups_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantizedEmbedding(_table(10, 48), "int4")


def test_a_table_tied_to_a_float_output_projection_stays_float() -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        tie_embeddings=True,
    )
    model = LlamaModel(config)
    assert config.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert compact_embedding(model, "int8") == 0
    assert isinstance(model.embed_tokens, nn.Embedding)
    model.lm_head = nn.Linear(64, 64, bias=False)  # untied
    saved = compact_embedding(model, "int8")
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert saved == 64 * 64 * 4 - (64 * 64 + 64 * 2)
    assert model.dtype == torch.float32 and model.device.type == "cpu"


def test_auto_is_int8_on_cuda_and_float_on_the_cpu() -> None:
    assert resolve_embedding(QAModelConfig(device="cuda")) == "int8"
    assert resolve_embedding(QAModelConfig(device="cpu")) == "float"
    assert resolve_embedding(QAModelConfig(device="cpu", embedding="int4")) == "int4"


def test_the_config_names_the_field_of_a_bad_table_format() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="embedding"):
        QAModelConfig.model_validate({"embedding": "int5"})
    assert QAModelConfig().embedding == "auto"


@pytest.fixture(scope="module")
def served(engine_dir: Path) -> Path:
    """The served INT4 checkpoint the daemon builds for the CPU profile (the clinic adapter
    merged, AWQ INT4 at the model's group size): the session's build, made once."""
    from engines.text.text_build import build_text_engine

    return build_text_engine(engine_dir, "clinic", "awq-int4", progress=False)


@pytest.mark.slow
def test_the_real_model_with_an_int8_table_answers_as_with_the_float_one(served: Path) -> None:
    """The int8 table on the served SmolLM2: its 49152 x 576 rows within rounding, the
    next-token logits within 1%, and greedy answers the same as with the float table."""
    ref = load_checkpoint(served)
    compact = load_checkpoint(served, embedding="int8")
    table = compact.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.fmt == "int8"
    assert isinstance(ref.model.embed_tokens, nn.Embedding)
    assert table.nbytes < 0.27 * ref.model.embed_tokens.weight.numel() * 4  # float32 on the CPU
    ids = torch.arange(0, 49152, 7)
    rows, want = table(ids).float(), ref.model.embed_tokens(ids).float()
    cos = torch.nn.functional.cosine_similarity(rows, want, dim=-1)
    assert float(cos.min()) > 0.9999
    prompts = ["What is a pulse oximeter?", "Name the parts of a cell.", "How does a fuse protect a circuit?"]
    same = 0
    for text in prompts:
        ids_list = ref.tokenizer.encode(text).ids
        logits = [
            ckpt.model(torch.tensor([ids_list]), ckpt.model.new_cache(1, len(ids_list)), 0)[0, -1]
            for ckpt in (ref, compact)
        ]
        assert float((logits[1] - logits[0]).norm() / logits[0].norm()) < 0.01, text
        outs = []
        for ckpt in (ref, compact):
            cache = ckpt.model.new_cache(1, len(ids_list) + 33)
            params = SamplingParams(max_new_tokens=32)
            outs.append(generate(ckpt.model, ckpt.tokenizer, ids_list, params, frozenset(), cache))
        same += outs[0].token_ids == outs[1].token_ids
    # Greedy answers part only after a near-tie (92% of 32-token continuations are the
    # same in the quality run): most of these must be the same throughout.
    assert same >= 2


@pytest.mark.slow
def test_the_qa_engine_serves_with_the_table_it_is_configured_for(served: Path) -> None:
    engine = TextEngine.load(
        served,
        QAModelConfig(
            max_context_tokens=256,
            max_new_tokens=8,
            embedding="int4",
            max_sequences=1,
            kv_offload="off",
            prefix_cache_mib=0,
        ),
    )
    table = engine.batcher.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.fmt == "int4"
    result = qa.answer(engine, QAJob(id="q", question="What does an ECG record?", max_new_tokens=8))
    assert result["answer"].strip()
