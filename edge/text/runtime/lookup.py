"""Drafts for speculative decoding by prompt lookup: the tokens that followed the most
recent earlier occurrence of a sequence's last few tokens.

Answers that quote their context (a passage's hours, a dose, a leaflet's steps) repeat
runs of the prompt's tokens: where the last n tokens generated appeared before, what
followed them there is a cheap guess at what comes next. No second model is needed; the
batcher verifies every guess against the model's own choice (continuous.py), so a wrong
draft costs only the positions it wasted in one verification pass.
"""

from __future__ import annotations

MAX_NGRAM = 3
# A match of the last token alone is not enough to draft from: on the CPU's clinic answers
# (bench/speculative.py's questions, 3 drafts a step) what followed a lone token's match
# was taken 62% of the time against 74% with two or more, and a verification's extra rows
# cost about half a step each there (the int8 kernel's products grow with their rows), so
# the drafts it skips were losing more than they won: replayed on the answers' tokens with
# the measured costs, 3-4% fewer seconds an answer.
MIN_NGRAM = 2


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens` (n from `max_ngram` down to `min_ngram`, the longest match first:
    a longer match is more likely to go on the same way); [] where none occurs."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = tokens[size - n :]
        # The most recent occurrence first: what the sequence says last is likelier to be
        # what it is quoting now. Occurrences ending at the tail itself are not matches.
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
