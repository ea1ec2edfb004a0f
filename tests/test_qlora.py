"""The clinic adapter: trained on a frozen 4-bit base, merged, and measurably effective."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from edge.config.text import QAModelConfig
from edge.protocol.jobs import QAJob
from edge.tasks import qa
from edge.text.engine import TextEngine
from edge.text.model.checkpoint import load_checkpoint
from edge.text.ops.int4 import pack
from engines.cache import file_sha256
from engines.text import clinic_retrieval
from engines.text.clinic_data import Example, examples, follows
from engines.text.import_gguf import import_smollm2
from engines.text.peft_adapter import merge_checkpoint
from engines.text.qlora import CLINIC_ADAPTER, LoRALinear, LoraRecipe


def follow_rate(path: Path) -> tuple[float, list[str]]:
    held = examples("heldout")
    settings = QAModelConfig(
        max_context_tokens=512, max_new_tokens=40, max_sequences=len(held), kv_offload="off", prefix_cache_mib=0
    )
    engine = TextEngine(load_checkpoint(path), settings)
    # All prompts decoded together (each answer is the one it would get alone, greedy:
    # tests/test_continuous.py), a few times faster than one after another.
    seqs = [
        qa.job_sequence(engine, QAJob(id=f"h{i}", question=e.question, context=e.context)) for i, e in enumerate(held)
    ]
    engine.batcher.run_all(seqs)
    answers = [qa.result_of(seq)["answer"] for seq in seqs]
    return sum(follows(e, a) for e, a in zip(held, answers, strict=True)) / len(held), answers


def test_heldout_prompts_share_nothing_with_training() -> None:
    train, held = examples("train"), examples("heldout")
    assert {e.doc_id for e in held if e.doc_id}.isdisjoint({e.doc_id for e in train})
    assert {e.question for e in held}.isdisjoint({e.question for e in train})
    assert {e.kind for e in held} == {"cite", "plain", "refuse", "retrieve"}

    # Retrieved passages: no held-out prompt shows a chunk of a document a training prompt shows.
    def documents(exs: list[Example]) -> set[str]:
        return {m.split("#")[0] for e in exs for m in re.findall(r"\[doc: ([^\]]+)\]", e.context or "")}

    assert documents([e for e in held if e.kind == "retrieve"]).isdisjoint(documents(train))
    assert any(e.doc_id is None for e in held if e.kind == "retrieve")


def test_every_written_answer_shows_the_behaviour_its_prompt_asks_for() -> None:
    facts = [f for split in (False, True) for kind in clinic_retrieval._facts(split) for doc in kind for f in doc]
    for ex in examples("train") + examples("heldout"):
        assert follows(ex, ex.answer), ex
        if ex.kind == "retrieve" and ex.doc_id is not None:
            assert f"[doc: {ex.doc_id}] " in (ex.context or "")  # the cited passage was shown
        elif ex.kind == "retrieve":  # no passage answers: the asked fact's chunk is not among them
            asked = [f.chunk for f in facts if f.question == ex.question]
            assert len(asked) == 1 and f"[doc: {asked[0]}] " not in (ex.context or "")


@pytest.mark.slow
def test_the_shipped_adapter_changes_behaviour_on_heldout_prompts(engine_dir: Path) -> None:
    base = import_smollm2(engine_dir, progress=False)
    merged = merge_checkpoint(base, CLINIC_ADAPTER)  # the float merge (the fixture's INT4 build wrote none)
    base_rate, _ = follow_rate(base)
    merged_rate, answers = follow_rate(merged)
    assert base_rate <= 0.2, "the base model should not already cite and refuse"
    assert merged_rate >= 0.8, answers
    provenance = json.loads((CLINIC_ADAPTER / "provenance.json").read_text())
    assert provenance["training"]["final_loss"] < provenance["training"]["first_loss"] / 4


def test_the_shipped_adapter_is_what_its_provenance_says() -> None:
    provenance = json.loads((CLINIC_ADAPTER / "provenance.json").read_text())
    weights = CLINIC_ADAPTER / "adapter_model.safetensors"
    assert file_sha256(weights) == provenance["sha256"]["adapter_model.safetensors"]
    assert provenance["command"].startswith("python -m engines.text.qlora --export")
    config = json.loads((CLINIC_ADAPTER / "adapter_config.json").read_text())
    assert config["r"] == LoraRecipe().rank and config["lora_alpha"] == LoraRecipe().alpha
    base = json.loads((CLINIC_ADAPTER / "base_quantization.json").read_text())
    assert base == {"format": "edge-int4", "group_size": LoraRecipe().base_group}


def test_lora_starts_at_the_base_and_merges_exactly() -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    layer = LoRALinear(pack(w, 64), rank=4, alpha=8, dropout=0.0, gen=torch.Generator().manual_seed(0))
    x = torch.randn(5, 64)
    from edge.text.ops.int4 import dequantize

    torch.testing.assert_close(layer(x), x @ dequantize(layer.base).T)  # B = 0 at start
    with torch.no_grad():
        layer.lora_b.normal_()
    torch.testing.assert_close(layer(x), x @ layer.merged_weight().T, atol=1e-4, rtol=1e-4)
