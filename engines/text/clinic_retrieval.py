"""Retrieval-format examples for the clinic adapter, written for this project.

A qa job that names a collection gets its passages as `[doc: <chunk id>] text` lines
(edge/docs/retrieve.context_of), ids like `lab-ferritin.md#2:0`. The adapter learns to
answer from the passage that matches the question, copy that passage's id exactly into
"(source: <chunk id>)", cite nothing else, and say so when no passage answers.

The passages are drawn from documents of the same kind as the asked one (the same
wording with another entity, the harder case) and from the asked document's other
sections. The kinds of document here (lab tests, clinic services, equipment loans,
vaccines) and their wording are not those of the retrieval evaluation
(engines/retrieval/rag_data.py), so that evaluation stays held out; within this set, every fifth
entity of a kind is held out from training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED = 20261205
NOT_FOUND = "The documents given do not say."

LAB_TESTS = ["ferritin", "vitamin D", "HbA1c", "cholesterol", "thyroid function", "urine culture", "INR",
             "PSA", "liver function", "kidney function", "full blood count", "CRP", "vitamin B12", "folate",
             "lipase", "magnesium", "potassium", "troponin", "cortisol", "coeliac screen"]  # fmt: skip
SERVICES = ["physiotherapy", "dietitian", "podiatry", "speech therapy", "occupational therapy", "counselling",
            "diabetes education", "wound clinic", "travel vaccination", "stop smoking", "hearing aid",
            "dental hygiene", "memory clinic", "continence", "pain clinic"]  # fmt: skip
LOANS = ["wheelchair", "walking frame", "shower chair", "blood pressure cuff", "TENS unit", "commode",
         "raised toilet seat", "breast pump", "bed rail", "pressure cushion"]  # fmt: skip
VACCINES = ["tetanus", "hepatitis B", "shingles", "pneumococcal", "HPV", "measles", "typhoid", "rabies",
            "yellow fever", "whooping cough"]  # fmt: skip
ROOMS = ["room 4", "room 9", "room 14", "room 21", "the east wing", "the west wing", "the annex", "level 2"]
DAYS = ["Mondays", "Tuesdays", "Wednesdays", "Thursdays", "Fridays", "weekdays", "Saturdays"]
EXTS = [".md", ".md", ".txt", ".html", ".pdf"]


@dataclass(frozen=True)
class Fact:
    chunk: str  # the chunk id its passage has
    passage: str
    question: str
    answer: str  # the sentence that answers, without its citation


@dataclass(frozen=True)
class RetrievalExample:
    question: str
    context: str
    answer: str
    gold: str | None  # the chunk id to cite; None when no passage answers


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


def _doc(rng: random.Random, kind: str, name: str, sections: list[tuple[str, str | None, list[str]]]) -> list[Fact]:
    """A document's facts: per section, its passage (sentence and an optional second one
    in the same chunk), the answering sentence (None: the passage itself), and questions
    worded apart from it, one of which is drawn."""
    doc = f"{kind}-{_slug(name)}{rng.choice(EXTS)}"
    facts = []
    for index, (passage, answer, questions) in enumerate(sections, start=1):
        offset = 0 if rng.random() < 0.7 else rng.randrange(40, 900)
        facts.append(Fact(f"{doc}#{index}:{offset}", passage, rng.choice(questions), answer or passage))
    return facts


def _lab(rng: random.Random, test: str) -> list[Fact]:
    days = rng.choice([1, 2, 3, 5, 7, 10])
    room = rng.choice(ROOMS)
    fast = rng.choice(["no fasting is needed", "fast for 8 hours", "fast for 12 hours", "drink only water"])
    prep = f"For a {test} test, {fast} beforehand."
    return _doc(rng, "lab", test, [
        (f"{prep} Bring your request form.", prep,
         [f"Do I have to fast before my {test} test?", f"How should I prepare for a {test} blood test?"]),
        (f"Results of the {test} test are sent to your doctor within {days} days.", None,
         [f"How long until my {test} result comes back?", f"When will my doctor have the {test} result?"]),
        (f"Samples for the {test} test are taken in {room}.", None,
         [f"Where do I go to give blood for the {test} test?", f"Which room is the {test} test done in?"]),
    ])  # fmt: skip


def _service(rng: random.Random, service: str) -> list[Fact]:
    day = rng.choice(DAYS)
    hours = rng.choice(["8 am to noon", "9 am to 4 pm", "1 pm to 6 pm", "10 am to 3 pm"])
    ext = rng.randrange(1000, 9999)
    fee = rng.choice(["free of charge", "15 euro a visit", "30 euro a visit", "covered by insurance"])
    return _doc(rng, "service", service, [
        (f"The {service} service runs on {day}, {hours}.", None,
         [f"What day is the {service} service open?", f"When can I see someone from {service}?"]),
        (f"Book {service} on extension {ext} or at reception.", None,
         [f"How do I make a {service} appointment?", f"What number do I call for {service}?"]),
        (f"Appointments with {service} are {fee}.", None,
         [f"How much does {service} cost?", f"Do I pay for {service}?"]),
    ])  # fmt: skip


def _loan(rng: random.Random, item: str) -> list[Fact]:
    deposit = rng.choice([10, 20, 25, 40, 50])
    weeks = rng.choice([2, 4, 6, 8, 12])
    place = rng.choice(["the equipment store", "the therapy office", "main reception", "the ward desk"])
    return _doc(rng, "loan", item, [
        (f"A {item} can be borrowed for a {deposit} euro deposit, returned when it comes back.",
         f"A {item} can be borrowed for a {deposit} euro deposit.",
         [f"Is there a deposit to borrow a {item}?", f"What does it cost to borrow a {item}?"]),
        (f"Return the {item} within {weeks} weeks.", None,
         [f"How long can I keep the {item}?", f"When must the {item} go back?"]),
        (f"Collect the {item} from {place}.", None,
         [f"Where do I pick up a {item}?", f"Where is the {item} handed out?"]),
    ])  # fmt: skip


def _vaccine(rng: random.Random, vaccine: str) -> list[Fact]:
    doses = rng.choice([1, 2, 3])
    gap = rng.choice(["4 weeks", "2 months", "6 months", "one year"])
    day = rng.choice(DAYS)
    return _doc(rng, "vaccine", vaccine, [
        (f"The {vaccine} vaccine is given as {doses} dose{'s' if doses > 1 else ''}.", None,
         [f"How many {vaccine} jabs will I need?", f"How many doses of the {vaccine} vaccine are there?"]),
        (f"Leave {gap} between {vaccine} vaccine doses. Keep your vaccination card.",
         f"Leave {gap} between {vaccine} vaccine doses.",
         [f"How far apart are the {vaccine} doses?", f"When is my next {vaccine} shot due?"]),
        (f"The nurse gives {vaccine} vaccines on {day}.", None,
         [f"Which day can I get the {vaccine} vaccine?", f"When does the nurse do {vaccine} vaccinations?"]),
    ])  # fmt: skip


KINDS = [(LAB_TESTS, _lab), (SERVICES, _service), (LOANS, _loan), (VACCINES, _vaccine)]


def _facts(held_out: bool) -> list[list[list[Fact]]]:
    """Per kind, per entity, the entity's facts; every fifth entity is held out."""
    rng = random.Random(SEED)
    out = []
    for names, make in KINDS:
        docs = [make(rng, name) for name in names]
        out.append([d for i, d in enumerate(docs) if (i % 5 == 4) == held_out])
    return out


def _section(fact: Fact) -> str:
    return fact.chunk.split("#")[1].split(":")[0]


def _example(
    rng: random.Random, kind: list[list[Fact]], doc: list[Fact], fact: Fact, answerable: bool
) -> RetrievalExample:
    """The fact's passage among others: the asked document's other sections, and the same
    section of other documents of its kind (the same wording, another entity)."""
    same_section = [f for d in kind if d is not doc for f in d if _section(f) == _section(fact)]
    pool = [f for f in doc if f is not fact] + same_section
    count = rng.choice([1, 2, 3, 4]) if answerable else rng.choice([1, 2, 3])
    shown = rng.sample(pool, min(count - 1 if answerable else count, len(pool)))
    if answerable:
        shown.insert(rng.randrange(len(shown) + 1), fact)
    context = "\n".join(f"[doc: {f.chunk}] {f.passage}" for f in shown)
    if answerable:
        return RetrievalExample(fact.question, context, f"{fact.answer} (source: {fact.chunk})", fact.chunk)
    return RetrievalExample(fact.question, context, NOT_FOUND, None)


def examples(split: str, variants: int = 2) -> list[RetrievalExample]:
    """Training: `variants` examples a fact (other distractors, other order), one in twelve
    with the answering passage left out. Held out: one fact an entity (its sections in
    turn), every fourth with the answering passage left out."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    held_out = split == "heldout"
    rng = random.Random(SEED + held_out)
    out: list[RetrievalExample] = []
    for kind in _facts(held_out):
        for i, doc in enumerate(kind):
            if held_out:
                out.append(_example(rng, kind, doc, doc[i % len(doc)], answerable=len(out) % 4 != 3))
                continue
            for fact in doc:
                for _ in range(variants):
                    out.append(_example(rng, kind, doc, fact, answerable=rng.random() >= 1 / 12))
    return out
