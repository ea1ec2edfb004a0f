"""Continuous batching on the real SmolLM2 weights: sequences that decode together, join
between steps, and are paused and resumed give the same tokens as each one alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.prompt import chatml
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams, generate
from engines.text.import_gguf import import_smollm2
from tests.spies import prefills_run

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


def admit(batcher: ContinuousBatcher, seq: Sequence) -> None:
    """What the text worker does: a row from the KV manager, then the prefill into it."""
    slot = batcher.kv.allocate_slots(str(seq.owner), len(seq.prompt) + seq.params.max_new_tokens)
    assert slot is not None
    batcher.admit(seq, slot)


def finish(batcher: ContinuousBatcher, done: list[Sequence]) -> list[Sequence]:
    for seq in done:
        assert seq.kv is not None and seq.slot is None
        batcher.kv.free(seq.kv)
        seq.kv = None
    return done


def test_sequences_joining_between_steps_match_each_alone(ckpt: TextCheckpoint) -> None:
    prompts = [_prompt(ckpt, q) for q in QUESTIONS]
    news = [20, 12, 16]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=3, slot_len=256)
    # Warm-up on the CPU (the longest prefill from position 0 and as a chunk after as many
    # cached tokens; a decode step alone and at full batch over the whole KV length: no
    # kernel here is built per shape) leaves nothing that changes what the sequences
    # below decode, nor any row taken.
    with prefills_run(batcher.model) as prefills:
        assert batcher.warm_up() == 2 + 2
    # What a prefix-cache hit and a chunked prefill run (a chunk after cached tokens) is
    # warmed as well as a fresh prompt.
    assert prefills == [(0, 64), (64, 64)]
    assert batcher.kv.rows_free == 3 and not batcher.batch_sizes
    streamed: dict[int, list[str]] = {i: [] for i in range(3)}
    seqs = [
        Sequence(i, p, SamplingParams(max_new_tokens=n), streamed[i].append)
        for i, (p, n) in enumerate(zip(prompts, news, strict=True))
    ]
    admit(batcher, seqs[0])
    admit(batcher, seqs[1])
    done: list[Sequence] = []
    for _ in range(3):
        done += finish(batcher, batcher.step())
    admit(batcher, seqs[2])  # joins two sequences already decoding
    while batcher.running:
        done += finish(batcher, batcher.step())
    assert {s.owner for s in done} == {0, 1, 2}
    assert max(batcher.batch_sizes) == 3  # three decoded in one step
    for i, seq in enumerate(seqs):
        assert seq.tokens == _alone(ckpt, prompts[i], news[i]), f"sequence {i} differs from decoding it alone"
        assert seq.finish == "length" and "".join(streamed[i]) == seq.text
    assert batcher.kv.rows_free == 3


def test_a_paused_sequence_resumes_where_it_was(ckpt: TextCheckpoint) -> None:
    prompts = [_prompt(ckpt, q) for q in QUESTIONS[:2]]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=1, slot_len=256)
    low = Sequence("low", prompts[0], SamplingParams(max_new_tokens=16))
    urgent = Sequence("urgent", prompts[1], SamplingParams(max_new_tokens=8))
    admit(batcher, low)
    for _ in range(5):
        batcher.step()
    assert batcher.kv.rows_free == 0
    assert batcher.kv.allocate_slots("urgent", 8) is None  # the one row is held
    slot = batcher.pause(low)  # the only row goes to the urgent one; low's KV is dropped
    assert slot is not None and low.slot is None and len(low.tokens) == 5
    batcher.kv.free(slot)
    assert batcher.kv.rows_free == 1
    admit(batcher, urgent)
    while batcher.running:
        finish(batcher, batcher.step())
    admit(batcher, low)  # prompt and its 5 tokens are prefilled again
    while batcher.running:
        finish(batcher, batcher.step())
    assert urgent.tokens == _alone(ckpt, prompts[1], 8)
    assert low.tokens == _alone(ckpt, prompts[0], 16) and low.pauses == 1


def test_a_long_prompt_joins_in_chunks_while_others_decode(ckpt: TextCheckpoint) -> None:
    """With prefill_chunk, a prompt admitted beside a decoding sequence is prefilled a
    chunk per step while the other keeps taking a token every step; both give what
    each gives alone. The chunked one is in a row below the decoding one's, which the
    decode steps must leave as its chunks wrote it."""
    prompts = [_prompt(ckpt, q) for q in QUESTIONS]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=2, slot_len=256)
    batcher.prefill_chunk = 8
    short = Sequence("short", prompts[0], SamplingParams(max_new_tokens=3))
    long_ = Sequence("long", prompts[1], SamplingParams(max_new_tokens=40))
    admit(batcher, short)  # alone: prefilled at once, row 0
    assert short.prefilled == len(prompts[0]) and short.logits is not None
    admit(batcher, long_)  # row 1, beside one running: chunked
    assert long_.slot == 1 and long_.prefilled == 8 and long_.logits is None
    while short.finish is None:
        finish(batcher, batcher.step())
    while long_.logits is None:
        finish(batcher, batcher.step())
    chunked = Sequence("chunked", prompts[2], SamplingParams(max_new_tokens=12))
    admit(batcher, chunked)  # the row short left: row 0, below the one decoding
    assert chunked.slot == 0 and chunked.logits is None
    chunks = -(-len(prompts[2]) // 8)
    before = len(long_.tokens)
    for _ in range(chunks - 1):  # the rest of its chunks, one per step
        assert chunked.logits is None
        finish(batcher, batcher.step())
    assert chunked.prefilled == len(prompts[2]) and len(chunked.tokens) == 1
    assert len(long_.tokens) == before + chunks - 1  # a token every step meanwhile
    assert len(chunked.prefill_events) == 0 and chunked.prefill_ms > 0  # CPU: host-timed
    while batcher.running:
        finish(batcher, batcher.step())
    assert short.tokens == _alone(ckpt, prompts[0], 3)
    assert long_.tokens == _alone(ckpt, prompts[1], 40)
    assert chunked.tokens == _alone(ckpt, prompts[2], 12)
    assert batcher.kv.rows_free == 2


def test_a_sequence_paused_mid_prefill_starts_its_prefill_again(ckpt: TextCheckpoint) -> None:
    prompts = [_prompt(ckpt, q) for q in QUESTIONS[:2]]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=2, slot_len=256)
    batcher.prefill_chunk = 8
    first = Sequence("first", prompts[0], SamplingParams(max_new_tokens=10))
    second = Sequence("second", prompts[1], SamplingParams(max_new_tokens=10))
    admit(batcher, first)
    admit(batcher, second)
    finish(batcher, batcher.step())
    assert second.logits is None and second.prefilled == 16
    slot = batcher.pause(second)
    assert slot is not None and second not in batcher.running and not second.tokens
    batcher.kv.free(slot)
    admit(batcher, second)  # from its first token again, a chunk at a time
    assert second.prefilled == 8
    while batcher.running:
        finish(batcher, batcher.step())
    assert first.tokens == _alone(ckpt, prompts[0], 10) and second.tokens == _alone(ckpt, prompts[1], 10)


def test_ignore_eos_runs_every_token_the_model_would_have_stopped_at(ckpt: TextCheckpoint) -> None:
    # Every token an end of text: a sequence stops at its first, unless it ignores them
    # (a timed or compared run that must decode exactly its tokens).
    every = frozenset(range(ckpt.model.config.vocab_size))
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, every, slots=2, slot_len=128)
    ids = _prompt(ckpt, "Name a colour.")
    stops, runs = batcher.run_all(
        [
            Sequence("stops", ids, SamplingParams(max_new_tokens=6)),
            Sequence("runs", ids, SamplingParams(max_new_tokens=6, ignore_eos=True)),
        ]
    )
    assert (stops.finish, len(stops.tokens)) == ("eos", 0)
    assert (runs.finish, len(runs.tokens)) == ("length", 6)
    assert runs.tokens == _alone(ckpt, ids, 6)
