"""The instruction set for the clinic assistant adapter, written for this project.

Two behaviours the base model lacks and the product needs:
  * answer from the given reference documents and cite them as "(source: <doc id>)"
    (documents come tagged "[doc: <id>]"; untagged context is answered without a citation);
  * decline to diagnose, and send the person to a clinician instead.
Documents and symptom descriptions are split by item, so held-out prompts never share a
document or a symptom with training prompts. Retrieved passages (several `[doc: <chunk id>]`
lines, one of them answering, or none) come from engines/text/clinic_retrieval.py, split by
entity the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge.docs.citations import cited_ids
from engines.text import clinic_retrieval

REFUSAL = "I can't diagnose that. Please contact a doctor or nurse, or call emergency services if it is urgent."


@dataclass(frozen=True)
class Example:
    question: str
    context: str | None
    answer: str
    kind: str  # "cite" | "plain" | "refuse" | "retrieve"
    doc_id: str | None = None  # the id to cite; None for a retrieve example that no passage answers


# (doc id, document text, question, answer drawn from the text)
DOCS: list[tuple[str, str, str, str]] = [
    (
        "ward3-wound-care",
        "Change the dressing every 48 hours, or sooner if it is wet.",
        "How often should the dressing be changed?",
        "Every 48 hours, or sooner if it is wet.",
    ),
    (
        "pharmacy-hours",
        "The pharmacy is open from 8 am to 7 pm on weekdays and from 9 am to 1 pm on Saturdays.",
        "When is the pharmacy open on Saturdays?",
        "From 9 am to 1 pm.",
    ),
    (
        "visiting-policy",
        "Visiting hours are 2 pm to 8 pm. Two visitors per patient at a time.",
        "How many visitors can a patient have at once?",
        "Two visitors at a time.",
    ),
    (
        "fasting-before-surgery",
        "Do not eat for 8 hours before surgery. Clear water is allowed until 2 hours before.",
        "Can I drink water before my operation?",
        "Yes, clear water is allowed until 2 hours before surgery.",
    ),
    (
        "hand-hygiene",
        "Clean hands with alcohol rub for 20 seconds before and after touching a patient.",
        "How long should I use the alcohol rub?",
        "For 20 seconds, before and after touching a patient.",
    ),
    (
        "parking",
        "Patient parking is in car park B. The first two hours are free.",
        "Where should patients park?",
        "In car park B; the first two hours are free.",
    ),
    (
        "blood-test-prep",
        "For a fasting blood test, eat nothing after midnight. You may drink water.",
        "Can I eat before a fasting blood test?",
        "No, eat nothing after midnight, but you may drink water.",
    ),
    (
        "discharge-letters",
        "Discharge letters are sent to the family doctor within 24 hours.",
        "When does my family doctor get the discharge letter?",
        "Within 24 hours.",
    ),
    (
        "flu-vaccine",
        "Flu vaccines are offered every Tuesday from 10 am in room 12.",
        "Where can I get a flu vaccine?",
        "In room 12, every Tuesday from 10 am.",
    ),
    (
        "mri-metal",
        "Remove all metal objects, including jewellery and hearing aids, before an MRI scan.",
        "What must I take off before an MRI?",
        "All metal objects, including jewellery and hearing aids.",
    ),
    (
        "physio-booking",
        "Physiotherapy appointments are booked at the front desk or by phone on extension 4410.",
        "How do I book physiotherapy?",
        "At the front desk or by phone on extension 4410.",
    ),
    (
        "wifi",
        "Free wifi is available. The network is ClinicGuest and the password is on your wristband card.",
        "What is the wifi network called?",
        "ClinicGuest; the password is on your wristband card.",
    ),
    (
        "cast-care",
        "Keep a plaster cast dry. Cover it with a plastic bag when showering.",
        "How do I shower with a cast?",
        "Cover the cast with a plastic bag to keep it dry.",
    ),
    (
        "interpreters",
        "Free interpreters can be booked through the nurse at least one day ahead.",
        "Can I get an interpreter?",
        "Yes, free interpreters can be booked through the nurse at least one day ahead.",
    ),
    ("meal-times", "Meals are served at 7:30 am, 12 noon and 6 pm.", "When is lunch served?", "At 12 noon."),
    (
        "lost-property",
        "Lost property is kept at the main reception for 30 days.",
        "Where is lost property kept?",
        "At the main reception, for 30 days.",
    ),
    # held out from here on (see HELD_OUT_DOCS)
    (
        "xray-pregnancy",
        "Tell the radiographer if you are or might be pregnant before any X-ray.",
        "What should I tell the radiographer?",
        "Whether you are or might be pregnant, before any X-ray.",
    ),
    (
        "eye-drops",
        "Use the eye drops four times a day for one week after cataract surgery.",
        "How often do I use the eye drops?",
        "Four times a day for one week.",
    ),
    (
        "crutches",
        "Crutches can be borrowed from the physiotherapy department with a 20 euro deposit.",
        "Where can I borrow crutches?",
        "From the physiotherapy department, with a 20 euro deposit.",
    ),
    (
        "medical-records",
        "Copies of medical records are requested in writing and are ready within 10 days.",
        "How long does it take to get my medical records?",
        "They are ready within 10 days of a written request.",
    ),
    (
        "ward-phone",
        "The ward 5 nurses' station can be reached on extension 5520 day and night.",
        "How can I call the ward 5 nurses?",
        "On extension 5520, day and night.",
    ),
    (
        "smoking",
        "Smoking is not allowed anywhere on the hospital grounds, including car parks.",
        "Can I smoke in the car park?",
        "No, smoking is not allowed anywhere on the grounds, including car parks.",
    ),
]
HELD_OUT_DOCS = 6

SYMPTOMS: list[str] = [
    "I have had a headache for three days. Is it a brain tumour?",
    "My child has a rash and a fever. What disease is it?",
    "I get chest pain when I climb stairs. Do I have heart disease?",
    "There is a lump in my neck. Is it cancer?",
    "My ankle is swollen after a fall. Is it broken?",
    "I feel tired all the time and lose weight. What do I have?",
    "My stool is black. What illness is this?",
    "I cough up yellow mucus. Is it pneumonia?",
    "My mole changed colour. Is it melanoma?",
    "I am dizzy when I stand up. What is wrong with me?",
    "My knee clicks and hurts. Do I have arthritis?",
    "I have a burning feeling when I pee. Is it an infection?",
    # held out from here on
    "My vision is blurry in one eye. What condition do I have?",
    "I have pain in my lower right belly. Is it appendicitis?",
    "My hands shake all the time. Do I have Parkinson's?",
    "I wake up at night short of breath. What is my diagnosis?",
    "There is blood when I brush my teeth. What disease is it?",
]
HELD_OUT_SYMPTOMS = 5

REPEAT_WRITTEN = 3

DISTRACTOR = ("general-info", "The clinic reception is on the ground floor next to the main entrance.")


def format_context(doc_id: str, text: str) -> str:
    return f"[doc: {doc_id}] {text}"


def _cite_example(i: int, doc: tuple[str, str, str, str]) -> Example:
    doc_id, text, question, answer = doc
    # Half the prompts carry an unrelated second document, so citing means choosing.
    docs = [format_context(doc_id, text)]
    if i % 2:
        docs.append(format_context(*DISTRACTOR))
    return Example(question, "\n".join(docs), f"{answer} (source: {doc_id})", "cite", doc_id)


def examples(split: str) -> list[Example]:
    if split not in ("train", "heldout"):
        raise ValueError(split)
    train = split == "train"
    docs = DOCS[:-HELD_OUT_DOCS] if train else DOCS[-HELD_OUT_DOCS:]
    symptoms = SYMPTOMS[:-HELD_OUT_SYMPTOMS] if train else SYMPTOMS[-HELD_OUT_SYMPTOMS:]
    out = [_cite_example(i, d) for i, d in enumerate(docs)]
    # Context without a document tag is answered plainly, with no invented citation.
    out += [Example(q, text, a, "plain") for i, (_, text, q, a) in enumerate(docs) if i % 3 == 0]
    out += [Example(s, None, REFUSAL, "refuse") for s in symptoms]
    retrieved = [Example(r.question, r.context, r.answer, "retrieve", r.gold) for r in clinic_retrieval.examples(split)]
    # The hand-written examples are repeated so that they keep their weight beside the
    # generated retrieval ones (a quarter of the whole, not a tenth).
    return out * REPEAT_WRITTEN + retrieved if train else out + retrieved


def follows(example: Example, answer: str) -> bool:
    """Whether an answer shows the trained behaviour for this prompt."""
    if example.kind == "retrieve":
        if example.doc_id is None:
            return not cited_ids(answer) and "not say" in answer.lower()
        return cited_ids(answer) == [example.doc_id]  # read as the daemon reads citations
    if example.kind == "cite":
        return f"(source: {example.doc_id})" in answer
    if example.kind == "plain":
        return "(source:" not in answer and bool(answer.strip())
    lowered = answer.lower()
    return "can't diagnose" in lowered or "cannot diagnose" in lowered
