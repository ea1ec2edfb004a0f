"""An answer's citations, read and checked against the passages its job retrieved.

The clinic adapter cites a passage as `(source: <chunk id>)` after the sentence that uses it
(engines/text/clinic_data.py). Each cited id is checked, never passed on silently:

- `retrieved`: the id is one of the passages this job retrieved (a model can make ids up);
- `about`: every name the question asks about (a medicine, a ward, a device and its model
  number) is in the passage or its title: a question naming Dexidone is not answered by
  Dexolan's leaflet, however alike the two leaflets read;
- the citing sentence's facts are in the passage: every number with its unit ("6 hours" is
  not "6 days"; "every eight hours" reads as 8 hours), every ordinal ("third floor"), every
  name, and (`overlap`) at least SUPPORT_MIN of its content words; of the words the question
  did not already hold (what the answer claims), at least CLAIM_MIN;
- the citing sentence answers what the question asks: it shares a word with the question
  beyond the names and the words naming the entity ("What extension do I call for Ward 7A?" is not
  answered by "The nurse in charge is Oskar Brennan", true as that is);
- `supported`: all of the above, for every sentence citing it; `missing` lists what was not
  found, as "number 6 h", "name dexolan", "question's dexidone", "words", "question's ask".

What this checks: that the answer's facts are stated in the passage it cites, about what
was asked. What it cannot check: that the passage itself is medically right.

Written here rather than taken from a library: the quantity parsers on PyPI read "2 to 8 °C"
as one averaged value and "5 minutes" as an angle unless a classifier trained on
Wikipedia is installed beside them, and what this needs is an exact match of the surface
numbers with a small table of the units clinic documents use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

CITATION = re.compile(r"\(\s*source:\s*([^()]+?)\s*\)", re.IGNORECASE)
WORD = re.compile(r"[a-z0-9]+(?:[.,:][0-9]+)*")
SENTENCE_END = re.compile(r"[.!?](?:\s+|$)|\n")
SUPPORT_MIN = 0.5
CLAIM_MIN = 0.75
STOPWORDS = frozenset(
    """the and for are but not you all any can her was one our out day get has him his how man new now old see two
    way who its let put say she too use with that this from they have been were will your what when which their there
    them then than into also only some such more most very just over under about after before while where does did
    each other should would could may might must shall these those here being because between both during through
    until again further once why own same nor off yes""".split()
)
# Capitalized at the start of a sentence without being a name (checked in lower case).
OPENERS = STOPWORDS | frozenset(
    """a an i if in on at to of as is it be do no so or my me we us can may yes please take keep call switch clean
    arrive adults store use wait press check avoid tell ask contact change wash never always usually visiting
    visitors patients people note however sorry most don't can't i'm it's you're there's ok okay sure""".split()
)
NUMBER_WORDS = {
    "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8",
    "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "fifteen": "15", "twenty": "20", "thirty": "30",
    "forty": "40", "forty-five": "45", "fifty": "50", "sixty": "60", "ninety": "90", "hundred": "100",
}  # fmt: skip
ORDINALS = {
    "ground": "0", "first": "1", "second": "2", "third": "3", "fourth": "4", "fifth": "5", "sixth": "6",
    "seventh": "7", "eighth": "8", "ninth": "9", "tenth": "10", "1st": "1", "2nd": "2", "3rd": "3", "4th": "4",
    "5th": "5",
}  # fmt: skip
UNITS = {
    "h": "h", "hr": "h", "hrs": "h", "hour": "h", "hours": "h",
    "min": "min", "mins": "min", "minute": "min", "minutes": "min",
    "s": "s", "sec": "s", "secs": "s", "second": "s", "seconds": "s",
    "day": "d", "days": "d", "week": "wk", "weeks": "wk", "month": "mo", "months": "mo", "year": "y", "years": "y",
    "mg": "mg", "milligram": "mg", "milligrams": "mg", "g": "g", "gram": "g", "grams": "g",
    "mcg": "mcg", "µg": "mcg", "microgram": "mcg", "micrograms": "mcg", "kg": "kg",
    "ml": "ml", "millilitre": "ml", "millilitres": "ml", "milliliter": "ml", "milliliters": "ml", "l": "l",
    "°c": "°c", "c": "°c", "degrees": "°c", "%": "%", "percent": "%", "am": "am", "pm": "pm",
    "mmhg": "mmhg", "bpm": "bpm", "units": "units", "tablets": "tablets", "tablet": "tablets",
    "visitors": "visitors", "visitor": "visitors", "doses": "doses", "dose": "doses",
}  # fmt: skip
_NUMBER = r"\d+(?:[.:]\d+)?"
QUANTITY = re.compile(
    rf"(?<![\w.-])({_NUMBER})(?:\s*(?:to|-|–|and)\s*({_NUMBER}))?(?:\s*(°\s*c\b|%|[a-zµ]+))?", re.IGNORECASE
)
TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’-]*")
CODE = re.compile(r"(?=.*\d)(?=.*[A-Za-z])")  # a model number or a ward code: P-636, 4B


@dataclass(frozen=True)
class Facts:
    """What a piece of text states that a check can find again: numbers with their units
    (unit "" where none follows), ordinals, names (lower case) and content words."""

    numbers: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    names: frozenset[str] = field(default_factory=frozenset)
    words: frozenset[str] = field(default_factory=frozenset)


class Cited(Protocol):
    """A retrieved passage as the check reads it (edge/docs/retrieve.Passage)."""

    @property
    def id(self) -> str: ...

    @property
    def score(self) -> float: ...

    @property
    def text(self) -> str: ...

    @property
    def title(self) -> str: ...


def content_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if (len(w) >= 3 or w.isdigit()) and w not in STOPWORDS}


def _value(number: str) -> str:
    return number.removesuffix(".0") if "." in number and ":" not in number else number


def _spelled(text: str) -> str:
    """Number words and ordinals as digits: "every eight hours" reads as "every 8 hours"."""

    def swap(match: re.Match[str]) -> str:
        word = match.group(0)
        low = word.lower()
        if low in NUMBER_WORDS:
            return NUMBER_WORDS[low]
        return word

    return re.sub(r"[A-Za-z]+(?:-[A-Za-z]+)?", swap, text)


def _names(text: str) -> set[str]:
    """Names, in lower case: capitalized words that are not common sentence openers, words
    in capitals, and codes mixing letters and digits (P-636, 4B; not "6h" or "5mg")."""
    out: set[str] = set()
    for match in TOKEN.finditer(text):
        word = match.group(0).strip("'’-")
        low = word.lower()
        if len(word) < 2 or low in UNITS or low in NUMBER_WORDS or low in ORDINALS:
            continue
        if CODE.match(word):
            quantity = re.fullmatch(r"\d+(?:\.\d+)?([a-zµ°%]+)", low)
            if quantity is None or quantity.group(1) not in UNITS:
                out.add(low)
        elif word[0].isupper() and (word.isupper() or low not in OPENERS):
            out.add(low)
    return out


def facts_of(text: str) -> Facts:
    spelled = _spelled(text)
    numbers: set[tuple[str, str]] = set()
    for match in QUANTITY.finditer(spelled):
        unit_word = (match.group(3) or "").lower().replace(" ", "")
        unit = UNITS.get(unit_word, "")
        for number in (match.group(1), match.group(2)):
            if number is not None:
                numbers.add((_value(number), unit))
    for word in TOKEN.findall(spelled):
        low = word.lower()
        if low in ORDINALS:
            numbers.add((ORDINALS[low], "th"))
    return Facts(frozenset(numbers), frozenset(_names(text)), frozenset(content_words(spelled)))


def _has_number(passage: Facts, number: tuple[str, str]) -> bool:
    value, unit = number
    return any(v == value and (unit == u or not unit or not u) for v, u in passage.numbers if u != "th") or (
        unit == "th" and number in passage.numbers
    )


def held_words(text: str) -> set[str]:
    """Every word of `text` in lower case, number words as digits: what a name is looked up in."""
    return {w.lower() for w in TOKEN.findall(_spelled(text))}


ASKING = frozenset("how what which when where who whom whose can could should long much many often kind".split())
PREFIX = 5  # letters two words must share to count as one ("visitors", "visiting")


def _entity_words(question: str, names: frozenset[str]) -> set[str]:
    """Words naming what the question asks about, beside its names: the run of words just
    before a name ("infusion pump" in "the infusion pump IP-315")."""
    tokens = [t.lower() for t in TOKEN.findall(question)]
    out: set[str] = set()
    for i, token in enumerate(tokens):
        if token in names:
            j = i - 1
            while j >= 0 and tokens[j] not in STOPWORDS and tokens[j] not in OPENERS:
                out.add(tokens[j])
                j -= 1
    return out


def _alike(a: str, b: str) -> bool:
    return a == b or (min(len(a), len(b)) >= PREFIX and a[:PREFIX] == b[:PREFIX])


def addresses(question: str, sentence: str) -> bool:
    """Whether `sentence` answers what `question` asks: the two share a word (or its first
    five letters) beyond the question's names, the words naming its entity and the asking
    words. A question with no such word is taken as answered."""
    asked = facts_of(question)
    skip = asked.names | _entity_words(question, asked.names) | ASKING
    focus = {w for w in asked.words if not w.isdigit()} - skip
    if not focus:
        return True
    said = content_words(_spelled(sentence))
    return any(_alike(f, w) for f in focus for w in said)


def missing_facts(sentence: str, passage_text: str, question: str | None = None) -> tuple[list[str], float]:
    """What of `sentence` (and of the question's names) `passage_text` does not state, and
    the share of the sentence's content words it holds."""
    said = facts_of(sentence)
    held = facts_of(passage_text)
    words = held_words(passage_text) | held.words
    missing: list[str] = []
    for value, unit in sorted(said.numbers):
        if not _has_number(held, (value, unit)):
            missing.append(f"number {value} {unit}".rstrip())
    missing += [f"name {name}" for name in sorted(said.names) if name not in words]
    asked = facts_of(question) if question else Facts()
    missing += [f"question's {name}" for name in sorted(asked.names) if name not in words]
    overlap = len(said.words & held.words) / len(said.words) if said.words else 0.0
    claims = said.words - asked.words - {v for v, _ in said.numbers}
    if overlap < SUPPORT_MIN or (claims and len(claims & held.words) / len(claims) < CLAIM_MIN):
        missing.append("words")
    if question and not addresses(question, sentence):
        missing.append("question's ask")
    return missing, overlap


def citing_sentences(answer: str) -> list[tuple[str, str]]:
    """(cited id, the sentence citing it) for every citation in the answer, in order. A
    sentence is the text from the end of the previous sentence (or citation) to its
    citation; one whose words all precede another citation is judged by that sentence."""
    out: list[tuple[str, str]] = []
    start = 0
    last_words = ""
    for match in CITATION.finditer(answer):
        before = answer[start : match.start()]
        ends = [m.end() for m in SENTENCE_END.finditer(before) if m.end() < len(before.rstrip())]
        sentence = before[ends[-1] :] if ends else before
        if not content_words(sentence):  # "... (source: a) (source: b)": b cites a's sentence
            sentence = last_words
        for cited in (part.strip() for part in match.group(1).split(",")):
            if cited:
                out.append((cited, sentence))
        last_words = sentence
        start = match.end()
    return out


def cited_ids(answer: str) -> list[str]:
    """Every id the answer cites, in order (repeats kept), as check_citations reads them."""
    return [cited for cited, _ in citing_sentences(answer)]


def check_citations(answer: str, passages: list[Any], question: str | None = None) -> list[dict[str, Any]]:
    """One entry per cited id, in the order first cited: id, the retrieval score (None if
    it was not retrieved), retrieved, overlap (the lowest over its sentences), supported,
    and what the passage was missing. `passages`: Cited."""
    by_id = {p.id: p for p in passages}
    found: dict[str, dict[str, Any]] = {}
    for cited, sentence in citing_sentences(answer):
        passage = by_id.get(cited)
        missing: list[str] = ["retrieval"]
        overlap = 0.0
        if passage is not None:
            missing, overlap = missing_facts(sentence, f"{passage.title}\n{passage.text}", question)
        entry = found.setdefault(
            cited,
            {
                "id": cited,
                "score": None if passage is None else round(passage.score, 4),
                "retrieved": passage is not None,
                "overlap": overlap,
                "supported": True,
                "missing": [],
            },
        )
        entry["overlap"] = round(min(entry["overlap"], overlap), 3)
        entry["missing"] = sorted(set(entry["missing"]) | set(missing))
        entry["supported"] = not entry["missing"]
    return list(found.values())


def uncited_facts(answer: str, citations: list[dict[str, Any]], passages: list[Any]) -> list[str]:
    """Numbers and names the answer states outside its cited passages: an answer is only
    as grounded as its least supported fact, cited or not."""
    cited = {c["id"] for c in citations if c["retrieved"]}
    text = "\n".join(f"{p.title}\n{p.text}" for p in passages if p.id in cited)
    said = facts_of(CITATION.sub(" ", answer))
    held = facts_of(text)
    words = held_words(text)
    out = [f"number {v} {u}".rstrip() for v, u in sorted(said.numbers) if not _has_number(held, (v, u))]
    return out + [f"name {n}" for n in sorted(said.names) if n not in words]
