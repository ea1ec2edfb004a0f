"""Measured memory figures (never estimates): process resident set size."""

from __future__ import annotations

import os

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux, including Jetson)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE


class RssProbe:
    """The ledger's probe on a CPU box: the process's resident set."""

    def used_bytes(self) -> int:
        return rss_bytes()
