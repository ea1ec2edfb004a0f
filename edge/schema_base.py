"""The base every profile section derives from (kept apart from the schema so that the
backends' own sections can be declared beside them without an import cycle)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors: a typo in a profile fails at start with the field's path
    instead of being silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
