"""Choices made from measured costs that keep measuring the option they turn down.

The batcher picks between two ways of doing one thing by what each measured so far:
restore an offloaded row or prefill it again (kv_offload.py), split a prompt at its kept
prefix or prefill it whole (prefix_cache.py). An option that is never taken is never
measured again, so one slow measurement (a first run that loaded kernels, a run beside
another branch's burst) would rule it out for the life of the daemon. A `Recheck` lets
the declined option through once in `every` declines, so its figure follows the box.
"""

from __future__ import annotations

import threading

RECHECK_EVERY = 16


class Recheck:
    def __init__(self, every: int = RECHECK_EVERY) -> None:
        if every < 1:
            raise ValueError(f"recheck every {every} declines: must be at least 1")
        self.every = every
        self.declined = 0  # times the measured costs turned the option down
        self.taken = 0  # of those, the times it was taken anyway, to be measured again
        self._lock = threading.Lock()

    def take_anyway(self) -> bool:
        """The measured costs turned the option down: True when it is taken all the same
        (every `every`-th decline), so that it is measured again."""
        with self._lock:
            self.declined += 1
            if self.declined % self.every:
                return False
            self.taken += 1
            return True
