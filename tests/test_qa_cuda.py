"""The text branch on CUDA answers as it does on the CPU, on the real SmolLM2 weights:
greedy decoding through the serving engine (continuous batcher, CUDA graphs, tokens chosen
on the GPU) against the same engine on the CPU, in the same run.

With float weights the answers agree token for token. With INT4 the kernels differ (the
CPU's tiled bf16 kernel, the GPU's Triton GEMV and fused step in fp16), so near-ties may
flip: the first 16 tokens must agree on at least 90% of the held-out prompts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edge.config.text import QAModelConfig
from edge.protocol.jobs import QAJob
from edge.tasks import qa
from edge.text.engine import TextEngine

pytestmark = pytest.mark.gpu

# Held out: none of these is in the adapter's training data or the calibration text.
PROMPTS = [
    "What is the normal resting heart rate for an adult?",
    "Name three symptoms of dehydration.",
    "How often should a blood pressure cuff be calibrated?",
    "What does a pulse oximeter measure?",
    "Why do nurses wash their hands between patients?",
    "What is the difference between a virus and a bacterium?",
    "How should insulin be stored?",
    "What is a fever in a child?",
    "List two causes of low blood sugar.",
    "What is the purpose of a sterile field?",
    "How long should hands be washed with soap?",
    "What does BMI stand for?",
    "When should an ambulance be called for chest pain?",
    "What is an allergy?",
    "How is body temperature measured in the ear?",
    "What are the signs of a stroke?",
    "Why is sleep important for recovery?",
    "What is a normal blood oxygen level?",
    "How should sharps be disposed of?",
    "What does an ECG record?",
]
NEW_TOKENS = 32
FIRST = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The imported float model and its AWQ INT4 (group 32, as served), built here or
    taken from EDGE_TEST_ENGINE_DIR."""
    from engines.text.import_gguf import import_smollm2
    from engines.text.quantize import QuantRecipe
    from engines.text.text_build import SERVING_GROUP, quantize_checkpoint

    reuse = os.environ.get("EDGE_TEST_ENGINE_DIR")
    engine_dir = Path(reuse) if reuse else tmp_path_factory.mktemp("engines")
    base = import_smollm2(engine_dir, progress=False)
    return base, quantize_checkpoint(base, QuantRecipe(method="awq", group_size=SERVING_GROUP), progress=False)


def _answers(path: Path, device: str, dtype: str, embedding: str = "float") -> list[list[int]]:
    fields = {"device": device, "dtype": dtype, "embedding": embedding, "max_new_tokens": NEW_TOKENS}
    settings = QAModelConfig.model_validate(
        {"max_context_tokens": 256, "max_sequences": 1, "kv_offload": "off", "prefix_cache_mib": 0, **fields}
    )
    engine = TextEngine.load(path, settings)
    out = []
    for i, prompt in enumerate(PROMPTS):
        seq = qa.job_sequence(engine, QAJob(id=f"p{i}", question=prompt, max_new_tokens=NEW_TOKENS))
        engine.batcher.single(seq, f"p{i}")
        out.append(list(seq.tokens))
    if device == "cuda":
        assert engine.graphs > 0, "the CUDA engine serves without CUDA graphs"
    return out


def test_float_answers_on_cuda_equal_the_cpus_token_for_token(checkpoints: tuple[Path, Path]) -> None:
    base, _ = checkpoints
    cpu = _answers(base, "cpu", "float32")
    cuda = _answers(base, "cuda", "float32")
    assert all(len(a) > 0 for a in cpu)
    assert cuda == cpu


def test_the_int8_token_table_on_cuda_answers_as_on_the_cpu(checkpoints: tuple[Path, Path]) -> None:
    """CUDA's default table (int8) looked up inside the captured graphs gives the rows the
    CPU's lookup gives: with float weights, the answers agree token for token."""
    base, _ = checkpoints
    cpu = _answers(base, "cpu", "float32", "int8")
    cuda = _answers(base, "cuda", "float32", "auto")
    assert all(len(a) > 0 for a in cpu)
    assert cuda == cpu


def test_int4_answers_on_cuda_agree_with_the_cpus(checkpoints: tuple[Path, Path]) -> None:
    _, awq = checkpoints
    cpu = _answers(awq, "cpu", "auto")
    cuda = _answers(awq, "cuda", "auto")
    same = [a[:FIRST] == b[:FIRST] for a, b in zip(cpu, cuda, strict=True)]
    print(f"first {FIRST} tokens equal on {sum(same)} of {len(same)} prompts")
    assert sum(same) >= 0.9 * len(same), same


def test_continuous_batching_on_cuda_answers_as_one_at_a_time(checkpoints: tuple[Path, Path]) -> None:
    """Four sequences joining and leaving one graph-captured batch give what each gives
    alone: the batch-size buckets and their padding rows change nothing."""
    _, awq = checkpoints
    settings = QAModelConfig(
        max_context_tokens=256, max_new_tokens=24, max_sequences=4, device="cuda", kv_offload="off", prefix_cache_mib=0
    )
    engine = TextEngine.load(awq, settings)
    alone = []
    for i, prompt in enumerate(PROMPTS[:6]):
        seq = qa.job_sequence(engine, QAJob(id=f"a{i}", question=prompt, max_new_tokens=24 - i))
        alone.append(list(engine.batcher.single(seq, f"a{i}").tokens))
    batcher = engine.batcher
    seqs = [
        qa.job_sequence(engine, QAJob(id=f"b{i}", question=p, max_new_tokens=24 - i)) for i, p in enumerate(PROMPTS[:6])
    ]
    batcher.run_all(seqs)
    assert [list(s.tokens) for s in seqs] == alone
    assert max(batcher.batch_sizes) == 4


def test_sampling_on_the_gpu_is_repeatable_with_a_seed(checkpoints: tuple[Path, Path]) -> None:
    _, awq = checkpoints
    engine = TextEngine.load(
        awq,
        QAModelConfig(
            max_context_tokens=256,
            max_new_tokens=16,
            device="cuda",
            max_sequences=1,
            kv_offload="off",
            prefix_cache_mib=0,
        ),
    )
    job = QAJob(id="s", question=PROMPTS[0], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    first = qa.answer(engine, job)["answer"]
    assert qa.answer(engine, job)["answer"] == first
    assert torch.cuda.is_available()
