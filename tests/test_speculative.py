"""Speculative decoding by prompt lookup (edge/text/runtime/lookup.py, and its verification
in ContinuousBatcher.step): drafts proposed from the sequence's own tokens, and on the
real SmolLM2 greedy answers token for token those of plain decoding, ending where it
ends."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.kv_quant import FORMATS
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.model.llama import LlamaModel
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
    # No trigram match: the bigram (2, 3)'s; the last token alone only where asked for
    # (min_ngram 1): by default a lone token's match drafts nothing.
    assert propose([2, 3, 6, 6, 1, 2, 3], k=3) == [6, 6, 1]
    assert propose([5, 8, 4, 0, 8], k=2, min_ngram=1) == [4, 0]
    assert propose([5, 8, 4, 0, 8], k=2) == []
    # Fewer followers than k: what there is.
    assert propose([4, 5, 6, 4, 5], k=4) == [6, 4, 5]


def test_the_gpu_projection_is_made_again_at_a_new_acceptance() -> None:
    """bench/speculative.py keeps the GPU's measured verification times when the CPU rows
    are measured again, and makes their projection again at the new acceptance rate."""
    from bench.speculative import default_acceptance, expected_tokens, project

    rows: list[dict[str, Any]] = [
        {"acceptance_rate": None, "default": False},
        {"acceptance_rate": 0.5, "default": True},
    ]
    assert default_acceptance(rows) == 0.5
    old = {"k": 2, "verify_ms": 4.0, "decode_ms": 2.0, "ratio": 2.0, "projected_speedup": 9.0}
    new = project(old, 0.5)
    assert new["projected_tokens_per_step"] == expected_tokens(0.5, 2) == 1.75
    assert new["projected_speedup"] == 1.75 * 2.0 / 4.0 and new["verify_ms"] == 4.0
    assert "projected_speedup" not in project(old, None)


def test_propose_without_a_match_or_room_gives_nothing() -> None:
    assert propose([1, 2, 3, 4], k=4) == []
    assert propose([7], k=4) == []
    assert propose([1, 2, 1, 2], k=0) == []
    # The longest match is tried first, down to max_ngram.
    assert propose([9, 1, 2, 8, 3, 1, 2], k=1, max_ngram=1, min_ngram=1) == [8]
    assert propose([9, 1, 2, 8, 3, 2], k=1, max_ngram=1, min_ngram=1) == [8]


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
    # Together, beside a sequence that samples with a nucleus cut (and so never
    # speculates): the same tokens again, the sampled one's too (its draws are its own
    # generator's, whatever the batch does).
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.9, seed=7)
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


SCORE_SCALE = 2.0


def _chi2_limit(dof: int, z: float = 3.09) -> float:
    """The chi-squared statistic a true hypothesis exceeds with probability 0.001 (z is
    that tail's normal quantile), by the Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_drafts_keep_the_sampling_distribution() -> None:
    """Sampled sequences speculate too, their drafts taken by the rejection rule: the
    continuations they draw have the distribution the model gives them. A model small
    enough that the exact distribution of its three-token continuations is computed
    whole; thousands of sequences drawn with speculation; a chi-squared test on every
    token's distribution after the first (the ones drafts cover), and on the last
    two's joint. Taking drafts as greedy decoding does, or drawing again from the whole
    distribution after a draft is turned down, fails it."""
    vocab, steps, n = 6, 3, 1536
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    torch.manual_seed(0)
    model = LlamaModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(SCORE_SCALE)  # scores spread enough that drafts are both taken and turned down
    # A prompt whose every short tail occurred before: each step has a draft.
    prompt = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(3)).tolist()

    @torch.no_grad()
    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([prompt + p for p in prefixes])
        logits = model(ids, model.new_cache(len(prefixes), 32), 0, last_only=False)[:, -1]
        return torch.softmax(logits.float(), dim=-1)

    # The exact joint distribution of (t1, t2, t3).
    joint = next_probs([[]])[0]
    for depth in range(1, steps):
        prefixes = [list(t) for t in itertools.product(range(vocab), repeat=depth)]
        joint = (joint.reshape(-1, 1) * next_probs(prefixes)).reshape(-1)
    joint = joint.reshape((vocab,) * steps).double()

    batcher = ContinuousBatcher(model, None, frozenset(), 64, 32)
    batcher.speculative_tokens = 4
    params = [SamplingParams(max_new_tokens=steps, temperature=1.0, seed=i) for i in range(n)]
    seqs = batcher.run_all([Sequence(i, prompt, p) for i, p in enumerate(params)])
    assert all(len(s.tokens) == steps for s in seqs)
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    assert accepted > 0.05 * drafted and drafted - accepted > 0.05 * drafted, (accepted, drafted)  # both, often
    counts = torch.zeros((vocab,) * steps, dtype=torch.float64)
    for s in seqs:
        counts[tuple(s.tokens)] += 1

    def chi2(observed: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
        # Bins expected to hold fewer than 5 pooled into one.
        expected = expected_p.reshape(-1) * n
        observed = observed.reshape(-1)
        small = expected < 5
        e = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        o = torch.cat([observed[~small], observed[small].sum().reshape(1)])
        keep = e > 0
        return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1

    checks = {
        "t2": (counts.sum(dim=(0, 2)), joint.sum(dim=(0, 2))),
        "t3": (counts.sum(dim=(0, 1)), joint.sum(dim=(0, 1))),
        "t2 t3": (counts.sum(dim=0), joint.sum(dim=0)),
    }
    for name, (observed, expected) in checks.items():
        stat, dof = chi2(observed, expected)
        assert stat < _chi2_limit(dof), f"{name}: chi-squared {stat:.1f} over {dof} degrees of freedom"
