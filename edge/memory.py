"""Measured memory figures (never estimates): process resident set size."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def return_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). An unloaded
    model's buffers go back to the heap, not to the system: without this the process
    keeps them resident and an eviction frees memory only on paper. False where the
    C library has no such call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux, including Jetson)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started (VmHWM), model loads'
    transient peaks included: what the budget must hold, not only the settled figure."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return rss_bytes()  # kernels without the field: the current figure is the best known


class RssProbe:
    """The ledger's probe on a CPU box: the process's resident set."""

    def used_bytes(self) -> int:
        return rss_bytes()
