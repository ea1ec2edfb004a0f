"""Two daemons with one identity: noticed, said, and backed off from.

Two boxes configured with the same device id (a cloned SD card, a copied profile) fight
without a word otherwise. With the same client id each connect takes the other's session
(the broker disconnects the older one with reason "Session taken over"), dozens of times
a minute, and jobs land on whichever holds the session. With different client ids both
take every job on the device's topics and answer it twice.

Either shows here (each daemon announces itself on its availability topic with a nonce
of its own): repeated takeovers (a DISCONNECT saying so, from brokers that send one, or
on reconnecting, another instance's retained notice), or a live notice on our own topic
from another instance. Status then
says CRITICAL with the reason, and reconnects after a takeover wait longer and longer,
so the other box keeps a stable session instead of both losing theirs every second.
The alarm clears once neither sign has been seen for a quiet period.

Pure logic with an injectable clock: the link feeds it events, tests drive it directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

TAKEOVER_REASON = 142  # MQTT v5 DISCONNECT reason 0x8E: Session taken over
TAKEOVERS = 2  # this many takeovers ...
TAKEOVER_WINDOW_S = 120.0  # ... within this long is another box, not a blip
BACKOFF_FIRST_S = 15.0
BACKOFF_MAX_S = 600.0
QUIET_S = 900.0  # no sign of the other for this long clears the alarm


class IdentityWatch:
    def __init__(self, device_id: str, client_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.device_id = device_id
        self.client_id = client_id
        self._clock = clock
        self._lock = threading.Lock()
        self._takeovers: deque[float] = deque()
        self._last_sign: float | None = None
        self._reason: str | None = None
        self._backoff = 0.0
        self.takeovers_total = 0
        self.foreign_notices = 0

    def taken_over(self) -> float | None:
        """Our session was taken by a client with our id (the broker said so, or we found
        another instance's notice on reconnecting): the delay to wait before the next
        reconnect if this is another box (None: reconnect as usual)."""
        now = self._clock()
        with self._lock:
            self.takeovers_total += 1
            self._takeovers.append(now)
            while self._takeovers and now - self._takeovers[0] > TAKEOVER_WINDOW_S:
                self._takeovers.popleft()
            if len(self._takeovers) < TAKEOVERS and self._reason is None:
                return None
            self._last_sign = now
            self._backoff = BACKOFF_FIRST_S if self._backoff == 0 else min(BACKOFF_MAX_S, self._backoff * 2)
            self._reason = (
                f"another client uses client id {self.client_id!r} (device id {self.device_id!r}): "
                f"{len(self._takeovers)} session takeovers in {TAKEOVER_WINDOW_S:.0f} s; "
                f"reconnecting after {self._backoff:.0f} s"
            )
            reason, backoff = self._reason, self._backoff
        logger.critical("%s", reason)
        return backoff

    def foreign_notice(self, instance: str) -> None:
        """An availability notice on our own topic from an instance that is not us."""
        with self._lock:
            self.foreign_notices += 1
            self._last_sign = self._clock()
            self._reason = (
                f"another daemon announces itself as device {self.device_id!r} (instance {instance[:16]}): "
                "two boxes share this device id and both take its jobs"
            )
            reason = self._reason
        logger.critical("%s", reason)

    def problem(self) -> str | None:
        """The alarm, or None once no sign of another box has come for QUIET_S."""
        with self._lock:
            if self._reason is not None and self._last_sign is not None:
                if self._clock() - self._last_sign > QUIET_S:
                    logger.warning("no sign of another box using device id %r for %.0f s", self.device_id, QUIET_S)
                    self._reason, self._backoff = None, 0.0
                    self._takeovers.clear()
            return self._reason

    def snapshot(self) -> dict[str, object]:
        problem = self.problem()
        with self._lock:
            return {
                "duplicate": problem,
                "takeovers": self.takeovers_total,
                "foreign_notices": self.foreign_notices,
                "backoff_s": self._backoff,
            }
