"""API keys for the HTTP listener: a file of hashed keys, like the broker's password file.

Each line is `name:sha256:HEX`, the SHA-256 of a key made by `edgectl http-key add`
(32 random bytes, so a plain hash is enough: there is nothing to guess a dictionary
from, unlike a password). The file never holds a key itself; the key is shown once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SCHEME = "sha256"
KEY_PREFIX = "edge-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyFile:
    hashes: dict[str, str]  # name -> hex digest

    @classmethod
    def load(cls, path: Path) -> KeyFile:
        """ValueError naming the line for one that is not `name:sha256:HEX`."""
        hashes: dict[str, str] = {}
        for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, _, rest = line.partition(":")
            scheme, _, digest = rest.partition(":")
            if not name or scheme != SCHEME or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{path}:{number}: expected name:{SCHEME}:<64 hex digits>")
            hashes[name] = digest
        return cls(hashes)

    def match(self, key: str) -> str | None:
        """The name of the key, or None."""
        digest = hash_key(key)
        found = None
        for name, known in self.hashes.items():
            if hmac.compare_digest(digest, known):  # every entry compared: no early exit to time
                found = name
        return found


def add_key(path: Path, name: str) -> str:
    """Make a key, append its hash under `name` to `path` (created mode 0600), and return
    the key: the only time it is seen."""
    if not name or ":" in name or any(c.isspace() for c in name):
        raise ValueError("a key's name is one word without ':'")
    if path.exists() and name in KeyFile.load(path).hashes:
        raise ValueError(f"{path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(f"{name}:{SCHEME}:{hash_key(key)}\n")
    return key
