"""Continuous batching on the real SmolLM2 weights: sequences that decode together, join
between steps, and are paused and resumed give the same tokens as each one alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.text.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.continuous import ContinuousBatcher, Sequence
from edge.text.generate import SamplingParams, generate
from edge.text.qa import chatml
from engines.import_gguf import import_smollm2

QUESTIONS = [
    "Name three symptoms of dehydration.",
    "What is a normal body temperature?",
    "Why do we wash hands before surgery? Answer in two sentences, please.",
]


@pytest.fixture(scope="module")
def ckpt(engine_dir: Path) -> TextCheckpoint:
    return load_checkpoint(import_smollm2(engine_dir, progress=False))


def _prompt(ckpt: TextCheckpoint, question: str) -> list[int]:
    return list(ckpt.tokenizer.encode(chatml("You are terse.", question), add_special_tokens=False).ids)


def _alone(ckpt: TextCheckpoint, ids: list[int], new: int) -> list[int]:
    cache = ckpt.model.new_cache(1, 256)
    return generate(ckpt.model, ckpt.tokenizer, ids, SamplingParams(max_new_tokens=new), frozenset(), cache).token_ids


def test_sequences_joining_between_steps_match_each_alone(ckpt: TextCheckpoint) -> None:
    prompts = [_prompt(ckpt, q) for q in QUESTIONS]
    news = [20, 12, 16]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=3, slot_len=256)
    # Warm-up (4 prefill lengths; 3 batch sizes x KV lengths 1..256) leaves nothing that
    # changes what the sequences below decode, nor any row taken.
    assert batcher.warm_up() == 4 + 3 * 9
    assert batcher.free_slots == 3 and not batcher.batch_sizes
    streamed: dict[int, list[str]] = {i: [] for i in range(3)}
    seqs = [
        Sequence(i, p, SamplingParams(max_new_tokens=n), streamed[i].append)
        for i, (p, n) in enumerate(zip(prompts, news, strict=True))
    ]
    batcher.admit(seqs[0])
    batcher.admit(seqs[1])
    done: list[Sequence] = []
    for _ in range(3):
        done += batcher.step()
    batcher.admit(seqs[2])  # joins two sequences already decoding
    while batcher.running:
        done += batcher.step()
    assert {s.owner for s in done} == {0, 1, 2}
    assert max(batcher.batch_sizes) == 3  # three decoded in one step
    for i, seq in enumerate(seqs):
        assert seq.tokens == _alone(ckpt, prompts[i], news[i]), f"sequence {i} differs from decoding it alone"
        assert seq.finish == "length" and "".join(streamed[i]) == seq.text
    assert batcher.free_slots == 3


def test_a_paused_sequence_resumes_where_it_was(ckpt: TextCheckpoint) -> None:
    prompts = [_prompt(ckpt, q) for q in QUESTIONS[:2]]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=1, slot_len=256)
    low = Sequence("low", prompts[0], SamplingParams(max_new_tokens=16))
    urgent = Sequence("urgent", prompts[1], SamplingParams(max_new_tokens=8))
    batcher.admit(low)
    for _ in range(5):
        batcher.step()
    assert batcher.free_slots == 0
    batcher.pause(low)  # the only row goes to the urgent one; low's KV is dropped
    assert batcher.free_slots == 1 and low.slot is None and len(low.tokens) == 5
    batcher.admit(urgent)
    while batcher.running:
        batcher.step()
    batcher.admit(low)  # prompt and its 5 tokens are prefilled again
    while batcher.running:
        batcher.step()
    assert urgent.tokens == _alone(ckpt, prompts[1], 8)
    assert low.tokens == _alone(ckpt, prompts[0], 16) and low.pauses == 1
