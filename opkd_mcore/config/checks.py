"""Primitive config checks: each raises `ConfigError` whose message starts with the key path."""
from __future__ import annotations

import dataclasses
import math
import urllib.parse

from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.schema import SEED_MAX


def choice(path: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{path}: expected one of {list(options)}, got {value!r}")


def positive(path: str, value, *, allow_zero: bool = False) -> None:
    # written so that NaN fails too: a config built in Python never went through the loader
    if not (value > 0 or (allow_zero and value == 0)):
        raise ConfigError(f"{path}: expected {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def in_range(path: str, value, low, high, *, low_open: bool = False) -> None:
    """`low <= value <= high` (`low < value` when `low_open`); NaN fails."""
    if not ((value > low if low_open else value >= low) and value <= high):
        raise ConfigError(f"{path}: expected a value in {'(' if low_open else '['}{low}, {high}], "
                          f"got {value!r}")


def seed_in_range(path: str, value: int) -> None:
    in_range(path, value, 0, SEED_MAX)


def non_empty(path: str, value: str | None) -> None:
    if not value or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")


def check_finite(value, path: str) -> None:
    """Every float in the config is finite (the loader checks YAML input; this covers configs
    built in Python). No field gives infinity a meaning, and NaN slips through range checks."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            check_finite(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(item, f"{path}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{path}.{key}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number (not nan or inf), got {value}")


def check_url(path: str, url: str | None) -> None:
    try:
        parts = urllib.parse.urlsplit(url or "")
    except ValueError:  # e.g. an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{path}: a remote teacher needs the server's base URL "
                          f"(http://host:port), got {url!r}")
