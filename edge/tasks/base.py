"""What a task hands back for one job: its result's `output` object (the protocol's
result schema), or a JobError instead. The branch workers' own views of a task are
declared beside them (edge/scheduler)."""

from __future__ import annotations

from typing import Any

Output = dict[str, Any]
