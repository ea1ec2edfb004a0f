"""The OpenAI-compatible HTTP API's listener (docs/http.md): off unless configured,
loopback unless the profile says otherwise, keys and TLS from files."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from edge.config.base import StrictModel
from edge.config.service import checked_listen, listen_address

logger = logging.getLogger(__name__)


class HTTPConfig(StrictModel):
    listen: str | None = Field(
        default=None,
        title="HTTP listener",
        description="host:port of the OpenAI-compatible API (docs/http.md), or null (the default) for none. "
        "A host other than loopback also needs allow_remote.",
    )
    allow_remote: bool = Field(
        default=False,
        title="Allow remote clients",
        description="Let listen name an address beyond loopback (0.0.0.0, a LAN address). Needs "
        "api_keys_file (refused without it); without cert_file and key_file the keys and prompts cross the "
        "network in clear, which is logged as a warning.",
    )
    api_keys_file: Path | None = Field(
        default=None,
        title="API keys file",
        description="File of hashed API keys, one `name:sha256:HEX` a line (`edgectl http-key add`); every "
        "request must then carry one as `Authorization: Bearer KEY`. Unset: no key is asked for.",
    )
    cert_file: Path | None = Field(
        default=None,
        title="TLS certificate",
        description="PEM certificate (chain) the listener serves HTTPS with; unset: plain HTTP.",
    )
    key_file: Path | None = Field(default=None, title="TLS key", description="PEM private key matching cert_file.")
    max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        title="Request size limit",
        description="Largest request body accepted, in bytes; a larger one is answered 413.",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        title="Request timeout",
        description="Longest a request waits for its job's result before it is answered 504 (the job is "
        "withdrawn if still queued).",
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return checked_listen(value, "127.0.0.1:8080")

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> HTTPConfig:
        address = self.address
        if address is not None and not self.allow_remote and not _loopback(address[0]):
            raise ValueError(f"listen {self.listen!r} is not loopback: set allow_remote to serve beyond this box")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.allow_remote and self.api_keys_file is None:
            # Beyond loopback anyone on the network could run jobs: keys are not optional there.
            raise ValueError("allow_remote needs api_keys_file (make one with `edgectl http-key add`)")
        if self.allow_remote and address is not None and self.cert_file is None:
            logger.warning(
                "http.allow_remote without http.cert_file and http.key_file: API keys and prompts cross "
                "the network in clear"
            )
        return self

    @property
    def address(self) -> tuple[str, int] | None:
        return listen_address(self.listen)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
