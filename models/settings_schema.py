"""The one typed-settings schema of cosyedge (daemon, audio/VAD and the cloud
bridge): each dataclass field carries its doc, allowed values or range, an
optional check hook and its live-reload flag in `metadata`; `build_section`
turns a TOML table into the frozen dataclass and names the field and the
allowed values in every error. The same metadata renders the example configs
and the configuration reference, so the docs cannot drift from the code.

Supported field types: str, int, float, bool, tuple[str, ...], `X | None`
(None: unset, e.g. "the device's default"; TOML has no null, so only a
missing key means None) and `str | int` (e.g. a device name or index, or
"auto" or a number). Imports only the standard library and cosyedge_models.errors
(both sides of the wire use it)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from cosyedge_models.errors import CosyEdgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

T = TypeVar("T")

Check = Callable[[Any], bool]
"""A custom validator: True when the value (already of the right type) is allowed."""


class ConfigError(CosyEdgeError, ValueError):
    """The configuration file or a flag has an invalid value."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file as a TOML document: the one loader of the daemon's, the
    bridge's and `cosyedge vad`'s files; ConfigError naming the file and what is wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")  # TOML is UTF-8 only
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the config file {p}: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


def setting(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,  # noqa: A002 - reads naturally at the call site
    max: float | None = None,  # noqa: A002
    live: bool = False,
    reload: bool = False,
    check: Check | None = None,
    allowed: str = "",
    aliases: Sequence[str] = (),
) -> Any:
    """A dataclass field with documentation. `live`: SIGHUP applies a change
    without a restart; `reload`: SIGHUP applies it by reloading the engine.
    `check` (with `allowed`, the words for the docs and the message): a rule
    the range and choices cannot say. `aliases`: old key names still read."""
    if check is not None and not allowed:
        raise TypeError("a setting with a check needs `allowed` (what the message and the docs say)")
    meta = {
        "doc": doc, "choices": tuple(choices) if choices else None, "min": min, "max": max,
        "live": live, "reload": reload, "check": check, "allowed": allowed, "aliases": tuple(aliases),
    }
    if isinstance(default, list | dict):
        raise TypeError("use tuples for sequence defaults (the settings are frozen)")
    return dataclasses.field(default=default, metadata=meta)


def live_fields(cls: type[Any]) -> tuple[str, ...]:
    """The fields of a section that SIGHUP applies without a restart (`live`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("live"))


def reload_fields(cls: type[Any]) -> tuple[str, ...]:
    """The fields of a section that SIGHUP applies by reloading the engine (`reload`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("reload"))


def _members(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _type_name(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    words = [names.get(m, "a list of strings") for m in _members(tp) if m is not type(None)]
    return " or ".join(words)


def _is_int_or_choice(tp: Any, meta: Mapping[str, Any]) -> bool:
    """`int | str` fields with string choices: an integer in min..max, or one of the choices ("auto")."""
    return set(_members(tp)) == {int, str} and bool(meta.get("choices"))


def _range(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f">= {_toml(lo)}"
    if lo is None:
        return f"<= {_toml(hi)}"
    return f"{_toml(lo)} .. {_toml(hi)}"


def _allowed(tp: Any, meta: Mapping[str, Any]) -> str:
    """The allowed values of a field in words, for messages and the docs."""
    if meta.get("allowed"):
        return str(meta["allowed"])
    if _is_int_or_choice(tp, meta):
        words = " or ".join(_toml(c) for c in meta.get("choices") or ())
        return f"{words} or an integer {_range(meta)}"
    if meta.get("choices"):
        return ", ".join(_toml(c) for c in meta["choices"])
    text = _range(meta)
    if text and type(None) in _members(tp):
        text += " or unset"
    return text


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _toml_any(value: Any) -> str:
    try:
        return _toml(value) if isinstance(value, str | bool | int | float) else json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _typed(tp: Any, value: Any) -> tuple[bool, Any]:
    """(matches, value converted): bool is never a number; an int is a float."""
    for m in _members(tp):
        if m is type(None) and value is None:
            return True, None
        if m is bool and isinstance(value, bool):
            return True, value
        if isinstance(value, bool):
            continue
        if m is int and isinstance(value, int):
            return True, value
        if m is float and isinstance(value, int | float):
            return True, float(value)
        if m is str and isinstance(value, str):
            return True, value
        if (typing.get_origin(m) is tuple and isinstance(value, list | tuple)
                and all(isinstance(v, str) for v in value)):
            return True, tuple(value)
    return False, value


def check_value(section: str, f: dataclasses.Field[Any], tp: Any, value: Any) -> Any:
    """The value checked against the field's type, choices, range and check hook;
    returns it converted (int → float, list → tuple)."""
    where = f"[{section}] {f.name}" if section else f.name
    meta = f.metadata
    ok, value = _typed(tp, value)
    if not ok:
        if _is_int_or_choice(tp, meta):
            raise ConfigError(f"{where} = {_toml_any(value)}: allowed values: {_allowed(tp, meta)}")
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_toml_any(value)}")
    if value is None:
        return value
    choices: tuple[Any, ...] = meta.get("choices") or ()
    lo, hi = meta.get("min"), meta.get("max")
    if _is_int_or_choice(tp, meta):
        good = value in choices if isinstance(value, str) else (lo is None or lo <= value) and (
            hi is None or value <= hi)
    elif choices:
        good = value in choices
    elif isinstance(value, int | float) and not isinstance(value, bool):
        good = (lo is None or value >= lo) and (hi is None or value <= hi)
        if not good and not meta.get("allowed"):
            raise ConfigError(f"{where} = {_toml(value)}: must be {_range_words(meta)}")
    else:
        good = True
    if good and meta.get("check") is not None:
        good = bool(meta["check"](value))
    if not good:
        raise ConfigError(f"{where} = {_toml_any(value)}: allowed values: {_allowed(tp, meta)}")
    return value


def _range_words(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if hi is None:
        return f">= {_toml(lo)}"
    if lo is None:
        return f"<= {_toml(hi)}"
    return f"between {_toml(lo)} and {_toml(hi)}"


def check_fields(obj: Any, section: str) -> None:
    """Validate every field of a settings instance (for `__post_init__`, so that a
    section built in code or with dataclasses.replace is checked like the file)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(section, f, hints[f.name], value)
        if type(checked) is not type(value):  # int given for a float, list for a tuple
            object.__setattr__(obj, f.name, checked)


def build_section(cls: type[T], table: Mapping[str, Any], section: str) -> T:
    """The dataclass `cls` from a TOML table; unknown keys are errors."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{section}] must be a table, got {_toml_any(table)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    aliases = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(table) - set(fields) - set(aliases))
    if unknown:
        raise ConfigError(
            f"[{section}] unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"known keys: {', '.join(fields)}"
        )
    values: dict[str, Any] = {}
    for key, v in table.items():
        name = aliases.get(key, key)
        if name != key and name in table:
            raise ConfigError(f"[{section}] {key} is the old name of {name}; give only {name}")
        values[name] = check_value(section, fields[name], hints[name], v)
    return cls(**values)


def replace_checked(obj: T, section: str, **changes: Any) -> T:
    """dataclasses.replace with the same validation as the file."""
    fields = {f.name: f for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(type(obj))
    checked = {k: check_value(section, fields[k], hints[k], v) for k, v in changes.items()}
    return dataclasses.replace(obj, **checked)  # type: ignore[type-var]


def describe(cls: type[Any]) -> list[tuple[str, Any, str, str]]:
    """(key, default as TOML, doc, constraint) for every field; an unset
    (None) default is reported as "" (the key is then left out of a file)."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        constraint = _allowed(hints[f.name], meta)
        if meta.get("choices") and not _is_int_or_choice(hints[f.name], meta) and not meta.get("allowed"):
            constraint = "one of " + constraint
        if meta.get("live"):
            constraint = (constraint + "; " if constraint else "") + "reloaded by SIGHUP"
        if meta.get("reload"):
            constraint = (constraint + "; " if constraint else "") + "SIGHUP reloads the engine"
        default = "" if f.default is None else _toml(f.default)
        rows.append((f.name, default, str(meta.get("doc", "")), constraint))
    return rows


def example_lines(section: str, cls: type[Any], commented: Collection[str] = ()) -> list[str]:
    """One section of an example config: every key at its default, with its doc
    as a comment; an unset default and the `commented` keys are commented out."""
    lines = [f"[{section}]"]
    for key, default, doc, constraint in describe(cls):
        lines.append(f"# {doc}" + (f" ({constraint})" if constraint else ""))
        if not default:
            lines.append(f"# {key} = (unset)")
        else:
            lines.append(f"# {key} = {default}" if key in commented else f"{key} = {default}")
    return lines


def reference_table(section: str, cls: type[Any]) -> list[str]:
    """A Markdown table of one section, for docs/configuration.md."""
    lines = [f"### `[{section}]`", "", "| key | default | meaning | allowed |", "|---|---|---|---|"]
    for key, default, doc, constraint in describe(cls):
        cell = f"`{default}`" if default else "unset"
        doc_cell, allowed_cell = (t.replace("|", r"\|").replace("<", "&lt;") for t in (doc, constraint))
        lines.append(f"| `{key}` | {cell} | {doc_cell} | {allowed_cell} |")
    return lines + [""]
