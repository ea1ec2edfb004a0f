"""Profile schema and loading."""

from edge.config.loader import ProfileError, load_profile, parse_profile
from edge.config.schema import Profile

__all__ = ["Profile", "ProfileError", "load_profile", "parse_profile"]
