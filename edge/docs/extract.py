"""Text out of a document file, in sections: Markdown and HTML by their headings, PDF by
page, plain text whole. Every failure is a DocumentError naming the file and the reason."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from edge.docs.names import printable

logger = logging.getLogger(__name__)

KINDS = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".pdf": "pdf",
}
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


class DocumentError(ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        # One line whatever the name holds: it is shown as one.
        super().__init__(printable(f"{path}: {reason}"))
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Section:
    title: str  # its heading, "page N" for a PDF page, "" for what comes before any heading
    text: str


def extract(path: Path, max_bytes: int) -> list[Section]:
    """The sections of the document at `path` (at most `max_bytes` long), empty ones left out."""
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise DocumentError(path, f"unsupported type {path.suffix or '(none)'}; supported: {', '.join(sorted(KINDS))}")
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise DocumentError(path, "not a regular file")
        if size > max_bytes:
            raise DocumentError(path, f"{size} bytes; the limit is {max_bytes} bytes")
        raw = path.read_bytes()
    except OSError as err:
        raise DocumentError(path, f"cannot be read: {err.strerror or err}") from err
    if kind == "pdf":
        sections = _pdf(path, raw)
    else:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            raise DocumentError(path, f"not UTF-8 text (byte {err.start})") from err
        if kind == "markdown":
            sections = _markdown(text)
        elif kind == "html":
            sections = _html(text)
        else:
            sections = [Section("", text)]
    sections = [Section(s.title, _tidy(s.text)) for s in sections]
    return [s for s in sections if s.text]


def _tidy(text: str) -> str:
    """Line ends made \\n, trailing spaces and runs of blank lines cut: the text chunk
    offsets count in."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _markdown(text: str) -> list[Section]:
    sections: list[Section] = []
    title, body = "", list[str]()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match:
            sections.append(Section(title, "\n".join(body)))
            title, body = match.group(2), []
        else:
            body.append(line)
    sections.append(Section(title, "\n".join(body)))
    return sections


class _HTMLText(HTMLParser):
    BLOCKS = frozenset({"p", "div", "li", "br", "tr", "table", "section", "article", "ul", "ol", "pre", "blockquote"})
    SKIP = frozenset({"script", "style", "head", "noscript", "template"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[Section] = []
        self.title = ""
        self.parts: list[str] = []
        self.heading: list[str] | None = None
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self.skipping += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self.heading = []
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif re.fullmatch(r"h[1-6]", tag) and self.heading is not None:
            self.flush()
            self.title = " ".join("".join(self.heading).split())
            self.heading = None
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self.skipping:
            return
        if self.heading is not None:
            self.heading.append(data)
        else:
            self.parts.append(data)

    def flush(self) -> None:
        text = "".join(self.parts)
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        self.sections.append(Section(self.title, "\n\n".join(p for p in paragraphs if p)))
        self.parts = []


def _html(text: str) -> list[Section]:
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    parser.flush()
    return parser.sections


def _pdf(path: Path, raw: bytes) -> list[Section]:
    import io

    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(raw))
        if reader.is_encrypted:
            raise DocumentError(path, "an encrypted PDF")
        return [Section(f"page {i + 1}", page.extract_text() or "") for i, page in enumerate(reader.pages)]
    except DocumentError:
        raise
    except Exception as err:
        # A hostile file can make the parser fail in any way (pypdf's LimitReachedError for a
        # stream whose length refers to itself or a flate bomb, a RecursionError, ...): each
        # is this file's fault, said with its name.
        raise DocumentError(path, f"not a readable PDF: {type(err).__name__}: {err}") from err
