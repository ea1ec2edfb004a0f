"""The near-duplicate evaluation set, written for this project and held out: never used to
train the clinic adapter or to tune retrieval, the citation check or the grounding policy.

Many documents that differ only in their entity and their values: ward information sheets
for 32 wards whose codes differ by one character (Ward 3B beside Ward 3C), and manuals of 16
infusion pumps whose model numbers differ by one digit, every sheet of a kind worded the
same. What tells a right answer from a wrong one is the entity's value, read from the one
passage about that entity. Questions are worded apart from the passages; `absent` asks the
same questions about entities no document describes (the right behaviour is to abstain).
"""

from __future__ import annotations

import random

from engines.retrieval.rag_data import EvalSet, Fact, _markdown

SEED = 20261205
FLOORS = ["ground", "first", "second", "third", "fourth", "fifth", "sixth"]
WINGS = ["north", "south", "east", "west"]
GIVEN = ["Amara", "Tomasz", "Ines", "Kwame", "Signe", "Rafael", "Priya", "Oskar", "Leila", "Mateo", "Hana", "Idris"]
FAMILY = ["Okafor", "Lindqvist", "Moreau", "Brennan", "Haddad", "Novak", "Castillo", "Sato", "Mensah", "Kowalski"]


def _ward(rng: random.Random, code: str) -> tuple[str, list[Fact], str]:
    name = f"Ward {code}"
    doc = f"ward-{code.lower()}.md"
    start = rng.choice([10, 11, 13, 14, 15, 16])
    end = start + rng.choice([2, 3, 4, 5])
    meal = rng.choice([12, 13])
    floor = rng.choice(FLOORS)
    wing = rng.choice(WINGS)
    ext = str(rng.randrange(3000, 8999))
    nurse = f"{rng.choice(GIVEN)} {rng.choice(FAMILY)}"
    sections = {
        "Visiting": f"Visiting hours on {name} are {start}:00 to {end}:00.",
        "Mealtimes": f"Protected mealtime on {name} is {meal}:00 to {meal}:30; please do not visit then.",
        "Where": f"{name} is on the {floor} floor of the {wing} wing.",
        "Contact": f"Phone {name} on extension {ext}; the nurse in charge is {nurse}.",
    }
    facts = [
        Fact(doc, sections["Visiting"], f"From what time can visitors come to {name}?", f"{start}:00"),
        Fact(doc, sections["Mealtimes"], f"When is the protected mealtime on {name}?", f"{meal}:00"),
        Fact(doc, sections["Where"], f"Which floor is {name} on?", f"{floor} floor"),
        Fact(doc, sections["Contact"], f"What extension do I call to reach {name}?", ext),
    ]
    return doc, facts, _markdown(name, f"Information for patients and visitors of {name}.", sections)


def _pump(rng: random.Random, model: str) -> tuple[str, list[Fact], str]:
    name = f"infusion pump {model}"
    doc = f"manual-pump-{model.lower()}.md"
    battery = rng.choice([3, 4, 5, 6, 8, 10, 12])
    occlusion = rng.choice([300, 450, 600, 750, 900])
    service = rng.choice([6, 12, 18, 24])
    sections = {
        "Battery": f"On a full battery the {name} runs for {battery} hours.",
        "Occlusion": f"The {name} raises the occlusion alarm at {occlusion} mmHg.",
        "Service": f"The {name} must be serviced every {service} months.",
    }
    facts = [
        Fact(doc, sections["Battery"], f"How long does the {name} last on battery?", f"{battery} hours"),
        Fact(doc, sections["Occlusion"], f"At what pressure does the {name} alarm for occlusion?", f"{occlusion} mmHg"),
        Fact(doc, sections["Service"], f"How often does the {name} need servicing?", f"{service} months"),
    ]  # fmt: skip
    return doc, facts, _markdown(f"Infusion pump {model}", f"Operating notes for the {name}.", sections)


def build() -> tuple[EvalSet, list[Fact]]:
    """The documents with every one of their facts (176 questions over 48 documents), and
    `absent` questions about wards and pumps that no document describes."""
    rng = random.Random(SEED)
    documents: dict[str, str] = {}
    facts: list[Fact] = []
    for code in (f"{n}{letter}" for n in range(1, 9) for letter in "ABCD"):
        doc, found, text = _ward(rng, code)
        documents[doc], facts = text, facts + found
    for model in (f"IP-{n}" for n in range(310, 326)):
        doc, found, text = _pump(rng, model)
        documents[doc], facts = text, facts + found
    absent: list[Fact] = []
    for code in ("9A", "9B", "9C", "9D", "0E"):
        _, found, _ = _ward(rng, code)
        absent += [Fact("", f.passage, f.question, f.answer) for f in found]
    for model in ("IP-410", "IP-411", "IP-412", "IP-413", "IP-414"):
        _, found, _ = _pump(rng, model)
        absent += [Fact("", f.passage, f.question, f.answer) for f in found]
    return EvalSet(documents, rng.sample(facts, len(facts))), absent
