"""systemd service notifications (READY, WATCHDOG, STATUS, STOPPING).

systemd-python's `daemon.notify` is used when installed; the protocol is one datagram
to $NOTIFY_SOCKET, so a small fallback keeps the daemon notifying on boxes without it.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

try:
    from systemd import daemon as _sd_daemon

    SYSTEMD_SUPPORT = True
except ImportError:
    _sd_daemon = None
    SYSTEMD_SUPPORT = False


def _send_datagram(message: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
        except OSError as err:
            logger.debug("sd_notify failed: %s", err)
            return False
    return True


def notify(message: str) -> bool:
    """Tell systemd; False where it could not be told. Never raises: a notification that
    fails (no file descriptor left, the socket gone) is logged, and the daemon goes on."""
    try:
        if _sd_daemon is not None:
            return bool(_sd_daemon.notify(message))
        return _send_datagram(message)
    except OSError as err:
        logger.warning("systemd notification failed: %s", err)
        return False


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC when the watchdog is armed for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


class Notifier:
    """Remembers the last STATUS so the main loop can update it only on change."""

    def __init__(self) -> None:
        self._status = ""

    def ready(self, status: str) -> None:
        self._status = status
        notify(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        if status != self._status:
            self._status = status
            notify(f"STATUS={status}")

    def watchdog(self) -> None:
        notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        """Ask systemd for `seconds` more before it gives up on the start in progress
        (a first-start build takes minutes; TimeoutStartSec is shorter). It must be
        sent again within that time, or the extension runs out."""
        notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self, status: str) -> None:
        self._status = status
        notify(f"STOPPING=1\nSTATUS={status}")
