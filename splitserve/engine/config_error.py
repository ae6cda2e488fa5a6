"""The error a configuration value raises when it is missing or unsupported, and the number checks
the config parsers share."""
from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration value is missing or unsupported; the message names the field and the source."""


def positive_int(value, name: str, source: str, least: int = 1):
    """`value` when it is an integer of at least `least`; else ConfigError naming the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ConfigError(f"{source}: {name} must be {kind}, got {value!r}")
    return value


def positive_number(cfg: dict, name: str, default: float | None, source: str) -> float | None:
    """cfg[name] as a float when it is a positive finite number, None when null, `default` when absent."""
    value = cfg.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ConfigError(f"{source}: {name} must be a positive number or null, got {value!r}")
    return None if value is None else float(value)


def positive_float(cfg: dict, name: str, default: float, source: str) -> float:
    """A positive number, or absent (`default`); null is refused."""
    value = positive_number(cfg, name, default, source)
    if value is None:
        raise ConfigError(f"{source}: {name} must be a positive number, got None")
    return value
