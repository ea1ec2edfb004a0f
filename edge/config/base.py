"""What every profile section shares: the strict base model and the few types and
constants that more than one section uses.

It imports nothing else from edge, so that any section (the backends' own in
edge/config/backends.py, the text branch's in edge/config/text.py) can be read without
the rest of the profile.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors: a typo in a profile fails at start with the field's path
    instead of being silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# One MQTT topic level: the topic prefix, a shared-subscription group, the device id.
TOPIC_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]+$")

Device = Literal["cpu", "cuda"]
