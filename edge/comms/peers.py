"""The other boxes online on our shared job stream, from their availability notices.

Mosquitto (2.0; issue 2662) keeps handing a member of a shared subscription its turn of
the stream's jobs while the member is away, as long as its session lasts: a box stopped
cleanly for a day would hold every n-th job of the stream for that day. A box that knows
another member is online can leave the stream as it stops, and the broker gives the whole
stream to the others; a box that sees none stays in it, so that the broker keeps the
stream's jobs in its session for its return instead of dropping them for want of a
subscriber.

Each box announces itself on `<prefix>/<device>/available`, online or offline (its will),
with the shared group it takes from as user property `group` (edge/comms/mqtt.py). Pure
logic: the link feeds it the notices, tests drive it directly.
"""

from __future__ import annotations

import threading

__all__ = ["StreamPeers"]


class StreamPeers:
    def __init__(self, prefix: str, device_id: str, member: tuple[str, str], online: bytes) -> None:
        """`member`: the user property a notice of our stream's boxes carries; `online`:
        the payload of a box that is."""
        self._prefix = prefix
        self._device_id = device_id
        self._member = member
        self._online_payload = online
        self._lock = threading.Lock()
        self._online: set[str] = set()

    @property
    def topic_filter(self) -> str:
        """Every box's availability topic."""
        return f"{self._prefix}/+/available"

    def notice(self, topic: str, payload: bytes, user_properties: list[tuple[str, str]]) -> None:
        """One availability notice: a box whose latest notice says `online` and names our
        group is a member online; any other notice of it (offline, its will, an empty
        retained message, another group) means it is not."""
        levels = topic.split("/")
        if len(levels) != 3 or levels[0] != self._prefix or levels[2] != "available":
            return
        device = levels[1]
        if device == self._device_id:
            return  # our own topic: not a peer, whoever sent it (edge/comms/identity.py watches it)
        ours = self._member in [tuple(p) for p in user_properties]
        with self._lock:
            if ours and payload == self._online_payload:
                self._online.add(device)
            else:
                self._online.discard(device)

    def online(self) -> list[str]:
        with self._lock:
            return sorted(self._online)
