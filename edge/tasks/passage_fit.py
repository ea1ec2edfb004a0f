"""Which retrieved passages a `qa` job's prompt can hold: as many of the best as fit the
context window with room left for the answer, the lowest-ranked dropped first.

Retrieval hands back top_k passages whatever their length; a window too small for all of
them is no fault of the job's, so the job is answered from those that fit and its result
says how many were dropped (`passages_dropped`). A job's image takes its rows' positions
before any passage is fitted. Only a question (with the job's own context and image) that
cannot fit alone is `prompt_too_long`, which the job's sequence reports."""

from __future__ import annotations

from collections.abc import Sequence

from edge.docs.retrieve import Passage, context_of
from edge.text.prompt import Prompter

# The answer's room is the job's max_new_tokens, but never more than this share of the
# window: a job asking for a long answer still gets its documents (it is then told
# finish_reason "length" where the answer outgrows what is left).
ANSWER_SHARE = 4


def context_with(own: str | None, passages: list[Passage]) -> str | None:
    """The job's own context (first) and the passages, as the prompt's context."""
    parts = [own.strip()] if own and own.strip() else []
    if passages:
        parts.append(context_of(passages))
    return "\n".join(parts) or None


def fit_passages(
    prompter: Prompter,
    window: int,
    new_tokens: int,
    question: str,
    own: str | None,
    passages: list[Passage],
    image_tokens: Sequence[int] = (),
) -> list[Passage]:
    """The leading passages (best first) whose prompt leaves room for the answer: the
    most that fit, found by bisection (a passage more never makes a prompt shorter).
    `image_tokens`: the prompt positions each of the job's images takes (its rows): the
    prompt holds its image token once per row, so the passages get what the window
    leaves after the images, the question and the answer's room."""
    room = min(new_tokens, window // ANSWER_SHARE)
    images = len(image_tokens)
    # The template writes one image token per image; each becomes that image's rows.
    rows = sum(image_tokens) - images

    def fits(n: int) -> bool:
        return len(prompter.ids(question, context_with(own, passages[:n]), images=images)) + rows + room <= window

    if fits(len(passages)):
        return passages
    low, high = 0, len(passages) - 1
    while low < high:  # the most that fit is in [low, high)
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return passages[:low]
