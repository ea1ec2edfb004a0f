"""Speculative decoding by prompt lookup (edge/text/runtime/lookup.py, and its verification
in ContinuousBatcher.step): drafts proposed from the sequence's own tokens, and on the
real SmolLM2 greedy answers token for token those of plain decoding, ending where it
ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.text.kv.kv_quant import FORMATS
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.prompt import chatml, user_message
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from edge.text.runtime.lookup import propose
from engines.text.import_gguf import import_smollm2

LEAFLETS = Path(__file__).resolve().parents[1] / "samples" / "leaflets"

PASSAGE = (
    "Change the dressing every 48 hours, or sooner if it is wet. Report redness, swelling or fever "
    "above 38 °C to the nurse. Keep the wound dry for the first two days."
)


def test_propose_takes_what_followed_the_latest_longest_match() -> None:
    # The last three tokens (1, 2, 3) occurred twice before: the later one's followers win.
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3], k=2) == [7, 8]
    # No trigram match: the bigram (2, 3)'s, before falling back to the last token alone.
    assert propose([2, 3, 6, 6, 1, 2, 3], k=3) == [6, 6, 1]
    assert propose([5, 8, 4, 0, 8], k=2) == [4, 0]
    # Fewer followers than k: what there is.
    assert propose([4, 5, 6, 4, 5], k=4) == [6, 4, 5]


def test_propose_without_a_match_or_room_gives_nothing() -> None:
    assert propose([1, 2, 3, 4], k=4) == []
    assert propose([7], k=4) == []
    assert propose([1, 2, 1, 2], k=0) == []
    # The longest match is tried first, down to max_ngram.
    assert propose([9, 1, 2, 8, 3, 1, 2], k=1, max_ngram=1) == [8]
    assert propose([9, 1, 2, 8, 3, 2], k=1, max_ngram=1) == [8]


@pytest.fixture(scope="module")
def ckpt(engine_dir: Path) -> TextCheckpoint:
    return load_checkpoint(import_smollm2(engine_dir, progress=False))


def _ids(ckpt: TextCheckpoint, question: str, context: str | None) -> list[int]:
    text = chatml("Answer from the context.", user_message(question, context))
    return list(ckpt.tokenizer.encode(text, add_special_tokens=False).ids)


def _prompts(ckpt: TextCheckpoint) -> list[list[int]]:
    """Prompts whose answers repeat their own text: a passage to quote, and the sample
    leaflets with the demo's questions about them."""
    pump = (LEAFLETS / "pump.md").read_text()
    pharmacy = (LEAFLETS / "pharmacy.md").read_text()
    return [
        _ids(ckpt, "Quote the passage word for word.", PASSAGE),
        _ids(ckpt, "How long does the pump battery last?", pump),
        _ids(ckpt, "When is the pharmacy open on Saturdays?", pharmacy),
        _ids(ckpt, "Repeat the leaflet's first paragraph exactly.", pump),
    ]


def _decode(
    ckpt: TextCheckpoint,
    prompts: list[list[int]],
    params: list[SamplingParams],
    speculative: int,
    kv_dtype: str = "float16",
) -> tuple[list[Sequence], ContinuousBatcher]:
    fmt = FORMATS[kv_dtype] if kv_dtype != "float16" else None  # type: ignore[index]
    batcher = ContinuousBatcher(ckpt.model, ckpt.tokenizer, ckpt.eos_ids, len(prompts), 1024, fmt)
    batcher.speculative_tokens = speculative
    seqs = [Sequence(i, p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    return batcher.run_all(seqs), batcher


def test_greedy_answers_are_identical_alone_and_batched(ckpt: TextCheckpoint) -> None:
    prompts = _prompts(ckpt)
    greedy = SamplingParams(max_new_tokens=48)
    for prompt in prompts:  # each alone
        (plain,), _ = _decode(ckpt, [prompt], [greedy], 0)
        (spec,), batcher = _decode(ckpt, [prompt], [greedy], 4)
        assert spec.tokens == plain.tokens
        assert spec.finish == plain.finish and spec.text == plain.text
        assert plain.drafted == plain.accepted == 0
        assert 0 <= spec.accepted <= spec.drafted
    # Together, beside a sequence that samples (and so never speculates): the same tokens
    # again, the sampled one's too (its draws are its own generator's, whatever the batch does).
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, seed=7)
    params = [greedy] * len(prompts) + [sampled]
    mixed = [*prompts, _ids(ckpt, "Name three symptoms of dehydration.", None)]
    plain_all, _ = _decode(ckpt, mixed, params, 0)
    spec_all, batcher = _decode(ckpt, mixed, params, 4)
    assert [s.tokens for s in spec_all] == [s.tokens for s in plain_all]
    assert spec_all[-1].drafted == 0
    accepted = sum(s.accepted for s in spec_all)
    assert accepted > 0  # drafting engaged, and the model took some of it
    # Fewer steps than tokens: some steps took more than one token.
    assert batcher.steps < max(len(s.tokens) for s in spec_all) + len(mixed)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_greedy_answers_are_identical_over_a_quantized_cache(ckpt: TextCheckpoint, kv_dtype: str) -> None:
    prompts = _prompts(ckpt)[:2]
    greedy = [SamplingParams(max_new_tokens=80)] * 2
    plain, _ = _decode(ckpt, prompts, greedy, 0, kv_dtype)
    spec, _ = _decode(ckpt, prompts, greedy, 4, kv_dtype)
    assert [s.tokens for s in spec] == [s.tokens for s in plain]
    assert sum(s.accepted for s in spec) > 0


def test_stop_strings_and_max_new_tokens_end_where_plain_decoding_does(ckpt: TextCheckpoint) -> None:
    # The leaflet's paragraph, which the answer repeats in runs the model accepts as drafts.
    prompt = _prompts(ckpt)[3]
    (full,), _ = _decode(ckpt, [prompt], [SamplingParams(max_new_tokens=48)], 4)
    assert "RESUME" in full.text and full.accepted > 0
    # Stop strings that fall inside those runs, and limits at every length up to past them.
    stops = [SamplingParams(max_new_tokens=48, stop=(s,)) for s in ("RESUME", "line for", "clamps,")]
    for params in stops + [SamplingParams(max_new_tokens=n) for n in range(1, 25)]:
        (plain,), _ = _decode(ckpt, [prompt], [params], 0)
        (spec,), _ = _decode(ckpt, [prompt], [params], 4)
        assert (spec.tokens, spec.text, spec.finish) == (plain.tokens, plain.text, plain.finish), params
        if params.stop:
            assert spec.finish == "stop" and spec.accepted > 0
            assert len(spec.tokens) < len(full.tokens)
