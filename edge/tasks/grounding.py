"""Grounding: what a `qa` result from a collection may state as fact (models.qa.grounding).

Every qa result says `grounded`: true when the answer cites at least one passage, every
citation is supported (edge/docs/citations.py) and no number or name of the answer lies
outside its cited passages; false otherwise; null when no collection was asked for (the
answer comes from the model's weights and nothing checked it). `grounding` says what was
done about it:

- "grounded": checked and passed on;
- "flagged": not grounded, passed on marked so (policy flag or off);
- "abstained": withheld under policy require: the answer says the documents do not answer
  the question and quotes the closest passage (`abstain_reason`: "unsupported", or
  "low_score" / "no_passages" / "no_collection" when nothing was generated);
- "unchecked": no collection, nothing to check against.

Where the model's answer is not grounded and `extractive_fallback` is on (the default; not
under policy off), the answer becomes the sentence of a retrieved passage that answers the
question, verbatim with its citation (`answer_source: "passage"`): of the passages'
sentences that name everything the question names, the one sharing most words with what it
asks (edge/docs/citations.Asked); checked like any answer. The shipped 135M model
often says "the documents given do not say" with the answer in front of it; the passage's
own sentence is then right wherever retrieval is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from edge.config.text import QAModelConfig
from edge.docs.citations import Asked, check_citations, held_words, sentences_of, uncited_facts
from edge.docs.retrieve import Passage

QUOTE_MAX = 400  # characters of the closest passage quoted in an abstention


@dataclass(frozen=True)
class GroundingPolicy:
    """What models.qa says about grounding (edge/config/text.py holds the defaults)."""

    mode: Literal["off", "flag", "require"]
    abstain_below: float
    abstain_answer: str
    require_collection: bool
    extractive_fallback: bool

    @classmethod
    def of(cls, cfg: QAModelConfig) -> GroundingPolicy:
        return cls(
            cfg.grounding, cfg.abstain_below, cfg.abstain_answer, cfg.require_collection, cfg.extractive_fallback
        )


def passages_out(passages: list[Passage]) -> list[dict[str, Any]]:
    """The passages as a result lists them: verbatim, best first."""
    return [{"id": p.id, "score": round(p.score, 4), "title": p.title, "text": p.text} for p in passages]


def _abstention(policy: GroundingPolicy, passages: list[Passage]) -> str:
    if not passages:
        return policy.abstain_answer
    best = passages[0]
    quote = best.text if len(best.text) <= QUOTE_MAX else best.text[:QUOTE_MAX].rsplit(" ", 1)[0] + " …"
    return f'{policy.abstain_answer} The closest passage (source: {best.id}) says: "{quote}"'


def before_generating(
    policy: GroundingPolicy, retrieving: bool, passages: list[Passage] | None
) -> dict[str, Any] | None:
    """The result of a question that abstains without generating, or None to generate:
    one asked without a collection where the profile requires one; under require, one
    whose collection gave no passage, or whose best passage scores under abstain_below."""
    if not retrieving:
        reason = "no_collection" if policy.require_collection else None
    elif policy.mode != "require":
        reason = None
    elif not passages:
        reason = "no_passages"
    elif max(p.score for p in passages) < policy.abstain_below:
        reason = "low_score"
    else:
        reason = None
    if reason is None:
        return None
    shown = passages or []
    return {
        "answer": _abstention(policy, shown),
        "finish_reason": "abstained",
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "grounded": False,
        "grounding": "abstained",
        "abstain_reason": reason,
        "citations": [],
        "passages": passages_out(shown),
    }


def extract(question: str, passages: list[Passage]) -> str | None:
    """The sentence of a retrieved passage that answers `question`, with its citation; None
    where none does: of the sentences (not questions) that name everything the question
    names, the one sharing most words with what it asks, best passage first among equals."""
    asked = Asked.of(question)
    best: tuple[int, str] | None = None
    for p in passages:
        for sentence in sentences_of(p.text, clauses=True):
            if sentence.endswith("?") or not asked.names <= held_words(sentence):
                continue
            shared = asked.shared(sentence)
            if shared != 0 and (best is None or shared > best[0]):
                best = (shared, f"{' '.join(sentence.split()).rstrip('.;')}. (source: {p.id})")
    return None if best is None else best[1]


def _checked(answer: str, question: str, passages: list[Passage]) -> tuple[list[dict[str, Any]], list[str], bool]:
    citations = check_citations(answer, passages, question)
    outside = uncited_facts(answer, citations, passages)
    return citations, outside, bool(citations) and all(c["supported"] for c in citations) and not outside


def judge(
    policy: GroundingPolicy, out: dict[str, Any], question: str, passages: list[Passage] | None
) -> dict[str, Any]:
    """`out` (a generated result) with its citations checked and the policy applied."""
    if passages is None:
        return {**out, "grounded": None, "grounding": "unchecked"}
    answer = out["answer"]
    citations, outside, grounded = _checked(answer, question, passages)
    source = "model"
    if not grounded and policy.extractive_fallback and policy.mode != "off":
        quoted = extract(question, passages)
        if quoted is not None:
            checked = _checked(quoted, question, passages)
            if checked[2]:
                answer, (citations, outside, grounded), source = quoted, checked, "passage"
    judged = {
        **out,
        "answer": answer,
        "answer_source": source,
        "citations": citations,
        "passages": passages_out(passages),
        "grounded": grounded,
    }
    if outside:
        judged["uncited"] = outside
    if grounded:
        judged["grounding"] = "grounded"
    elif policy.mode == "require":
        judged.update(answer=_abstention(policy, passages), grounding="abstained", abstain_reason="unsupported")
    else:
        judged["grounding"] = "flagged"
    return judged
