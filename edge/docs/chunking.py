"""Documents cut into chunks for retrieval, the same way every time.

A section's text is cut at paragraph ends into chunks of at most `max_chars`; a paragraph
longer than that is cut at sentence ends, and a sentence longer than that at spaces (or
hard, for text with none). A chunk's id names its document, its section and where in the
section's text it starts: `<document>#<section>:<offset>`, stable for the same text; the
document by its key (edge/docs/names.py), which no file name can make into a forged tag
or a split citation."""

from __future__ import annotations

import re
from dataclasses import dataclass

from edge.docs.extract import Section
from edge.docs.names import source_key

MAX_CHARS = 1000
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Chunk:
    id: str
    document: str
    section: int
    title: str  # the section's heading
    offset: int  # where the chunk starts in its section's text
    text: str


def chunk_id(document: str, section: int, offset: int) -> str:
    return f"{source_key(document)}#{section}:{offset}"


def _pieces(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """Spans of text[start:end] no longer than max_chars: whole sentences put together
    while they fit, a longer sentence cut at spaces, a longer word cut anywhere."""
    if end - start <= max_chars:
        return [(start, end)]
    for splitter in (SENTENCE_END, SPACE):
        bounds = [m.end() for m in splitter.finditer(text, start, end) if m.end() < end]
        if not bounds:
            continue
        spans = _packed(list(zip([start, *bounds], [*bounds, end], strict=True)), max_chars)
        return [p for a, b in spans for p in _pieces(text, a, b, max_chars)]
    return _hard(start, end, max_chars)


def _packed(units: list[tuple[int, int]], max_chars: int) -> list[tuple[int, int]]:
    """Consecutive spans merged, in order, while the merged span fits max_chars."""
    out: list[tuple[int, int]] = []
    for a, b in units:
        if out and b - out[-1][0] <= max_chars:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _hard(start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    return [(a, min(a + max_chars, end)) for a in range(start, end, max_chars)]


def chunk_sections(document: str, sections: list[Section], max_chars: int = MAX_CHARS) -> list[Chunk]:
    """The chunks of a document's sections, in order."""
    chunks: list[Chunk] = []
    for index, section in enumerate(sections):
        text = section.text
        paragraphs = [(m.start(), m.end()) for m in re.finditer(r"\S(?:.*?\S)?(?=\n\s*\n|\Z)", text, re.S)]
        spans = [p for a, b in paragraphs for p in _pieces(text, a, b, max_chars)]
        chunks += [_chunk(document, index, section, a, b) for a, b in _packed(spans, max_chars)]
    return chunks


def _chunk(document: str, index: int, section: Section, begin: int, end: int) -> Chunk:
    text = section.text[begin:end].strip()
    offset = begin + (len(section.text[begin:end]) - len(section.text[begin:end].lstrip()))
    return Chunk(chunk_id(document, index, offset), document, index, section.title, offset, text)
