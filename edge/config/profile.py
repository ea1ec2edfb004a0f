"""The daemon's profile: one typed schema for everything `edgectl serve` needs, composed
of the sections in edge/config (broker, vision, text, service; the backends' own in
edge/config/backends.py).

Every model forbids unknown keys so that a typo in a profile fails at start with the
field's path instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from edge.config.base import TOPIC_SEGMENT, StrictModel
from edge.config.broker import BrokerConfig, TopicsConfig
from edge.config.http import HTTPConfig
from edge.config.service import (
    JournalConfig,
    LimitsConfig,
    MetricsConfig,
    PathsConfig,
    QueueConfig,
    StatusConfig,
    TracingConfig,
    WatchdogConfig,
)
from edge.config.text import QAModelConfig
from edge.config.vision import InspectModelConfig, OCRModelConfig


class ModelsConfig(StrictModel):
    ocr: OCRModelConfig = Field(
        default_factory=OCRModelConfig,
        title="OCR models",
        description="Vision branch: PP-OCR detection, angle and recognition models.",
    )
    inspect: InspectModelConfig = Field(
        default_factory=InspectModelConfig,
        title="Inspection model",
        description="Vision branch: the distilled ViT student that classifies defects.",
    )
    qa: QAModelConfig = Field(
        default_factory=QAModelConfig,
        title="Q&A model",
        description="Text branch: the instruction-tuned LLM that answers questions.",
    )

    def with_cpu_threads(self, cpus: int) -> ModelsConfig:
        """The sections with every `threads: 0` of a model that runs on the CPU made a
        share of the box's `cpus`: where the text branch and the vision branch (OCR, and
        the student on the CPU) both run on the CPU, the text branch gets half the cores
        and the vision branch the rest (its models run one job at a time, so each of them
        may take the whole of that share); a branch alone on the CPU takes them all.
        Given every core, each branch's thread pool spins at its barriers while the other
        branch's threads hold the cores: on two cores the served text model decoded at
        0.60x its own rate beside the camera load (`bench/daemon.py --shipped-threads`).
        Counts the profile names are kept."""
        cpus = max(1, cpus)
        text = self.qa.enabled and self.qa.device == "cpu"
        vision = (self.ocr.enabled and self.ocr.device == "cpu") or (
            self.inspect.enabled and self.inspect.device == "cpu"
        )
        text_share = max(1, cpus // 2) if text and vision else cpus
        vision_share = max(1, cpus - text_share) if text else cpus
        updates: dict[str, StrictModel] = {}
        if text and self.qa.threads == 0:
            updates["qa"] = self.qa.model_copy(update={"threads": text_share})
        if self.ocr.device == "cpu" and self.ocr.threads == 0:
            updates["ocr"] = self.ocr.model_copy(update={"threads": vision_share})
        if self.inspect.device == "cpu" and self.inspect.threads == 0:
            updates["inspect"] = self.inspect.model_copy(update={"threads": vision_share})
        return self.model_copy(update=updates)

    def uses_cuda(self) -> bool:
        """Whether an enabled model holds GPU memory: the ViT or the LLM on CUDA, or the
        retrieval encoder on torch-cuda (which it may be where the LLM runs on the CPU)."""
        qa = self.qa
        return (self.inspect.enabled and self.inspect.device == "cuda") or (
            qa.enabled and (qa.device == "cuda" or qa.embed_backend == "torch-cuda")
        )


class Profile(StrictModel):
    device_id: str = Field(
        title="Device id",
        description="This box's name; the second topic level and the status identity.",
    )
    memory_budget_mib: int = Field(
        default=8192,
        ge=256,
        title="Memory budget",
        description="Memory the daemon may use for models and jobs, in MiB.",
    )
    memory_headroom_mib: int = Field(
        default=256,
        ge=0,
        title="Memory headroom",
        description="Part of the budget the ledger never hands out (allocator slack, the runtime itself), in MiB.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", title="Log level", description="Daemon log verbosity."
    )
    log_format: Literal["auto", "text", "json", "journal"] = Field(
        default="auto",
        title="Log format",
        description="auto: journald entries with job fields (JOB_ID, TASK, ERROR_CODE, MODEL) under systemd, "
        "plain lines elsewhere; text: plain lines; json: one JSON object per line on stderr; journal: journald.",
    )
    build_missing_engines: bool = Field(
        default=True,
        title="Build missing engines",
        description="Convert or build an engine at start when it is not in engine_dir yet.",
    )
    broker: BrokerConfig = Field(default_factory=BrokerConfig, title="Broker", description="MQTT v5 broker connection.")
    topics: TopicsConfig = Field(default_factory=TopicsConfig, title="Topics", description="Topic layout.")
    models: ModelsConfig = Field(default_factory=ModelsConfig, title="Models", description="Models per branch.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, title="Limits", description="Input size limits.")
    queue: QueueConfig = Field(default_factory=QueueConfig, title="Queues", description="Queue limits per branch.")
    journal: JournalConfig = Field(
        default_factory=JournalConfig,
        title="Journal",
        description="The on-disk job journal in state_dir: dedup window, size bound, replays.",
    )
    paths: PathsConfig = Field(default_factory=PathsConfig, title="Paths", description="Directories the daemon uses.")
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig,
        title="Watchdog",
        description="When the daemon stops vouching for itself to systemd's watchdog.",
    )
    status: StatusConfig = Field(
        default_factory=StatusConfig,
        title="Status socket",
        description="The Unix socket `edgectl status` talks to.",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        title="Tracing",
        description="OpenTelemetry spans per job and stage (docs/operations.md, Tracing).",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        title="Metrics",
        description="The Prometheus metrics endpoint (docs/operations.md, Metrics).",
    )

    http: HTTPConfig = Field(
        default_factory=HTTPConfig,
        title="HTTP API",
        description="The OpenAI-compatible HTTP API beside MQTT, on the same queue and journal (docs/http.md).",
    )

    @field_validator("device_id")
    @classmethod
    def _device_topic_level(cls, value: str) -> str:
        if not TOPIC_SEGMENT.match(value):
            raise ValueError("must be one topic level of letters, digits, '_', '.', '-'")
        return value

    @property
    def client_id(self) -> str:
        return self.broker.client_id or f"edge-{self.device_id}"

    def topic(self, *levels: str) -> str:
        return "/".join((self.topics.prefix, self.device_id, *levels))

    @property
    def jobs_filter(self) -> str:
        return self.topic("jobs", "+")

    @property
    def shared_jobs_filter(self) -> str | None:
        group = self.topics.shared_group
        if group is None:
            return None
        return f"$share/{group}/{self.topics.prefix}/jobs/+"

    @property
    def results_topic(self) -> str:
        return self.topic("results")

    @property
    def available_topic(self) -> str:
        return self.topic("available")

    @property
    def status_socket(self) -> Path:
        return self.paths.runtime_dir / "status.sock"

    @model_validator(mode="after")
    def _headroom_below_budget(self) -> Profile:
        if self.memory_headroom_mib >= self.memory_budget_mib:
            raise ValueError(
                f"memory_headroom_mib ({self.memory_headroom_mib}) must be below memory_budget_mib "
                f"({self.memory_budget_mib}): nothing would be left for models and jobs"
            )
        return self
