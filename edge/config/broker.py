"""The profile's MQTT sections: the broker connection (with its TLS settings) and the
topic layout."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from edge.config.base import TOPIC_SEGMENT, StrictModel


class TLSConfig(StrictModel):
    ca_file: Path | None = Field(
        default=None,
        title="CA certificate",
        description="PEM file with the CA that signed the broker's certificate; the system store is used when unset.",
    )
    cert_file: Path | None = Field(
        default=None,
        title="Client certificate",
        description="PEM client certificate for brokers that require mutual TLS.",
    )
    key_file: Path | None = Field(
        default=None,
        title="Client key",
        description="PEM private key matching cert_file.",
    )
    insecure: bool = Field(
        default=False,
        title="Skip hostname check",
        description="Do not verify the broker's hostname against its certificate. "
        "Only for lab setups with IP-addressed brokers.",
    )

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        return self


class BrokerConfig(StrictModel):
    host: str = Field(default="127.0.0.1", title="Broker host", description="MQTT broker host name or address.")
    port: int = Field(default=1883, ge=1, le=65535, title="Broker port", description="MQTT broker TCP port.")
    client_id: str | None = Field(
        default=None,
        title="Client id",
        description="MQTT client identifier; defaults to 'edge-<device_id>'.",
    )
    keepalive_s: int = Field(
        default=30,
        ge=5,
        le=3600,
        title="Keepalive",
        description="Seconds between MQTT keepalive pings.",
    )
    username: str | None = Field(
        default=None, title="Username", description="MQTT username, if the broker asks for one."
    )
    password: str | None = Field(
        default=None,
        title="Password",
        description="MQTT password. Prefer password_file so the secret stays out of the profile; never logged.",
    )
    password_file: Path | None = Field(
        default=None,
        title="Password file",
        description="File whose first line is the MQTT password (e.g. a systemd credential).",
    )
    tls: TLSConfig | None = Field(
        default=None, title="TLS", description="Enable TLS to the broker with these settings."
    )
    session_expiry_s: int = Field(
        default=86400,
        ge=0,
        le=4294967295,
        title="Session expiry",
        description="How long the broker keeps this daemon's session (its subscriptions and the jobs that "
        "arrive for it) after a disconnect, in seconds. The broker must also persist sessions across its own "
        "restarts (Mosquitto: `persistence true`).",
    )
    reconnect_min_s: float = Field(
        default=0.5,
        gt=0,
        title="Reconnect backoff start",
        description="First delay before reconnecting after the broker goes away.",
    )
    reconnect_max_s: float = Field(
        default=30.0,
        gt=0,
        title="Reconnect backoff cap",
        description="Longest delay between reconnect attempts (exponential backoff).",
    )

    @model_validator(mode="after")
    def _one_password_source(self) -> BrokerConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("give either password or password_file, not both")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        return self


class TopicsConfig(StrictModel):
    prefix: str = Field(
        default="edge",
        title="Topic prefix",
        description="First topic level; jobs arrive on <prefix>/<device_id>/jobs/<task>.",
    )
    shared_group: str | None = Field(
        default=None,
        title="Shared subscription group",
        description="When set, also subscribe to $share/<group>/<prefix>/jobs/+ so that "
        "several boxes split one job stream through the broker.",
    )

    @field_validator("prefix", "shared_group")
    @classmethod
    def _plain_segment(cls, value: str | None) -> str | None:
        if value is not None and not TOPIC_SEGMENT.match(value):
            raise ValueError("must be one topic level of letters, digits, '_', '.', '-'")
        return value
