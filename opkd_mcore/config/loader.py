"""YAML + dotted overrides -> typed `TrainConfig`, with the key path in every error.

    cfg = load_config("configs/qwen3_8b_from_32b.yaml", ["loss.divergence=jsd", "loss.beta=0.3"])

Overrides are `path=value`; the value is parsed as YAML (`3`, `0.3`, `null`, `[a, b]`, `true`).
A path names an existing key (no Hydra-style `+key`); list items are addressed by index
(`teacher.teachers.0.model=/ckpt`). Unknown keys and wrong types raise `ConfigError`.

Numbers: a float field takes any decimal a user writes, `1e-5`, `5E-6`, `1.5e3`, `.5`, `-2e-3`, in a
file and in an override alike (YAML 1.1, which PyYAML reads, needs a dot in a float, so `1e-5`
arrives as the string "1e-5"; it is converted here, for float fields only). NaN and infinity are
refused. An integer field takes integers only: `steps: 1e3` is refused with the integer to write
instead, since scientific notation names a float and a silent conversion would hide `2.5e1`.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

import yaml

from opkd_mcore.config.errors import ConfigError
from opkd_mcore.config.schema import TrainConfig
from opkd_mcore.config.validate import validate_config

# Keys no config may set, with why: intents of one command line, which a saved config would carry
# into every later run that reads it.
COMMAND_LINE_ONLY = {
    "run.overwrite": "overwriting is asked for on the command line with --overwrite, never in a config file",
}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _finite(value: int | float, path: str) -> float:
    """`value` as a finite float. YAML reads `.nan` / `.inf` as floats, and every range check
    downstream would let NaN through (comparisons with NaN are false); no field means infinity."""
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise ConfigError(f"{path}: expected a finite number, got an integer beyond the float "
                          "range") from None
    if not math.isfinite(number):
        raise ConfigError(f"{path}: expected a finite number (not nan or inf), got {number}")
    return number


# a decimal number as written in a config (no nan/inf, no hex, no underscores)
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _float(value: Any, path: str) -> float:
    """A float field's value: a YAML number, or a string that is a decimal number (`1e-5`)."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return _finite(float(value), path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
    return _finite(value, path)


def _int(value: Any, path: str) -> int:
    """An integer field's value: a YAML integer only (`1e3` and `1000.0` are refused, with a hint)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    hint = ""
    if isinstance(value, (str, float)):
        try:
            number = _float(value, path)
        except ConfigError:  # not a number at all: no integer to suggest
            number = None
        if number is not None and number.is_integer():
            hint = f" (write it as the integer {int(number)})"
    raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}{hint}")


def _convert(value: Any, tp, path: str):
    """Check/convert one YAML value against a schema annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: expected {tp}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        _, val_tp = typing.get_args(tp)
        return {str(k): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is float:
        return _float(value, path)
    if tp is int:
        return _int(value, path)
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported schema type {tp!r}")


def from_dict(cls, data: Any, path: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise `ConfigError`."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in hints or key not in names:
            raise ConfigError(f"{key_path}: unknown key (known keys of {where}: {', '.join(names)})")
        kwargs[key] = _convert(value, hints[key], key_path)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (YAML-safe)."""
    return dataclasses.asdict(cfg)


def _set_path(tree: dict, path: str, value: Any, defaults: dict) -> None:
    """Set `a.b.0.c` in a nested dict/list tree; every step must exist in the schema defaults."""
    parts = path.split(".")
    node, ref = tree, defaults
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{here}: list index out of range (the list has {len(node)} items)")
            idx = int(part)
            if last:
                node[idx] = value
                return
            ref = ref[idx] if isinstance(ref, list) and idx < len(ref) else ref[0] if ref else {}
            node = node[idx]
            continue
        if not isinstance(node, dict) or not isinstance(ref, dict) or part not in ref:
            known = ", ".join(ref) if isinstance(ref, dict) else "none (not a section)"
            raise ConfigError(f"{here}: unknown key in override {path}= (known here: {known})")
        if last:
            node[part] = value
            return
        node.setdefault(part, _copy(ref[part]))
        if node[part] is None:
            node[part] = _copy(ref[part])
        node, ref = node[part], ref[part]


def _copy(x):
    return yaml.safe_load(yaml.safe_dump(x))


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply `key.path=value` strings to a nested dict (validated against the schema)."""
    defaults = to_dict(TrainConfig())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        path, raw = item.split("=", 1)
        path = path.strip()
        if path.startswith("+"):
            raise ConfigError(f"{path}: '+key' overrides are not supported; name an existing key")
        if path in COMMAND_LINE_ONLY:
            raise ConfigError(f"{path}: {COMMAND_LINE_ONLY[path]}")
        _set_path(tree, path, yaml.safe_load(raw) if raw.strip() else "", defaults)
    return tree


def load_config(path: str | None = None, overrides: list[str] | None = None, *,
                validate: bool = True, check_files: bool = True) -> TrainConfig:
    """Read a YAML file (or the defaults), apply overrides, type-check and validate."""
    tree: dict = {}
    if path is not None:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        _refuse_command_line_keys(tree, path)
    tree = apply_overrides(tree, list(overrides or []))
    cfg = from_dict(TrainConfig, tree)
    if validate:
        validate_config(cfg, check_files=check_files)
    return cfg


def _refuse_command_line_keys(tree: dict, file: str) -> None:
    for key, why in COMMAND_LINE_ONLY.items():
        section, name = key.split(".")
        if isinstance(tree.get(section), dict) and name in tree[section]:
            raise ConfigError(f"{key}: {why} (remove it from {file})")


def dump_config(cfg, path: str | None = None) -> str:
    """The resolved config as YAML text; written to `path` when given."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text
