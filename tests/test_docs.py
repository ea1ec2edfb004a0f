"""The box's document collections (edge/docs): text out of text, Markdown, HTML and PDF
files, chunks with stable ids, collections embedded and indexed and changed all or
nothing, through `edgectl docs`, and a collection that a kill -9 mid-ingest leaves old or
new, never torn."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge.docs.chunking import chunk_sections
from edge.docs.embed import Embedder, locate
from edge.docs.extract import DocumentError, Section, extract
from edge.docs.index import VectorIndex
from edge.docs.ingest import Limits, add, passage_text, remove_documents
from edge.docs.store import CollectionError, DocStore
from tests.conftest import REPO, write_profile


class CountingEncoder:
    """The real encoder, counting the texts it is asked to embed."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.texts: list[str] = []

    @property
    def model(self) -> str:
        return self.embedder.model

    def embed(self, texts: list[str], progress: object = None) -> np.ndarray:
        self.texts += texts
        return self.embedder.embed(texts)


@pytest.fixture(scope="module")
def embedder(embed_engine_dir: Path) -> Embedder:
    return Embedder.load(locate(embed_engine_dir), threads=2)


LEAFLET_MD = """# Oral rehydration

Dissolve one sachet in 200 ml of drinking water.

## When to seek care

Seek care if there is blood in the stool.
Or a high fever.

```
# not a heading: inside a code fence
```
"""

LEAFLET_HTML = """<html><head><title>x</title><style>p {color: red}</style></head><body>
<p>Before any heading.</p>
<h1>Wound dressing</h1><p>Change the dressing   every day.</p><p>Keep it dry.</p>
<script>var ignored = 1;</script>
<h2>Signs of infection</h2><ul><li>Redness</li><li>Warmth &amp; swelling</li></ul>
</body></html>"""


def pdf_bytes(pages: list[str]) -> bytes:
    """A real PDF, one page per string, in the standard Helvetica font."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", ""]
    kids = []
    for text in pages:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1")
        page_no, content_no = len(objects) + 1, len(objects) + 2
        kids.append(f"{page_no} 0 R")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {content_no} 0 R "
            "/Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>"
        )
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream.decode('latin-1')}\nendstream")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def test_each_kind_of_file_gives_its_sections(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    (tmp_path / "b.html").write_text(LEAFLET_HTML, encoding="utf-8")
    (tmp_path / "c.txt").write_bytes(b"\xef\xbb\xbfPlain text,\r\nwindows line ends.  \r\n")
    (tmp_path / "d.pdf").write_bytes(pdf_bytes(["Sterile gloves first", "Then the swab"]))
    md = extract(tmp_path / "a.md", 1 << 20)
    assert [s.title for s in md] == ["Oral rehydration", "When to seek care"]
    assert "# not a heading" in md[1].text and md[0].text == "Dissolve one sachet in 200 ml of drinking water."
    html = extract(tmp_path / "b.html", 1 << 20)
    assert [(s.title, s.text) for s in html] == [
        ("", "Before any heading."),
        ("Wound dressing", "Change the dressing every day.\n\nKeep it dry."),
        ("Signs of infection", "Redness\n\nWarmth & swelling"),
    ]
    assert extract(tmp_path / "c.txt", 1 << 20) == [Section("", "Plain text,\nwindows line ends.")]
    pdf = extract(tmp_path / "d.pdf", 1 << 20)
    assert [s.title for s in pdf] == ["page 1", "page 2"]
    assert "Sterile gloves first" in pdf[0].text and "Then the swab" in pdf[1].text


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("slides.pptx", b"x", "unsupported type .pptx"),
        ("big.txt", b"x" * 2000, "2000 bytes; the limit is 1000 bytes"),
        ("latin.txt", "café".encode("latin-1"), "not UTF-8 text (byte 3)"),
        ("broken.pdf", b"%PDF-1.4\nthis is no PDF", "not a readable PDF"),
        ("missing.md", None, "cannot be read: No such file or directory"),
    ],
)
def test_a_file_that_cannot_be_read_is_named_with_the_reason(
    tmp_path: Path, name: str, content: bytes | None, reason: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DocumentError) as caught:
        extract(path, 1000)
    assert caught.value.path == path and reason in str(caught.value) and str(path) in str(caught.value)


def test_chunks_have_stable_ids_exact_offsets_and_bounded_sizes() -> None:
    sentence = "The dressing is changed daily by the nurse on duty. "
    text = "Short first paragraph.\n\n" + sentence * 40 + "\n\n" + "x" * 700 + " tail"
    sections = [Section("Care", text), Section("Other", "One more line.")]
    chunks = chunk_sections("leaflet.md", sections, max_chars=300)
    assert chunks == chunk_sections("leaflet.md", sections, max_chars=300)  # deterministic
    assert len({c.id for c in chunks}) == len(chunks)
    for c in chunks:
        assert c.id == f"leaflet.md#{c.section}:{c.offset}" and 0 < len(c.text) <= 300
        assert sections[c.section].text[c.offset : c.offset + len(c.text)] == c.text  # the id points at the text
    assert "".join(c.text for c in chunks if c.section == 0).replace(" ", "").replace("\n", "") == text.replace(
        " ", ""
    ).replace("\n", "")  # nothing lost
    sentences_cut = [c for c in chunks if c.text.startswith("The dressing")]
    assert all(c.text.endswith("duty.") for c in sentences_cut)  # cut at sentence ends
    assert chunks[-1].title == "Other" and chunks[-1].offset == 0


def _index_of(store: DocStore, name: str) -> VectorIndex:
    collection = store.load(name)
    return VectorIndex.read(store.version_dir(name, collection.version))


def test_a_collection_changes_all_or_nothing(tmp_path: Path, embedder: Embedder) -> None:
    store = DocStore(tmp_path / "docs")
    encoder = CountingEncoder(embedder)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    (folder / "b.html").write_text(LEAFLET_HTML, encoding="utf-8")
    (folder / "skipped.bin").write_bytes(b"\0")  # not a document type: not picked up from a folder
    assert add(store, "clinic", [folder], encoder) == "v000001"
    first = store.load("clinic")
    assert [d.name for d in first.documents] == ["a.md", "b.html"] and len(first.chunks) == 5
    # Every chunk embedded once, row i of the index being chunk i.
    assert encoder.texts == [passage_text(c) for c in first.chunks]
    index = _index_of(store, "clinic")
    assert index.meta.count == 5 and index.meta.kind == "flat" and index.meta.model == "all-MiniLM-L6-v2"
    np.testing.assert_allclose(index.vectors([0, 4]), embedder.embed([encoder.texts[0], encoder.texts[4]]), atol=1e-6)
    # A bad file stops the whole change: nothing of it lands.
    (tmp_path / "c.txt").write_text("new text", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(DocumentError, match=r"bad\.txt: not UTF-8"):
        add(store, "clinic", [tmp_path / "c.txt", tmp_path / "bad.txt"], encoder)
    assert store.load("clinic") == first
    # The same name again replaces that document.
    (tmp_path / "a.md").write_text("# Replaced\n\nOnly this now.", encoding="utf-8")
    encoder.texts.clear()
    assert add(store, "clinic", [tmp_path / "a.md", tmp_path / "c.txt"], encoder) == "v000002"
    second = store.load("clinic")
    # Only the new chunks were embedded; the kept ones' vectors came from the old index.
    assert sorted(encoder.texts) == ["Replaced\nOnly this now.", "new text"]
    assert _index_of(store, "clinic").meta.count == len(second.chunks) == 5
    assert sorted(d.name for d in second.documents) == ["a.md", "b.html", "c.txt"]
    assert [c.text for c in second.chunks if c.document == "a.md"] == ["Only this now."]
    assert sorted(p.name for p in (tmp_path / "docs" / "clinic").iterdir()) == ["CURRENT", "v000002"]
    encoder.texts.clear()
    assert remove_documents(store, "clinic", ["b.html"], encoder) == "v000003"
    third = store.load("clinic")
    assert {c.document for c in third.chunks} == {"a.md", "c.txt"} and encoder.texts == []
    np.testing.assert_allclose(
        _index_of(store, "clinic").vectors(list(range(2))),
        embedder.embed([passage_text(c) for c in third.chunks]),
        atol=1e-6,
    )
    with pytest.raises(CollectionError, match=r"no document nope\.md"):
        remove_documents(store, "clinic", ["nope.md"], encoder)
    with pytest.raises(CollectionError, match="collection name"):
        add(store, "../escape", [tmp_path / "c.txt"], encoder)
    with pytest.raises(CollectionError, match="1 files; the limit is 0"):
        add(store, "clinic", [tmp_path / "c.txt"], encoder, Limits(max_files=0))
    store.remove("clinic")
    assert store.names() == [] and not (tmp_path / "docs" / "clinic").exists()


def _edgectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge.cli", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_edgectl_docs_commands(tmp_path: Path, embed_engine_dir: Path) -> None:
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    (tmp_path / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    (tmp_path / "b.pdf").write_bytes(pdf_bytes(["Gloves", "Swab"]))
    added = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(tmp_path / "a.md"),
                     str(tmp_path / "b.pdf"))  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert "[2/2] b.pdf: 2 sections, 2 chunks" in added.stdout and "collection clinic: 2 documents" in added.stdout
    listed = json.loads(_edgectl("docs", "list", "--profile", str(profile), "--json").stdout)
    assert listed == {
        "collections": [{"name": "clinic", "version": "v000001", "documents": 2, "chunks": 4, "bytes": listed[
            "collections"][0]["bytes"]}]
    }  # fmt: skip
    docs = json.loads(_edgectl("docs", "list", "--profile", str(profile), "--collection", "clinic", "--json").stdout)
    assert [d["name"] for d in docs["documents"]] == ["a.md", "b.pdf"]
    bad = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(tmp_path / "none.txt"))
    assert bad.returncode == 1 and "none.txt: cannot be read" in bad.stderr
    assert _edgectl("docs", "remove", "--profile", str(profile), "--collection", "clinic", "a.md").returncode == 0
    assert _edgectl("docs", "remove", "--profile", str(profile), "--collection", "clinic").returncode == 0
    gone = _edgectl("docs", "list", "--profile", str(profile), "--collection", "clinic")
    assert gone.returncode == 1 and "no collection named 'clinic'" in gone.stderr


@pytest.mark.slow
def test_kill_9_mid_ingest_leaves_the_old_collection_or_the_new_one(
    tmp_path: Path, embed_engine_dir: Path, embedder: Embedder
) -> None:
    """`edgectl docs add` of a batch of files, killed at random moments from its start to
    past its end (reading, embedding, writing, switching): each time the collection
    reads back whole, as it was before or with every new document, its index holding a
    vector for each of its chunks."""
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    store = DocStore(tmp_path / "state" / "docs")
    base = tmp_path / "base.md"
    base.write_text(LEAFLET_MD, encoding="utf-8")
    add(store, "clinic", [base], embedder)

    def batch(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for i in range(30):
            body = "\n\n".join(f"Protocol {name}-{i} step {j} is done with care." for j in range(40))
            (folder / f"doc{i:03d}.txt").write_text(body, encoding="utf-8")
        return folder

    def edgectl_add(folder: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "edge.cli", "docs", "add", "--profile", str(profile), "--collection", "clinic",
             str(folder)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    t0 = time.monotonic()
    whole = edgectl_add(batch("timed"))
    assert whole.wait(timeout=300) == 0
    took = time.monotonic() - t0  # start-up and all: the span the kills are spread over
    rng = random.Random(5)
    outcomes = set()
    for round_ in range(8):
        folder = batch(f"b{round_}")
        before = store.load("clinic")
        proc = edgectl_add(folder)
        time.sleep(rng.uniform(0.3, 1.1) * took)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        after = store.load("clinic")
        names = {d.name for d in after.documents}
        if after.version == before.version:
            assert after == before
            outcomes.add("old")
        else:
            assert names == {d.name for d in before.documents} | {f"doc{i:03d}.txt" for i in range(30)}
            assert {c.document for c in after.chunks} == names
            assert sum(d.chunks for d in after.documents) == len(after.chunks)
            outcomes.add("new")
        assert _index_of(store, "clinic").meta.count == len(after.chunks)
    # A later change sweeps what a killed one left half written.
    add(store, "clinic", [base], embedder)
    assert sorted(p.name for p in (tmp_path / "state" / "docs" / "clinic").iterdir())[0] == "CURRENT"
    assert len(list((tmp_path / "state" / "docs" / "clinic").iterdir())) == 2
    assert outcomes == {"old", "new"}
