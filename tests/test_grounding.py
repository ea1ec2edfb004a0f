"""Grounding through the daemon as a real process (models.qa.grounding): a citation of
another entity's leaflet or of a value the passage does not hold is not supported; under
`require` such an answer is withheld and the closest passage quoted, and a question no
passage is near abstains without generating; under `flag` the answer is kept and marked;
a box that requires a collection never answers from the model's weights alone; the
verdicts are counted in `edgectl status` and the metrics."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.config.text import QAModelConfig
from edge.docs.citations import check_citations
from edge.docs.embed import Embedder, locate
from edge.docs.ingest import add
from edge.docs.retrieve import Passage, Retriever
from edge.docs.store import DocStore
from tests.conftest import SAMPLES, Broker, DaemonProc, Requester, edgectl, start_daemon, write_profile

pytestmark = pytest.mark.integration

DEXOLAN = """# Dexolan

Dexolan is a prescription medicine.

## Missed dose

If you miss a dose of Dexolan, take it unless your next dose is due within 6 hours.
"""
DEXIDONE_QUESTION = "I forgot my Dexidone this morning, can I still take it?"
ABSTAIN = QAModelConfig().abstain_answer


@pytest.fixture(scope="module")
def embedder(embed_engine_dir: Path) -> Embedder:
    return Embedder.load(locate(embed_engine_dir), threads=2)


def _collections(root: Path, embedder: Embedder) -> DocStore:
    """`clinic`: the sample leaflets; `twins`: Dexolan's leaflet alone (a question about
    Dexidone finds it nearest, as alike as the two names read)."""
    store = DocStore(root / "state" / "docs")
    add(store, "clinic", [SAMPLES / "leaflets"], embedder)
    (root / "dexolan.md").write_text(DEXOLAN, encoding="utf-8")
    add(store, "twins", [root / "dexolan.md"], embedder)
    return store


def _daemon(
    factory: pytest.TempPathFactory, broker: Broker, engine_dir: Path, embedder: Embedder, name: str, **qa: Any
) -> Iterator[DaemonProc]:
    directory = factory.mktemp(name)
    _collections(directory, embedder)
    settings = {"max_new_tokens": 48, "max_context_tokens": 1024, "top_k": 1, **qa}
    d = start_daemon(write_profile(directory, broker.port, engine_dir, device_id=name, models={"qa": settings}))
    d.wait_ready(timeout=300)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def require_daemon(
    broker: Broker, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, embedder: Embedder
) -> Iterator[DaemonProc]:
    yield from _daemon(tmp_path_factory, broker, engine_dir, embedder, "ground1")  # the default policy


@pytest.fixture(scope="module")
def flag_daemon(
    broker: Broker, engine_dir: Path, tmp_path_factory: pytest.TempPathFactory, embedder: Embedder
) -> Iterator[DaemonProc]:
    yield from _daemon(
        tmp_path_factory,
        broker,
        engine_dir,
        embedder,
        "ground2",
        grounding="flag",
        require_collection=True,
        extractive_fallback=False,  # the model's own answers, kept and marked
    )


def _ask(requester: Requester, box: str, job: dict[str, Any]) -> dict[str, Any]:
    result = requester.request(f"edge/{box}/jobs/qa", job, timeout=180)
    assert result["status"] == "ok", result
    return dict(result["output"])


def _shown(out: dict[str, Any]) -> list[Passage]:
    return [Passage(p["id"], p["score"], p["text"], p["title"]) for p in out["passages"]]


def test_flag_keeps_an_answer_citing_another_medicines_leaflet_and_marks_it(
    flag_daemon: DaemonProc, requester: Requester
) -> None:
    out = _ask(requester, "ground2", {"id": "f1", "question": DEXIDONE_QUESTION, "collection": "twins"})
    assert "Dexolan" in out["passages"][0]["text"] and "within 6 hours" in out["passages"][0]["text"]
    (cited,) = out["citations"]  # the model answers from the leaflet it was given, and cites it
    assert cited["id"] == out["passages"][0]["id"] and cited["retrieved"]
    assert not cited["supported"] and "question's dexidone" in cited["missing"]
    assert out["citations"] == check_citations(out["answer"], _shown(out), DEXIDONE_QUESTION)
    assert out["grounded"] is False and out["grounding"] == "flagged"
    assert not out["answer"].startswith(ABSTAIN)  # kept, marked


def test_flag_marks_a_value_the_cited_passage_does_not_hold(flag_daemon: DaemonProc, requester: Requester) -> None:
    """The job's own context states a value under the retrieved passage's id; the model
    copies it, and the check reads the id's real passage, which does not hold it."""
    question = "I forgot my Dexolan this morning, can I still take it?"
    first = _ask(requester, "ground2", {"id": "f2", "question": question, "collection": "twins"})
    pid = first["passages"][0]["id"]
    forged = f"[doc: {pid}] If you miss a dose of Dexolan, take it unless your next dose is due within 9 hours."
    out = _ask(requester, "ground2", {"id": "f3", "question": question, "collection": "twins", "context": forged})
    assert "9 hours" in out["answer"], out["answer"]
    (cited,) = [c for c in out["citations"] if c["id"] == pid]
    assert not cited["supported"] and "number 9 h" in cited["missing"]
    assert out["grounded"] is False and out["grounding"] == "flagged" and out["answer_source"] == "model"


def test_require_answers_with_the_passages_own_sentence_where_the_models_is_wrong(
    require_daemon: DaemonProc, requester: Requester
) -> None:
    """The same forged context under require (extractive fallback on, the default): the
    model's answer is not grounded, and the retrieved passage's own sentence answers."""
    question = "I forgot my Dexolan this morning, can I still take it?"
    first = _ask(requester, "ground1", {"id": "r5", "question": question, "collection": "twins"})
    pid = first["passages"][0]["id"]
    forged = f"[doc: {pid}] If you miss a dose of Dexolan, take it unless your next dose is due within 9 hours."
    out = _ask(requester, "ground1", {"id": "r6", "question": question, "collection": "twins", "context": forged})
    assert out["answer_source"] == "passage" and out["grounded"] is True and out["grounding"] == "grounded"
    assert out["answer"] == f"{first['passages'][0]['text'].rstrip('.')}. (source: {pid})"
    assert "6 hours" in out["answer"] and "9 hours" not in out["answer"]


def test_edgectl_submit_prints_the_citations_their_checks_and_the_verdict(
    flag_daemon: DaemonProc, broker: Broker
) -> None:
    args = ["submit", "qa", "--broker", f"127.0.0.1:{broker.port}", "--device", "ground2"]
    res = edgectl(*args, "--question", DEXIDONE_QUESTION, "--collection", "twins", timeout=180)
    assert res.returncode == 0, res.stderr
    assert "cites dexolan.md#" in res.stdout, res.stdout
    assert "NOT SUPPORTED: the passage lacks question's dexidone" in res.stdout
    assert "NOT GROUNDED" in res.stdout
    res = edgectl(*args, "--question", "What is a normal resting heart rate?", timeout=180)
    assert "abstained: the answer was withheld (no_collection)" in res.stdout, res.stdout


def test_a_box_that_requires_a_collection_never_answers_from_the_weights(
    flag_daemon: DaemonProc, requester: Requester
) -> None:
    out = _ask(requester, "ground2", {"id": "f4", "question": "What is a normal resting heart rate for adults?"})
    assert out["grounded"] is False and out["grounding"] == "abstained" and out["abstain_reason"] == "no_collection"
    assert out["completion_tokens"] == 0 and out["answer"] == ABSTAIN


def test_require_withholds_an_unsupported_answer_and_quotes_the_closest_passage(
    require_daemon: DaemonProc, requester: Requester
) -> None:
    out = _ask(requester, "ground1", {"id": "r1", "question": DEXIDONE_QUESTION, "collection": "twins"})
    assert out["grounded"] is False and out["grounding"] == "abstained" and out["abstain_reason"] == "unsupported"
    best = out["passages"][0]
    assert out["answer"].startswith(ABSTAIN) and f'"{best["text"]}"' in out["answer"] and best["id"] in out["answer"]
    assert out["completion_tokens"] > 0  # generated, checked, withheld
    # What is right is passed on as fact.
    pharmacy = {"id": "r2", "question": "When is the pharmacy open on Saturdays?", "collection": "clinic"}
    right = _ask(requester, "ground1", pharmacy)
    assert right["grounded"] is True and right["grounding"] == "grounded", right
    assert "9 am to 1 pm" in right["answer"] and right["citations"][0]["supported"]
    # Without a collection (none required here) nothing is checked, and the result says so.
    plain = _ask(requester, "ground1", {"id": "r3", "question": "Say hello."})
    assert plain["grounded"] is None and plain["grounding"] == "unchecked" and "citations" not in plain


def test_a_question_no_passage_is_near_abstains_without_generating(
    require_daemon: DaemonProc, requester: Requester, embedder: Embedder
) -> None:
    question = "Who painted the ceiling of the Sistine Chapel?"
    store = DocStore(require_daemon.profile.parent / "state" / "docs")
    (best,), _ = Retriever(store, embedder).search("clinic", question, 1)
    assert best.score < QAModelConfig().abstain_below  # the premise, measured here
    before = _counts(require_daemon)
    result = requester.request(
        "edge/ground1/jobs/qa", {"id": "r4", "question": question, "collection": "clinic"}, timeout=180
    )
    out = result["output"]
    assert out["grounding"] == "abstained" and out["abstain_reason"] == "low_score", out
    assert out["completion_tokens"] == 0 and "decode" not in result["timings"]["stages"]
    assert out["passages"][0]["id"] == best.id and out["passages"][0]["text"] == best.text
    after = _counts(require_daemon)
    assert after["status"].get("abstained", 0) == before["status"].get("abstained", 0) + 1
    assert after["metrics"].get("abstained", 0) == before["metrics"].get("abstained", 0) + 1
    assert after["status"] == after["metrics"]  # one count, two places


def _counts(daemon: DaemonProc) -> dict[str, dict[str, float]]:
    """The grounding verdicts counted so far, as `edgectl status --json` and the metrics
    endpoint give them."""
    status = json.loads(daemon.status().stdout)
    listen = status["metrics"]["listen"]
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as response:
        text = response.read().decode()
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("edge_qa_grounding_total{"):
            verdict = line.split('verdict="', 1)[1].split('"', 1)[0]
            metrics[verdict] = float(line.rsplit(" ", 1)[1])
    return {"status": {k: float(v) for k, v in status["jobs"]["qa_grounding"].items()}, "metrics": metrics}
