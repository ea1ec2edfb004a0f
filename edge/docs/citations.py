"""An answer's citations, read and checked against the passages its job retrieved.

The clinic adapter cites a passage as `(source: <chunk id>)` after the sentence that uses it
(engines/text/clinic_data.py). Each cited id is checked, never passed on silently:

- `retrieved`: the id is one of the passages this job retrieved (a model can make ids up);
- `about`: every name the question asks about (a medicine, a ward, a device and its model
  number) is in the passage or its title: a question naming Dexidone is not answered by
  Dexolan's leaflet, however alike the two leaflets read;
- one sentence of the passage states the citing sentence's facts: every
  number with its unit ("6 hours" is not "6 days"; "every eight hours" reads as 8 hours; a
  number the passage gives no unit does not stand for one the sentence gives), every ordinal
  ("third floor"), every name, at least SUPPORT_MIN of its content words and, of the words
  the question did not already hold (what the answer claims), at least CLAIM_MIN; and says
  it with the same polarity ("take it with food" is not "do not take it with food"); and
  holds every word of the sentence and of the question that the passage holds anywhere, so
  facts scattered over a passage ("for adults 10 mg. For children 5 mg.") support no
  sentence that joins them otherwise ("apart");
- the citing sentence answers what the question asks: it states a number where the question
  asks for one (when, how long, how many...), and shares a word with the question beyond
  the names and the words naming the entity ("What extension do I call for Ward 7A?"
  is not answered by "The nurse in charge is Oskar Brennan", true as that is);
- `supported`: all of the above, for every sentence citing it; `missing` lists what was not
  found, as "number 6 h", "name dexolan", "question's dexidone", "words", "negation",
  "apart", "question's ask", "better passage" (another retrieved passage about the same names
  scores RANK_MARGIN higher), "retrieval".

An answer's sentences that cite nothing are held to its cited passages the same way
(`uncited_facts`). What this checks: that the answer's facts are stated in the passage it
cites, about what was asked. What it cannot check: that the passage itself is medically
right.

Written here rather than taken from a library: the quantity parsers on PyPI read "2 to 8 °C"
as one averaged value and "5 minutes" as an angle unless a classifier trained on
Wikipedia is installed beside them, and what this needs is an exact match of the surface
numbers with a small table of the units clinic documents use.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Protocol

# Linear: a "(source:" with nothing closing it costs one scan, not a cubic search.
CITATION = re.compile(r"\(\s*source:([^()]*)\)", re.IGNORECASE)
WORD = re.compile(r"[a-z0-9]+(?:[.,:][0-9]+)*")
SENTENCE_END = re.compile(r"[.!?](?:\s+|$)|\n")
# Where a passage's sentences part: never inside a hard-wrapped line. An extracted answer
# may also end at a semicolon (CLAUSE).
PASSAGE_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
CLAUSE = re.compile(r"(?<=[.!?;])\s+|\n\s*\n")
SUPPORT_MIN = 0.5
CLAIM_MIN = 0.75
# A cited passage scoring this far under the best retrieved passage about the same names
# is not what the question asks about ("better passage"): a model given two sections of one
# leaflet cites the dosage for a question about a missed dose.
RANK_MARGIN = 0.05
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
    visitors patients people note however sorry most don't can't i'm it's you're there's ok okay sure explain
    describe list give show name find help remind compare summarize summarise define unfortunately hi hello""".split()
)
NEGATIONS = frozenset(
    """not no never cannot can't don't doesn't didn't won't isn't aren't mustn't shouldn't avoid
    nicht kein keine nie pas jamais nunca""".split()
)
# Questions that ask for a number (a time, a length, an amount): answered only by a sentence
# that states one.
ASKS_NUMBER = re.compile(
    r"^\W*(?:when\b|how (?:long|often|many|much|early|late|far|soon)\b|what time\b|at what\b|which floor\b)",
    re.IGNORECASE,
)
DETERMINERS = frozenset("the a an my your our his her their this that".split())
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
    "mcg": "mcg", "μg": "mcg", "microgram": "mcg", "micrograms": "mcg", "kg": "kg",
    "ml": "ml", "millilitre": "ml", "millilitres": "ml", "milliliter": "ml", "milliliters": "ml", "l": "l",
    "°c": "°c", "c": "°c", "degrees": "°c", "%": "%", "percent": "%", "am": "am", "pm": "pm",
    "mmhg": "mmhg", "bpm": "bpm", "units": "units", "tablets": "tablets", "tablet": "tablets",
    "visitors": "visitors", "visitor": "visitors", "doses": "doses", "dose": "doses",
}  # fmt: skip
_NUMBER = r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:[.:/]\d+)?"
# A number not inside a word or a code ("P-636" holds none), with an optional sign, a range's
# second end, and the word after it (its unit).
QUANTITY = re.compile(
    rf"(?<![\w.,/])(?<!\w-)(-(?=\d))?({_NUMBER})(?:\s*(?:to|-|–|and)\s*({_NUMBER}))?(?:(\s*)(°\s*c\b|%|[a-zμ]+))?",
    re.IGNORECASE,
)
TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9'’-]*")
CODE = re.compile(r"(?=.*\d)(?=.*[A-Za-z])")  # a model number or a ward code: P-636, 4B


@dataclass(frozen=True)
class Facts:
    """What a piece of text states that a check can find again: numbers with their units
    (unit "" where none follows), ordinals, names (lower case), content words and whether
    it is negated."""

    numbers: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    names: frozenset[str] = field(default_factory=frozenset)
    words: frozenset[str] = field(default_factory=frozenset)
    negated: bool = False


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


def _normal(text: str) -> str:
    """NFKC (the micro sign is mu, "½" is "1⁄2"), the fraction slash a slash, and text
    written in capitals in lower case (its capitals name nothing)."""
    text = unicodedata.normalize("NFKC", text).replace("⁄", "/")
    letters = [c for c in text if c.isalpha()]
    if len(letters) >= 8 and sum(c.isupper() for c in letters) > 0.6 * len(letters):
        text = text.lower()
    return text


def content_words(text: str) -> set[str]:
    return {w for w in WORD.findall(text.lower()) if (len(w) >= 3 or w.isdigit()) and w not in STOPWORDS}


def _value(number: str, sign: str = "") -> str:
    value = number.replace(",", "") if re.fullmatch(r"\d{1,3}(?:,\d{3})+", number) else number
    if "." in value and ":" not in value and "/" not in value:
        value = value.rstrip("0").rstrip(".") or "0"
    return sign + value


def _spelled(text: str) -> str:
    """Number words as digits: "every eight hours" reads as "every 8 hours"."""

    def swap(match: re.Match[str]) -> str:
        word = match.group(0)
        return NUMBER_WORDS.get(word.lower(), word)

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
            quantity = re.fullmatch(r"\d+(?:\.\d+)?([a-zμ°%]+)", word)  # lower case: "6h", "5mg"
            if quantity is None or quantity.group(1) not in UNITS:
                out.add(low)
        elif word[0].isupper() and (word.isupper() or low not in OPENERS):
            out.add(low)
    return out


def facts_of(text: str) -> Facts:
    text = _normal(text)
    spelled = _spelled(text)
    numbers: set[tuple[str, str]] = set()
    for match in QUANTITY.finditer(spelled):
        unit_word = (match.group(5) or "").lower().replace(" ", "")
        attached = bool(match.group(5)) and not match.group(4)
        if attached and (unit_word not in UNITS or match.group(5).isupper()):
            continue  # letters right after the digits: a code ("Ward 3B", "Ward 8C"), no quantity
        # A word the table does not know is kept as itself ("3 pumps"), a common word is no unit.
        unit = UNITS.get(unit_word, "" if unit_word in OPENERS or len(unit_word) < 2 else unit_word)
        sign = match.group(1) or ""
        for number in (match.group(2), match.group(3)):
            if number is not None:
                numbers.add((_value(number, sign), unit))
    tokens = [w.lower() for w in TOKEN.findall(spelled)]
    numbers |= {(ORDINALS[w], "th") for w in tokens if w in ORDINALS}
    negated = any(w in NEGATIONS or w.endswith("n't") for w in tokens)
    return Facts(frozenset(numbers), frozenset(_names(text)), frozenset(content_words(spelled)), negated)


def _has_number(passage: Facts, number: tuple[str, str]) -> bool:
    """The passage states the number with the sentence's unit (any unit, where the sentence
    gives none)."""
    value, unit = number
    return any(v == value and (u == unit or (not unit and u != "th")) for v, u in passage.numbers)


def held_words(text: str) -> set[str]:
    """Every word of `text` in lower case, number words as digits: what a name is looked up in."""
    return {w.lower() for w in TOKEN.findall(_spelled(_normal(text)))}


ASKING = frozenset("how what which when where who whom whose can could should long much many often kind".split())
PREFIX = 5  # letters two words must share to count as one ("visitors", "visiting")


def _entity_words(question: str, names: frozenset[str]) -> set[str]:
    """Words naming what the question asks about, beside its names: a noun phrase's words
    before a name, after a determiner ("infusion pump" in "the infusion pump IP-315"; not
    "visit" in "when can I visit Ward 3B")."""
    tokens = [t.lower() for t in TOKEN.findall(_normal(question))]
    out: set[str] = set()
    for i, token in enumerate(tokens):
        if token in names:
            j = i - 1
            run: list[str] = []
            while j >= 0 and tokens[j] not in STOPWORDS and tokens[j] not in OPENERS:
                run.append(tokens[j])  # a brand or another name is part of the phrase
                j -= 1
            if j >= 0 and tokens[j] in DETERMINERS:
                out.update(run)
    return out


def _stem(word: str) -> str:
    for suffix in ("ing", "es", "ed", "s"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


# Words a clinic's questions ask with and its documents answer with: one family each, so
# "Where do I keep it?" is answered by "it must be stored...". Written by hand (a thesaurus
# would join far more than questions and answers share); the leaflet set tuned it, the
# near-duplicate set never did.
ALIASES = [
    {"keep", "kept", "store", "stored", "storage"}, {"dose", "dosage", "mg", "take", "taken"},
    {"wipe", "clean", "cleaning"}, {"power", "battery", "mains"}, {"fast", "eat", "eating"},
    {"ring", "call", "phone", "extension", "number"}, {"come", "arrive", "visit", "visiting"},
    {"early", "arrive", "before"}, {"see", "visit", "visiting"}, {"work", "return"},
    {"silence", "silences", "press", "button"}, {"effect", "effects"}, {"floor", "storey", "level"},
    {"miss", "missed", "forgot", "forget", "late"},
]  # fmt: skip


def _alike(a: str, b: str) -> bool:
    if any(a in family and b in family for family in ALIASES):
        return True
    a, b = _stem(a), _stem(b)
    return a == b or (min(len(a), len(b)) >= PREFIX and a[:PREFIX] == b[:PREFIX])


@dataclass(frozen=True)
class Asked:
    """What a question asks, read once for every sentence it is held against: its names,
    the words of what it asks (beyond its names, the words naming its entity and the asking
    words) and whether it asks for a number (when, how long...)."""

    names: frozenset[str]
    focus: frozenset[str]
    wants_number: bool

    @classmethod
    def of(cls, question: str) -> Asked:
        facts = facts_of(question)
        skip = facts.names | _entity_words(question, facts.names) | ASKING
        focus = frozenset(w for w in facts.words if not w.isdigit()) - skip
        return cls(facts.names, focus, bool(ASKS_NUMBER.match(_normal(question))))

    def shared(self, sentence: str) -> int:
        """How many words of what is asked `sentence` shares, a word's first five letters
        counting as the word; -1 where the question has none such; 0 where it asks for a
        number and the sentence states none."""
        if self.wants_number and not facts_of(sentence).numbers:
            return 0
        if not self.focus:
            return -1
        said = content_words(_spelled(_normal(sentence)))
        return sum(any(_alike(f, w) for w in said) for f in self.focus)

    def answered_by(self, sentence: str) -> bool:
        """Whether `sentence` answers what is asked: a question with no word of its own to
        share is taken as answered."""
        return self.shared(sentence) != 0


def addresses(question: str, sentence: str) -> bool:
    """Whether `sentence` answers what `question` asks (Asked.answered_by)."""
    return Asked.of(question).answered_by(sentence)


def sentences_of(text: str, clauses: bool = False) -> list[str]:
    """A passage's sentences (hard-wrapped lines joined): where facts must sit together; with
    `clauses`, parted at semicolons too."""
    return [" ".join(s.split()) for s in (CLAUSE if clauses else PASSAGE_SENTENCE).split(text) if s.strip()]


def _missing_in(said: Facts, asked: Facts, held: Facts, elsewhere: set[str]) -> list[str]:
    """What of the sentence one sentence of the passage (`held`) misses; names are looked up
    in the whole passage (a sentence may say "it" for the medicine its title names)."""
    missing = [f"number {v} {u}".rstrip() for v, u in sorted(said.numbers) if not _has_number(held, (v, u))]
    overlap = len(said.words & held.words) / len(said.words) if said.words else 0.0
    claims = said.words - asked.words - {v for v, _ in said.numbers}
    if overlap < SUPPORT_MIN or (claims and len(claims & held.words) / len(claims) < CLAIM_MIN):
        missing.append("words")
    if said.negated != held.negated:
        missing.append("negation")
    # What the sentence and the question say that the passage holds, it must hold here.
    if (said.words | asked.words) & elsewhere - held.words - said.names - asked.names:
        missing.append("apart")
    return missing


def missing_facts(
    sentence: str, passage_text: str, question: str | None = None, title: str = ""
) -> tuple[list[str], float]:
    """What of `sentence` (and of the question's names) the passage does not state, in the
    window of it that misses least, and the share of the sentence's content words the whole
    passage holds."""
    said = facts_of(sentence)
    asked = facts_of(question) if question else Facts()
    whole = facts_of(f"{title}\n{passage_text}")
    best: list[str] | None = None
    for window in sentences_of(passage_text) or [passage_text]:
        held = facts_of(f"{title}\n{window}")
        found = _missing_in(said, asked, held, set(whole.words))
        if best is None or len(found) < len(best):
            best = found
        if not found:
            break
    missing = list(best or [])
    passage_words = held_words(f"{title}\n{passage_text}")
    missing += [f"name {name}" for name in sorted(said.names) if name not in passage_words]
    missing += [f"question's {name}" for name in sorted(asked.names) if name not in passage_words]
    if question and not addresses(question, sentence):
        missing.append("question's ask")
    overlap = len(said.words & whole.words) / len(said.words) if said.words else 0.0
    return missing, overlap


def answer_sentences(answer: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(cited id, the sentence citing it) for every citation in the answer, in order, and
    the sentences that cite nothing. A citing sentence is the text from the end of the
    previous sentence (or citation) to its citation; one whose words all precede another
    citation is judged by that sentence."""
    cited: list[tuple[str, str]] = []
    uncited: list[str] = []
    start = 0
    last_words = ""
    for match in CITATION.finditer(answer):
        before = answer[start : match.start()]
        end = len(before.rstrip())
        ends = [m.end() for m in SENTENCE_END.finditer(before) if m.end() < end]
        sentence = before[ends[-1] :] if ends else before
        if ends:
            uncited.append(before[: ends[-1]])
        if not content_words(sentence):  # "... (source: a) (source: b)": b cites a's sentence
            sentence = last_words
        for part in match.group(1).split(","):
            if part.strip():
                cited.append((part.strip(), sentence))
        last_words = sentence
        start = match.end()
    uncited.append(answer[start:])
    rest = [s.strip() for text in uncited for s in SENTENCE_END.split(text)]
    return cited, [s for s in rest if content_words(s)]


def citing_sentences(answer: str) -> list[tuple[str, str]]:
    return answer_sentences(answer)[0]


def cited_ids(answer: str) -> list[str]:
    """Every id the answer cites, in order (repeats kept), as check_citations reads them."""
    return [cited for cited, _ in citing_sentences(answer)]


def check_citations(answer: str, passages: list[Any], question: str | None = None) -> list[dict[str, Any]]:
    """One entry per cited id, in the order first cited: id, the retrieval score (None if
    it was not retrieved), retrieved, overlap (the lowest over its sentences), supported,
    and what the passage was missing. `passages`: Cited."""
    by_id = {p.id: p for p in passages}
    asked = facts_of(question).names if question else frozenset()
    about = [p.score for p in passages if asked <= held_words(f"{p.title}\n{p.text}")]
    found: dict[str, dict[str, Any]] = {}
    for cited, sentence in citing_sentences(answer):
        passage = by_id.get(cited)
        missing: list[str] = ["retrieval"]
        overlap = 0.0
        if passage is not None:
            missing, overlap = missing_facts(sentence, passage.text, question, passage.title)
            if question and about and passage.score < max(about) - RANK_MARGIN:
                missing.append("better passage")
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
    """The answer's sentences that cite nothing and that no sentence of its cited passages
    states (as "<what is missing> in '<the sentence's start>'"): an answer is only as grounded
    as its least supported sentence, cited or not."""
    cited = {c["id"] for c in citations if c["retrieved"]}
    held = [p for p in passages if p.id in cited]
    out: list[str] = []
    for sentence in answer_sentences(answer)[1]:
        best: list[str] | None = None
        for p in held:
            missing, _ = missing_facts(sentence, p.text, None, p.title)
            if best is None or len(missing) < len(best):
                best = missing
        if best is None or best:
            what = ", ".join(best) if best else "no cited passage"
            out.append(f"{what} in {sentence[:60]!r}")
    return out
