"""The retrieval evaluation set, written for this project: a clinic's documents (medicine
leaflets, device manuals, ward guides, procedure sheets) and questions about them.

Everything is generated from fixed lists and a seeded random draw, so the set is the same
on every machine and never seen by any model before. Each fact is stated once, in one
section of one document, worded by one of a few passage templates; its question is
worded by a different template (asked as a patient or nurse would ask, not as the
leaflet says it), and its answer is the fact's value. Documents of the same kind share
their wording, so what tells the right passage from the others is what a real question
turns on: which medicine, which device, which ward. The Python reference manual's
topics (pydoc_data, shipped with Python) are added as documents from another domain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SEED = 20261204

SYLLABLES_A = ["Cor", "Dex", "Val", "Mer", "Lor", "Tri", "Ben", "Flu", "Nor", "Sel", "Pra", "Zan", "Cal", "Ter"]
SYLLABLES_B = ["avir", "oxin", "amet", "iprol", "azine", "ocet", "umab", "estra", "idone", "afil", "olan", "ibex"]
BRANDS = ["Meditek", "Novacare", "Aerolux", "Vitalis", "Careline", "Sonomed", "Helix", "Primus"]
DEVICES = ["infusion pump", "patient monitor", "oxygen concentrator", "glucose meter", "nebulizer",
           "syringe driver", "pulse oximeter", "suction unit", "defibrillator", "feeding pump"]  # fmt: skip
WARDS = ["Cedar", "Willow", "Maple", "Aspen", "Rowan", "Hazel", "Linden", "Alder", "Birch", "Juniper", "Elm",
         "Holly", "Poplar", "Laurel", "Spruce", "Larch", "Yew", "Sorrel", "Heather", "Bracken", "Fern", "Ivy",
         "Myrtle", "Sage", "Thistle"]  # fmt: skip
SPECIALTIES = ["cardiology", "maternity", "orthopaedics", "oncology", "paediatrics", "neurology", "renal care"]
PROCEDURES = ["colonoscopy", "gastroscopy", "cataract surgery", "knee arthroscopy", "bronchoscopy", "MRI scan",
              "CT scan with contrast", "hernia repair", "tonsillectomy", "skin biopsy", "bone marrow biopsy",
              "cystoscopy", "echocardiogram", "lumbar puncture", "hip replacement", "carpal tunnel release",
              "varicose vein treatment", "wisdom tooth removal", "coronary angiogram", "thyroid surgery",
              "gallbladder removal", "mammogram", "sleep study", "allergy skin test", "bladder scan",
              "liver biopsy", "kidney stone treatment", "shoulder surgery", "eye laser treatment",
              "hearing test"]  # fmt: skip
SIDE_EFFECTS = ["headache", "nausea", "dizziness", "a dry mouth", "drowsiness", "an upset stomach", "a skin rash",
                "ankle swelling", "a cough", "muscle aches"]  # fmt: skip
AGENTS = ["70% alcohol wipes", "a damp cloth with mild soap", "chlorine wipes", "disinfectant spray",
          "warm water only"]  # fmt: skip
FREQUENCIES = ["once a day", "twice a day", "three times a day", "every eight hours", "every morning"]
STORAGE = ["in a fridge at 2 to 8 °C", "below 25 °C away from light", "below 30 °C in its box",
           "at room temperature, never frozen"]  # fmt: skip


@dataclass(frozen=True)
class Fact:
    document: str  # file name
    passage: str  # the sentence stating it (what its chunk contains)
    question: str
    answer: str  # the value a correct answer states


@dataclass(frozen=True)
class EvalSet:
    documents: dict[str, str]  # file name -> Markdown or text
    facts: list[Fact]


def _pick(rng: random.Random, options: list[str]) -> str:
    return options[rng.randrange(len(options))]


def _markdown(title: str, intro: str, sections: dict[str, str]) -> str:
    """A document: its title and intro, then one `##` section a fact."""
    body = "\n\n".join(f"## {heading}\n\n{text}" for heading, text in sections.items())
    return f"# {title}\n\n{intro}\n\n{body}\n"


def _medicine(rng: random.Random, name: str) -> tuple[str, list[Fact], str]:
    doc = f"medicine-{name.lower()}.md"
    dose = f"{rng.choice([5, 10, 20, 25, 40, 50, 100, 150, 200, 250, 400, 500])} mg"
    freq = _pick(rng, FREQUENCIES)
    store = _pick(rng, STORAGE)
    effect = _pick(rng, SIDE_EFFECTS)
    hours = rng.choice([3, 4, 6, 8, 12])
    sections = {
        "Dosage": _pick(rng, [f"Adults take {dose} of {name} {freq}, with a glass of water.",
                              f"The usual adult dose of {name} is {dose}, taken {freq}."]),
        "Storage": _pick(rng, [f"Keep {name} {store}.", f"{name} must be stored {store}."]),
        "Side effects": f"The most common side effect of {name} is {effect}; tell your nurse if it lasts.",
        "Missed dose": _pick(rng, [f"If you miss a dose of {name}, take it unless your next dose is due within "
                                   f"{hours} hours.",
                                   f"A missed dose of {name} can be taken up to {hours} hours late; never take "
                                   "two doses together."]),
    }  # fmt: skip
    facts = [
        Fact(doc, sections["Dosage"], _pick(rng, [f"How much {name} should an adult take?",
                                                  f"What dose of {name} is right for me?"]), dose),
        Fact(doc, sections["Storage"], _pick(rng, [f"Where do I keep my {name}?",
                                                   f"How should {name} be kept at home?"]), store.split(",")[0]),
        Fact(doc, sections["Side effects"], f"Which side effect is most common with {name}?", effect),
        Fact(doc, sections["Missed dose"], f"I forgot my {name} this morning, can I still take it?", f"{hours} hours"),
    ]  # fmt: skip
    return doc, facts, _markdown(name, f"{name} is a prescription medicine.", sections)


def _device(rng: random.Random, brand: str, kind: str, model: str) -> tuple[str, list[Fact], str]:
    name = f"{brand} {kind} {model}"
    doc = f"manual-{brand.lower()}-{kind.replace(' ', '-')}-{model.lower()}.md"
    battery = rng.choice([2, 3, 4, 5, 6, 8, 10, 12])
    agent = _pick(rng, AGENTS)
    button = _pick(rng, ["RESUME", "SILENCE", "RESET", "OK", "START"])
    warm = rng.choice([1, 2, 3, 5, 10])
    sections = {
        "Alarms": f"When the {name} alarms, check the connections and press {button} to clear it.",
        "Battery": _pick(rng, [f"A full battery runs the {name} for {battery} hours.",
                               f"On battery the {name} lasts {battery} hours; plug it in when the icon flashes."]),
        "Cleaning": f"Clean the outside of the {name} with {agent} after each patient.",
        "Starting up": f"Switch the {name} on and wait {warm} minutes for the self-test before use.",
    }  # fmt: skip
    facts = [
        Fact(doc, sections["Alarms"], f"Which button silences the alarm on the {name}?", button),
        Fact(doc, sections["Battery"], f"How long does the {name} work without mains power?", f"{battery} hours"),
        Fact(doc, sections["Cleaning"], f"What do I wipe the {name} down with?", agent),
        Fact(doc, sections["Starting up"], f"How long is the self-test of the {name}?", f"{warm} minutes"),
    ]
    return doc, facts, _markdown(name, f"User guide for the {name}.", sections)


def _ward(rng: random.Random, ward: str, specialty: str) -> tuple[str, list[Fact], str]:
    name = f"{ward} Ward"
    doc = f"ward-{ward.lower()}.md"
    start, end = rng.choice([(10, 12), (14, 17), (15, 19), (16, 20), (11, 13)])
    floor = _pick(rng, ["ground", "first", "second", "third", "fourth"])
    ext = str(rng.randrange(2000, 7999))
    visitors = rng.choice([1, 2, 3])
    sections = {
        "Visiting": f"Visiting hours on {name} are {start}:00 to {end}:00, {visitors} visitors per bed.",
        "Finding us": f"{name} ({specialty}) is on the {floor} floor of the main building.",
        "Contact": f"Call {name} on extension {ext}, day or night.",
    }
    facts = [
        Fact(doc, sections["Visiting"], f"When can my family come to see me on {name}?", f"{start}:00"),
        Fact(doc, sections["Finding us"], f"Which floor is {name} on?", f"{floor} floor"),
        Fact(doc, sections["Contact"], f"What number do I ring to reach {name}?", ext),
    ]
    return doc, facts, _markdown(name, f"A guide for patients and visitors of {name}.", sections)


def _procedure(rng: random.Random, proc: str) -> tuple[str, list[Fact], str]:
    doc = f"procedure-{proc.lower().replace(' ', '-')}.md"
    fast = rng.choice([2, 4, 6, 8, 12])
    rest = rng.choice([1, 2, 3, 7, 14])
    arrive = rng.choice([15, 30, 45, 60])
    sections = {
        "Before": f"Do not eat for {fast} hours before your {proc}; clear water is allowed.",
        "On the day": f"Arrive {arrive} minutes before your {proc} appointment time.",
        "Afterwards": f"Most people return to work {rest} days after a {proc}.",
    }
    facts = [
        Fact(doc, sections["Before"], f"How long must I fast before a {proc}?", f"{fast} hours"),
        Fact(doc, sections["On the day"], f"How early should I come in for my {proc}?", f"{arrive} minutes"),
        Fact(doc, sections["Afterwards"], f"When can I go back to work after a {proc}?", f"{rest} days"),
    ]
    return doc, facts, _markdown(proc.capitalize(), f"What to expect from a {proc}.", sections)


def build(questions: int = 400) -> EvalSet:
    """The documents, and `questions` facts (drawn evenly at random from all of them)."""
    rng = random.Random(SEED)
    documents: dict[str, str] = {}
    facts: list[Fact] = []
    medicines = sorted({a + b for a in SYLLABLES_A for b in SYLLABLES_B})
    for name in rng.sample(medicines, len(medicines)):
        doc, found, text = _medicine(rng, name)
        documents[doc], facts = text, facts + found
    models = [(b, k, f"{k[0].upper()}-{rng.randrange(100, 999)}") for b in BRANDS for k in DEVICES]
    for brand, kind, model in rng.sample(models, 80):
        doc, found, text = _device(rng, brand, kind, model)
        documents[doc], facts = text, facts + found
    for ward in WARDS:
        doc, found, text = _ward(rng, ward, _pick(rng, SPECIALTIES))
        documents[doc], facts = text, facts + found
    for proc in PROCEDURES:
        doc, found, text = _procedure(rng, proc)
        documents[doc], facts = text, facts + found
    from pydoc_data.topics import topics

    for key in sorted(topics):  # another domain's documents beside the clinic's
        documents[f"python-{key}.txt"] = topics[key]
    return EvalSet(documents, rng.sample(facts, min(questions, len(facts))))


def absent(count: int = 40) -> list[Fact]:
    """Questions worded as the set's about medicines, devices and procedures that none of its
    documents describes (names from syllables the set never uses): the right answer abstains."""
    rng = random.Random(SEED + 1)
    names = [a + b for a in ("Qua", "Vex", "Zol", "Hyp", "Oct") for b in ("tran", "mide", "pirin", "vastin")]
    out: list[Fact] = []
    for name in names:
        out += [Fact("", f.passage, f.question, f.answer) for f in _medicine(rng, name)[1]]
    for brand, kind in (("Orbis", "infusion pump"), ("Kestrel", "nebulizer"), ("Tavira", "glucose meter")):
        out += [Fact("", f.passage, f.question, f.answer) for f in _device(rng, brand, kind, "X-101")[1]]
    return rng.sample(out, min(count, len(out)))


# Questions about nothing a clinic's documents hold: their best passage's score is what the
# abstention threshold (models.qa.abstain_below) must sit above.
OFF_TOPIC = [
    "Who painted the ceiling of the Sistine Chapel?", "What is the capital of Australia?",
    "How many players are on a football team?", "What is the boiling point of water on Mount Everest?",
    "Who wrote Pride and Prejudice?", "How do I bake sourdough bread?", "What year did the Berlin Wall fall?",
    "Which planet has the most moons?", "How do I change a flat bicycle tyre?", "What is the tallest tree species?",
    "Who won the chess world championship in 1972?", "How far is the Moon from the Earth?",
    "What language is spoken in Brazil?", "How do I tune a guitar?", "What is the speed of sound in air?",
    "Which ocean is the deepest?", "How do bees make honey?", "What is the longest river in Europe?",
    "Who invented the telephone?", "How many strings does a violin have?",
]  # fmt: skip
