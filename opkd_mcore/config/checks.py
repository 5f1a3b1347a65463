"""Primitive config checks: each raises `ConfigError` whose message starts with the key path."""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import string
import urllib.parse
from typing import NoReturn

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


def format_fields(template: str) -> list[str]:
    """The field names of a `str.format` template over a record's fields, in order; ValueError saying
    what is not a plain `{name}` field (positional `{}` / `{0}`, attribute or index access, nested
    format specs) or that the braces do not parse."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:  # a lone "{" or "}"
        raise ValueError(f"not a str.format template ({err}; write {{{{ and }}}} for literal braces)") \
            from None
    names = []
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"field {{{name}}}: expected a record field by name, like {{solution}}")
        if spec and "{" in spec:
            raise ValueError(f"field {{{name}:{spec}}}: nested fields in a format spec are not supported")
        names.append(name)
    return names


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


# a host name or IPv4 address (an IPv6 address comes in brackets and is checked by `ipaddress`)
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def check_url(path: str, url: str | None) -> None:
    """A teacher server's base URL exactly as `teacher/remote.py` uses it: `http(s)://host[:port]`,
    optionally with the path prefix of a reverse proxy; the client appends `/v1/...` and `/pooling`
    to it, so a URL ending in `/v1`, a query, a fragment or credentials would address nothing."""
    def refuse(why: str) -> NoReturn:
        raise ConfigError(f"{path}: {why}; a remote teacher needs the server's base URL "
                          f"(http://host:port, port 1-65535), got {url!r}")

    if not url or not isinstance(url, str):
        refuse("no URL")
    if any(c.isspace() or not c.isprintable() for c in url):
        refuse("the URL contains spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as err:  # e.g. an unclosed IPv6 bracket
        refuse(f"not a URL ({err})")
    if parts.scheme not in ("http", "https"):
        refuse(f"expected the scheme http or https, got {parts.scheme or 'none'!r}")
    if "@" in parts.netloc:
        refuse("credentials in the URL are not sent to the server")
    host, port = _host_and_port(parts.netloc, refuse)
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        refuse(f"the port {port!r} of host {host!r} is not a number in 1-65535")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        refuse("a query or fragment would be sent before the request path")
    if parts.path.rstrip("/").endswith("/v1"):
        refuse("the client adds /v1/... itself: give the URL without /v1")


def _host_and_port(netloc: str, refuse) -> tuple[str, str | None]:
    """(host, port text or None) of `host`, `host:port`, `[ipv6]` or `[ipv6]:port`."""
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            refuse(f"{host!r} in brackets is not an IPv6 address")
        if rest and not rest.startswith(":"):
            refuse(f"unexpected {rest!r} after the IPv6 address")
        return host, rest[1:] if rest else None
    host, colon, port = netloc.partition(":")
    if not _HOST.fullmatch(host):
        refuse(f"expected a host name or IP address, got {host!r}" if host else "the URL names no host")
    return host, port if colon else None
