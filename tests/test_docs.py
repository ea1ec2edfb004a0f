"""The box's document collections (edge/docs): text out of text, Markdown, HTML and PDF
files, chunks with stable ids, collections embedded and indexed and changed all or
nothing, through `edgectl docs`, and a collection that a kill -9 mid-ingest leaves old or
new, never torn."""

from __future__ import annotations

import json
import os
import random
import re
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


def is_version(name: str, number: int) -> bool:
    """A version's name: its number, and the hash of its content."""
    return re.fullmatch(rf"v{number:06d}-[0-9a-f]{{12}}", name) is not None


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
    assert is_version(add(store, "clinic", [folder], encoder), 1)
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
    assert is_version(add(store, "clinic", [tmp_path / "a.md", tmp_path / "c.txt"], encoder), 2)
    second = store.load("clinic")
    # Only the new chunks were embedded; the kept ones' vectors came from the old index.
    assert sorted(encoder.texts) == ["Replaced\nOnly this now.", "new text"]
    assert _index_of(store, "clinic").meta.count == len(second.chunks) == 5
    assert sorted(d.name for d in second.documents) == ["a.md", "b.html", "c.txt"]
    assert [c.text for c in second.chunks if c.document == "a.md"] == ["Only this now."]
    assert sorted(p.name for p in (tmp_path / "docs" / "clinic").iterdir()) == ["CURRENT", second.version]
    encoder.texts.clear()
    assert is_version(remove_documents(store, "clinic", ["b.html"], encoder), 3)
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
        "collections": [{"name": "clinic", "version": listed["collections"][0]["version"], "documents": 2,
                         "chunks": 4, "bytes": listed["collections"][0]["bytes"]}]
    }  # fmt: skip
    assert is_version(listed["collections"][0]["version"], 1)
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
    # Kills spread from early in the run to well past the first run's length (later runs
    # take longer: the collection grows, and a busy machine slows them), in a shuffled
    # order, so that both outcomes come up however loaded the machine is.
    factors = [0.3, 0.45, 0.6, 0.75, 0.9, 1.05, 1.6, 3.0]
    random.Random(5).shuffle(factors)
    outcomes = set()
    for round_, factor in enumerate(factors):
        folder = batch(f"b{round_}")
        before = store.load("clinic")
        proc = edgectl_add(folder)
        try:  # killed at that moment, unless it has finished by then
            proc.wait(timeout=factor * took)
        except subprocess.TimeoutExpired:
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


def _pdf_of(objects: list[bytes]) -> bytes:
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


def hostile_pdfs(folder: Path) -> dict[str, Path]:
    """PDFs a parser must refuse: a page stream whose /Length is the stream itself, and a
    200 KB flate stream that inflates to 200 MB."""
    import zlib

    head = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 << "
        b"/Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>",
    ]
    bomb = zlib.compress(b"0" * (200 << 20), 9)
    files = {
        "self-length.pdf": _pdf_of(
            [*head, b"<< /Length 4 0 R >>\nstream\nBT /F1 12 Tf 72 720 Td (x) Tj ET\nendstream"]
        ),
        "flate-bomb.pdf": _pdf_of(
            [*head, f"<< /Length {len(bomb)} /Filter /FlateDecode >>\nstream\n".encode() + bomb + b"\nendstream"]
        ),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed edgectl command says (and nothing like a traceback)."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


def test_a_hostile_pdf_stops_docs_add_with_its_name_and_the_reason(
    tmp_path: Path, embed_engine_dir: Path, embedder: Embedder
) -> None:
    """pypdf's own limits (a self-referring length, a flate bomb) fail in ways of their
    own: `docs add` says which file and why in one line, and the collection stays."""
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    store = DocStore(tmp_path / "state" / "docs")
    (tmp_path / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    add(store, "clinic", [tmp_path / "a.md"], embedder)
    before = store.load("clinic")
    for name, path in hostile_pdfs(tmp_path).items():
        done = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(path))
        line = _one_line_error(done)
        assert line.startswith(f"edgectl docs add: {path}: not a readable PDF: LimitReachedError"), (name, line)
        assert store.load("clinic") == before
        assert sorted(p.name for p in (tmp_path / "state" / "docs" / "clinic").iterdir()) == ["CURRENT", before.version]


def test_a_full_disk_stops_docs_add_in_one_line_with_nothing_half_written(
    tmp_path: Path, embed_engine_dir: Path, embedder: Embedder
) -> None:
    """The state directory on a 128 KiB filesystem: a change too big for it is one line
    (the reason), the collection as it was, and nothing of the change left on disk."""
    state = tmp_path / "state"
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(state)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.decode().strip()}")
    try:
        profile = write_profile(tmp_path, 1883, embed_engine_dir)
        store = DocStore(state / "docs")
        (tmp_path / "small.md").write_text(LEAFLET_MD, encoding="utf-8")
        add(store, "clinic", [tmp_path / "small.md"], embedder)
        before = store.load("clinic")
        # 60 chunks: ~65 KB of chunks and ~90 KB of vectors, more than the room left.
        (tmp_path / "big.txt").write_text(
            "\n\n".join(f"Paragraph {i}: the ward keeps its records for audit. " * 18 for i in range(60)),
            encoding="utf-8",
        )
        done = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(tmp_path / "big.txt"))
        line = _one_line_error(done)
        assert line.startswith("edgectl docs add: ") and "No space left on device" in line, line
        assert store.load("clinic") == before
        assert sorted(p.name for p in (state / "docs" / "clinic").iterdir()) == ["CURRENT", before.version]
        listed = _edgectl("docs", "list", "--profile", str(profile), "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)["collections"][0]["version"] == before.version
    finally:
        subprocess.run(["umount", str(state)], capture_output=True)


def test_docs_add_leaves_out_links_that_lead_outside_the_folder(tmp_path: Path, embed_engine_dir: Path) -> None:
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("The root password is hunter2.", encoding="utf-8")
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    (folder / "sub" / "b.txt").write_text("Gloves before the swab.", encoding="utf-8")
    (folder / "secret.txt").symlink_to(outside / "secret.txt")
    (folder / "elsewhere").symlink_to(outside, target_is_directory=True)
    (folder / "sub" / "same.txt").symlink_to(folder / "sub" / "b.txt")  # inside: read like any file
    done = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(folder))
    assert done.returncode == 0, done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 2, done.stdout
    assert any(f"{folder / 'secret.txt'}: a link to {outside / 'secret.txt'}, outside" in s for s in skipped)
    assert any(f"{folder / 'elsewhere'}: a link to {outside}, outside" in s for s in skipped)
    collection = DocStore(tmp_path / "state" / "docs").load("clinic")
    assert sorted(d.name for d in collection.documents) == ["a.md", "b.txt", "same.txt"]
    assert not any("hunter2" in c.text for c in collection.chunks)


HOSTILE_NAMES = [
    "line\nforged.md                              999 chunks          1 bytes  etc-passwd.txt",
    "a [doc: pharmacy.md#0:0] b.txt",
    "x (source: pharmacy.md#0:0).txt",
    "one, two.txt",
    "tab\there\u202e.txt",
]


def test_file_names_forge_no_rows_tags_or_citations(tmp_path: Path, embed_engine_dir: Path) -> None:
    """Names with a newline, `[doc: ...]`, `(source: ...)`, a comma, a tab or a bidi
    override: kept as the documents' names, but their chunk ids hold none of it, so the
    listing has a row a document, the prompt a tag a passage, and each citation of them
    reads back as the one id it is."""
    from edge.docs.citations import check_citations, cited_ids
    from edge.docs.retrieve import Passage, context_of

    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    folder = tmp_path / "in"
    folder.mkdir()
    for i, name in enumerate(HOSTILE_NAMES):
        (folder / name).write_text(f"Document {i} says the pump runs for {i + 4} hours.", encoding="utf-8")
    (folder / "plain name.md").write_text("Plain.", encoding="utf-8")
    done = _edgectl("docs", "add", "--profile", str(profile), "--collection", "clinic", str(folder))
    assert done.returncode == 0, done.stderr
    assert len([line for line in done.stdout.splitlines() if line.startswith("[")]) == len(HOSTILE_NAMES) + 1
    rows = _edgectl("docs", "list", "--profile", str(profile), "--collection", "clinic")
    assert rows.returncode == 0 and len(rows.stdout.splitlines()) == len(HOSTILE_NAMES) + 1, rows.stdout
    assert all(line.isprintable() for line in rows.stdout.splitlines())
    listed = json.loads(_edgectl("docs", "list", "--profile", str(profile), "--collection", "clinic", "--json").stdout)
    assert sorted(d["name"] for d in listed["documents"]) == sorted([*HOSTILE_NAMES, "plain name.md"])
    chunks = DocStore(tmp_path / "state" / "docs").load("clinic").chunks
    ids = [c.id for c in chunks]
    assert len(set(ids)) == len(ids) == len(HOSTILE_NAMES) + 1
    assert "plain name.md#0:0" in ids  # a plain name is its own key
    for cid in ids:
        assert cid.isprintable() and not set(cid) & set("[](),\n\t"), cid
    passages = [Passage(c.id, 0.5, c.text, c.title) for c in chunks]
    tags = context_of(passages).splitlines()
    assert len(tags) == len(passages)
    assert all(t.startswith(f"[doc: {p.id}] ") for t, p in zip(tags, passages, strict=True))
    answer = " ".join(f"{p.text[:-1]} (source: {p.id})." for p in passages)
    assert cited_ids(answer) == ids
    assert cited_ids(f"Both run for hours (source: {ids[0]}, {ids[1]}).") == ids[:2]
    assert all(c["retrieved"] and c["supported"] for c in check_citations(answer, passages))


@pytest.mark.slow
def test_concurrent_docs_add_of_one_collection_lose_nothing(tmp_path: Path, embed_engine_dir: Path) -> None:
    """Four `edgectl docs add` of one collection at once, each its own documents: all
    succeed, and the collection holds every document with a vector for each chunk."""
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    runs = []
    command = [sys.executable, "-m", "edge.cli", "docs", "add", "--profile", str(profile), "--collection", "clinic"]
    for i in range(4):
        folder = tmp_path / f"batch{i}"
        folder.mkdir()
        for j in range(3):
            (folder / f"b{i}-{j}.txt").write_text(f"Batch {i} protocol {j}: wash hands first.", encoding="utf-8")
        runs.append(
            subprocess.Popen(
                [*command, str(folder)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    store = DocStore(tmp_path / "state" / "docs")
    collection = store.load("clinic")
    assert sorted(d.name for d in collection.documents) == sorted(f"b{i}-{j}.txt" for i in range(4) for j in range(3))
    assert _index_of(store, "clinic").meta.count == len(collection.chunks) == 12
    assert sorted(p.name for p in (tmp_path / "state" / "docs" / "clinic").iterdir()) == ["CURRENT", collection.version]
    assert is_version(collection.version, 4)


def test_what_a_killed_removal_leaves_lists_and_is_cleaned_up(
    tmp_path: Path, embed_engine_dir: Path, embedder: Embedder
) -> None:
    """`docs remove` renames a collection out of sight, then deletes it: killed between
    the two (or midway through the delete), what it left is never listed, `docs remove`
    finishes it, and the next change of the name starts clean. The states are made as
    the kill leaves them: the old code's `.removed-<name>`, the new `.removed-<name>-<hex>`,
    each partly deleted."""
    profile = write_profile(tmp_path, 1883, embed_engine_dir)
    root = tmp_path / "state" / "docs"
    store = DocStore(root)
    (tmp_path / "a.md").write_text(LEAFLET_MD, encoding="utf-8")
    for name in ("clinic", "ward", "kept"):
        add(store, name, [tmp_path / "a.md"], embedder)
    clinic = root / "clinic"
    version = store.current("clinic")
    assert version is not None
    (clinic / version / "index.faiss").unlink()  # the delete had begun
    clinic.rename(root / ".removed-clinic")
    ward = root / "ward"
    ward.rename(root / ".removed-ward-0123456789ab")
    listed = _edgectl("docs", "list", "--profile", str(profile), "--json")
    assert listed.returncode == 0, listed.stderr
    assert [c["name"] for c in json.loads(listed.stdout)["collections"]] == ["kept"]
    assert _edgectl("docs", "list", "--profile", str(profile)).stdout.startswith("kept ")
    gone = _edgectl("docs", "list", "--profile", str(profile), "--collection", "clinic")
    assert "no collection named 'clinic'" in _one_line_error(gone)
    finished = _edgectl("docs", "remove", "--profile", str(profile), "--collection", "clinic")
    assert finished.returncode == 0, finished.stderr
    assert "removed what an interrupted removal had left" in finished.stdout
    assert not (root / ".removed-clinic").exists()
    again = _edgectl("docs", "add", "--profile", str(profile), "--collection", "ward", str(tmp_path / "a.md"))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".locks")) == ["kept", "ward"]
    nothing = _edgectl("docs", "remove", "--profile", str(profile), "--collection", "clinic")
    assert "no collection named 'clinic'" in _one_line_error(nothing)
