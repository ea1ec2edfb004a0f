"""Document names where text is parsed: in chunk ids (the prompt's `[doc: <id>]` tags,
the answer's `(source: <id>, <id>)` citations) and on the terminal.

A file name may hold anything but '/' and NUL: newlines, brackets, parentheses, commas.
Put into an id as it is, such a name forges passage tags and rows, or splits its own
citation in two. So a chunk id names its document by a key that cannot: the name itself
where it is plain (letters, digits, single inner spaces and `._+@&=-`), otherwise the
plain part of it followed by `~` and a hash of the whole name. The key never holds `~`
where the name is kept as it is, so a hashed key never equals a plain name; the
original name stays the document's name, as data."""

from __future__ import annotations

import hashlib
import re

PLAIN_CHARS = r"[\w.+@&=-]"
PLAIN = re.compile(rf"{PLAIN_CHARS}+(?: {PLAIN_CHARS}+)*")
NOT_PLAIN = re.compile(r"[^\w.+@&=-]+")
MAX_KEY = 80  # an id goes into every prompt that retrieves it: long names are cut (and hashed)
HASH_CHARS = 12


def source_key(name: str) -> str:
    """The document's part of its chunks' ids: `name` where it is plain and short, else
    a plain form of it with a hash of the whole name."""
    if PLAIN.fullmatch(name) and len(name) <= MAX_KEY:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]
    plain = NOT_PLAIN.sub("_", name).strip("_")[: MAX_KEY - HASH_CHARS - 1] or "document"
    return f"{plain}~{digest}"


def printable(text: str) -> str:
    """`text` on one line: every character that does not print (newlines, other control
    and format characters) as its escape, so a name shows as one row."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text)
