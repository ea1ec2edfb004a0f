"""Read a YAML profile into a validated `Profile`, with errors that name the field."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from edge.config.profile import Profile

logger = logging.getLogger(__name__)


class ProfileError(Exception):
    """A profile that cannot be used; the message lists each bad field's path."""


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "<profile>"


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for issue in err.errors():
        path = _field_path(tuple(issue["loc"]))
        lines.append(f"{path}: {issue['msg']}")
    return "\n".join(lines)


def parse_profile(data: Any, source: str = "<profile>") -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: the profile must be a YAML mapping")
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(f"{source}: invalid profile\n{format_validation_error(err)}") from err


def load_profile(path: Path) -> Profile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ProfileError(f"{path}: cannot read profile: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ProfileError(
            f"{path}: not UTF-8 text (a byte 0x{err.object[err.start]:02x} at offset {err.start})"
        ) from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ProfileError(f"{path}: not valid YAML: {err}") from err
    profile = parse_profile(data, str(path))
    logger.debug("loaded profile %s for device %s", path, profile.device_id)
    return profile
