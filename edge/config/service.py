"""The daemon's own sections: input limits, queues, the journal, directories, the status
socket, metrics, tracing and the watchdog."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import Field, field_validator

from edge.config.base import StrictModel


class LimitsConfig(StrictModel):
    max_payload_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        title="Maximum payload",
        description="Larger MQTT job payloads are answered with an error without parsing.",
    )
    max_image_bytes: int = Field(
        default=6 * 1024 * 1024,
        ge=1024,
        title="Maximum image bytes",
        description="Largest encoded image accepted (after base64 decoding or on disk).",
    )
    max_image_pixels: int = Field(
        default=25_000_000,
        ge=1024,
        title="Maximum image pixels",
        description="Largest width*height decoded; guards against decompression bombs.",
    )
    max_prompt_chars: int = Field(
        default=8000,
        ge=16,
        title="Maximum prompt characters",
        description="Question plus context longer than this is rejected before tokenizing.",
    )


class QueueConfig(StrictModel):
    max_size: int = Field(
        default=256,
        ge=1,
        title="Queue size per branch",
        description="Jobs waiting per branch beyond this are answered `busy`.",
    )
    default_deadline_ms: int | None = Field(
        default=None,
        ge=1,
        title="Default deadline",
        description="Deadline for jobs that carry none; unset means no deadline.",
    )
    memory_wait_ms: int = Field(
        default=100,
        ge=0,
        title="Memory wait",
        description="How long a text job that does not fit the KV budget waits before a running sequence of "
        "lower priority is paused for it. It answers `over_budget` if its deadline passes while it waits.",
    )
    drain_timeout_s: float = Field(
        default=10.0,
        ge=0.0,
        le=3600.0,
        title="Drain timeout",
        description="On SIGTERM, how long each branch may take to finish the job in hand before the daemon "
        "stops anyway (keep it below systemd's TimeoutStopSec).",
    )


class JournalConfig(StrictModel):
    dedup_window_s: float = Field(
        default=86400.0,
        gt=0.0,
        title="Dedup window",
        description="A job id seen again within this many seconds is answered from the journal instead of "
        "running again; answered jobs older than this are compacted away.",
    )
    max_mib: int = Field(
        default=256,
        ge=1,
        title="Journal size limit",
        description="Largest size of the journal file, in MiB. When it (or the disk) is full, new jobs are "
        "refused with `storage_full` instead of being accepted unkept.",
    )
    max_replays: int = Field(
        default=3,
        ge=1,
        title="Replays per job",
        description="Starts of the daemon that may take up one unfinished job again. A job still unfinished "
        "after this many (one that brings the daemon down, say) is answered `internal` instead.",
    )
    compact_interval_s: float = Field(
        default=60.0,
        gt=0.0,
        title="Compaction interval",
        description="How often answered jobs past the dedup window are removed from the journal.",
    )


class PathsConfig(StrictModel):
    state_dir: Path = Field(
        default=Path("/var/lib/edged"),
        title="State directory",
        description="Persistent state (journal). systemd's StateDirectory= in production.",
    )
    runtime_dir: Path = Field(
        default=Path("/run/edged"),
        title="Runtime directory",
        description="Holds the status socket. systemd's RuntimeDirectory= in production.",
    )
    engine_dir: Path = Field(
        default=Path("/var/lib/edged/engines"),
        title="Engine directory",
        description="Built engines and converted checkpoints, keyed by their inputs.",
    )
    media_dir: Path | None = Field(
        default=None,
        title="Media directory",
        description="Jobs may name images by path inside this directory; unset disables "
        "paths entirely. Paths that resolve outside it (.., symlinks) are refused.",
    )


class StatusConfig(StrictModel):
    socket_mode: int = Field(
        default=0o660,
        ge=0,
        le=0o777,
        title="Socket mode",
        description="Permission bits of the status socket.",
    )
    socket_group: str | None = Field(
        default=None,
        title="Socket group",
        description="Group that owns the status socket, so monitoring users can read it.",
    )


# A host name's labels (RFC 1123): letters, digits and inner hyphens, at most 63 each.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def listen_host(host: str) -> bool:
    """An IP address (IPv6 in brackets) or a host name: what the listener can bind, checked
    when the profile is read rather than when the listener starts."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    # All-digit labels are an IPv4 address or nothing (999.1.1.1 is not a name).
    named = not all(label.isdigit() for label in labels)
    return named and len(host) <= 253 and all(_LABEL.match(label) for label in labels)


def checked_listen(value: str | None, example: str) -> str | None:
    """A listener's host:port as a profile gives it (None: no listener); ValueError saying
    what is wrong, with `example` of the right form."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port, e.g. {example}")
    if not listen_host(host):
        raise ValueError(f"{host!r} is neither an IP address nor a host name")
    return value


def listen_address(listen: str | None) -> tuple[str, int] | None:
    """(host, port) of a checked host:port, an IPv6 host without its brackets."""
    if listen is None:
        return None
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsConfig(StrictModel):
    listen: str | None = Field(
        default="127.0.0.1:9464",
        title="Metrics listener",
        description="host:port of the Prometheus metrics endpoint (GET /metrics), or null for none. Loopback by "
        "default: the figures name the box's models and jobs, so expose them wider only on purpose.",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return checked_listen(value, "127.0.0.1:9464")

    @property
    def address(self) -> tuple[str, int] | None:
        return listen_address(self.listen)


class TracingConfig(StrictModel):
    otlp_endpoint: str | None = Field(
        default=None,
        title="OTLP endpoint",
        description="Where job spans go over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces (needs the "
        "opentelemetry-exporter-otlp-proto-http package); unset: no export, though a requester's traceparent is "
        "still continued and echoed on the result.",
    )


class WatchdogConfig(StrictModel):
    stall_s: float = Field(
        default=300.0,
        gt=0.0,
        le=86400.0,
        title="Stall limit",
        description="A branch worker busy with one job (or one batch) for longer than this, or a worker "
        "thread that died, counts as hung: the daemon stops sending WATCHDOG=1 so that systemd restarts it.",
    )
