"""The error a configuration value raises when it is missing or unsupported, and the integer check
the config parsers share."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing or unsupported; the message names the field and the source."""


def positive_int(value, name: str, source: str, least: int = 1):
    """`value` when it is an integer of at least `least`; else ConfigError naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ConfigError(f"{source}: {name} must be {kind}, got {value!r}")
    return value
