"""A small typed-settings schema: each dataclass field carries its doc,
allowed values or range in `metadata`; `build_section` turns a TOML table
into the frozen dataclass and names the field and the allowed values in
every error. The same metadata renders the example config and the README
table, so the docs cannot drift from the code."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from models.errors import CosyEdgeError

T = TypeVar("T")


class ConfigError(CosyEdgeError):
    """The configuration file or a flag has an invalid value."""


def setting(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,  # noqa: A002 - reads naturally at the call site
    max: float | None = None,  # noqa: A002
    live: bool = False,
) -> Any:
    """A dataclass field with documentation. `live`: SIGHUP applies a change
    without a restart."""
    meta = {"doc": doc, "choices": tuple(choices) if choices else None, "min": min, "max": max, "live": live}
    if isinstance(default, list | dict):
        raise TypeError("use tuples for sequence defaults (the settings are frozen)")
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(
        tp, "a list of strings"
    )


def _is_int_or_choice(tp: Any) -> bool:
    """`int | str` fields: an integer in min..max, or one of the string choices (e.g. "auto")."""
    return isinstance(tp, types.UnionType) and set(typing.get_args(tp)) == {int, str}


def _allowed(meta: Mapping[str, Any]) -> str:
    """The allowed values of an `int | str` field, for messages and the docs."""
    words = " or ".join(_toml(c) for c in meta.get("choices") or ())
    return f"{words} or an integer {meta.get('min')} .. {meta.get('max')}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _check_value(section: str, f: dataclasses.Field[Any], tp: Any, value: Any) -> Any:
    where = f"[{section}] {f.name}" if section else f.name
    meta = f.metadata
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if _is_int_or_choice(tp):
        lo, hi = meta["min"], meta["max"]
        ok_int = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        if not ok_int and not (isinstance(value, str) and value in (meta.get("choices") or ())):
            raise ConfigError(f"{where} = {_toml_any(value)}: allowed values: {_allowed(meta)}")
        return value
    if tp is tuple[str, ...] or typing.get_origin(tp) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {_toml_any(value)}")
        value = tuple(value)
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_toml_any(value)}")
    choices = meta.get("choices")
    if choices and value not in choices:
        allowed = ", ".join(_toml(c) for c in choices)
        raise ConfigError(f"{where} = {_toml(value)}: allowed values: {allowed}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{where} = {_toml(value)}: must be between {lo} and {hi}")
    return value


def _toml_any(value: Any) -> str:
    try:
        return _toml(value) if isinstance(value, str | bool | int | float) else json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def build_section(cls: type[T], table: Mapping[str, Any], section: str) -> T:
    """The dataclass `cls` from a TOML table; unknown keys are errors."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{section}] must be a table, got {_toml_any(table)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(
            f"[{section}] unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"known keys: {', '.join(fields)}"
        )
    values = {name: _check_value(section, fields[name], hints[name], v) for name, v in table.items()}
    return cls(**values)


def replace_checked(obj: T, section: str, **changes: Any) -> T:
    """dataclasses.replace with the same validation as the file."""
    fields = {f.name: f for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(type(obj))
    checked = {k: _check_value(section, fields[k], hints[k], v) for k, v in changes.items()}
    return dataclasses.replace(obj, **checked)  # type: ignore[type-var]


def describe(cls: type[Any]) -> list[tuple[str, Any, str, str]]:
    """(key, default as TOML, doc, constraint) for every field."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        constraint = ""
        if _is_int_or_choice(hints[f.name]):
            constraint = _allowed(meta)
        elif meta.get("choices"):
            constraint = "one of " + ", ".join(_toml(c) for c in meta["choices"])
        elif meta.get("min") is not None or meta.get("max") is not None:
            constraint = f"{meta.get('min')} .. {meta.get('max')}"
        if meta.get("live"):
            constraint = (constraint + "; " if constraint else "") + "reloaded by SIGHUP"
        rows.append((f.name, _toml(f.default), str(meta.get("doc", "")), constraint))
    return rows
