"""Choices made from measured costs that keep measuring the option they turn down.

The batcher picks between two ways of doing one thing by what each measured so far:
restore an offloaded row or prefill it again (kv_offload.py), split a prompt at its kept
prefix or prefill it whole (prefix_cache.py). An option that is never taken is never
measured again, so one slow measurement (a first run that loaded kernels, a run beside
another branch's burst) would rule it out for the life of the daemon.

A `Recheck` lets the declined option through after `every` declines, so its figure
follows the box. Each time it does so and the option is still declined after, the wait
doubles (up to `most`): an option that really is slower here costs a shrinking share of
the decisions. Once the measured costs choose the option on their own, the wait is back
to `every`.
"""

from __future__ import annotations

import threading

RECHECK_EVERY = 16
RECHECK_MOST = 1024


class Recheck:
    def __init__(self, every: int = RECHECK_EVERY, most: int = RECHECK_MOST) -> None:
        if not 1 <= every <= most:
            raise ValueError(f"recheck after {every} to {most} declines: need 1 <= every <= most")
        self.every = every
        self.most = most
        self.wait = every  # declines before the next recheck
        self.declined = 0  # times the measured costs turned the option down
        self.taken = 0  # of those, the times it was taken anyway, to be measured again
        self._since = 0
        self._lock = threading.Lock()

    def take_anyway(self) -> bool:
        """The measured costs turned the option down: True when it is taken all the same
        (the `wait`-th decline since the last recheck), so that it is measured again."""
        with self._lock:
            self.declined += 1
            self._since += 1
            if self._since < self.wait:
                return False
            self._since = 0
            self.taken += 1
            self.wait = min(self.wait * 2, self.most)
            return True

    def chosen(self) -> None:
        """The measured costs chose the option: it is in use, and measured, again."""
        with self._lock:
            self._since = 0
            self.wait = self.every
