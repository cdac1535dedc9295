"""Typed configs: kw-only dataclasses built from plain dicts (TOML, ``--set`` overrides).

Every component owns a ``@dataclass(kw_only=True, slots=True)`` config and validates it in
``__post_init__`` by raising :class:`ConfigError` with the field's own name. :func:`from_dict`
walks a nested dict into the dataclass tree, coerces values by the annotated type, and prefixes
each error with the dotted path, so a user reads ``training.steps: must be >= 1, got -3``.

[Note: value coercion]
Values reach a config from two places: TOML, where they are already typed, and ``--set k=v``,
where they are strings. One coercion function accepts both: a string is parsed into the field's
type (``"50"`` -> 50 for an ``int``), a typed value must already match (``bool`` is never an
``int``). Fields typed :data:`ByteSize` are sizes and also take ``"512MiB"``/``"2GB"``.
``"none"`` clears an optional field from the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = [
    "ByteSize",
    "ConfigError",
    "apply_overrides",
    "format_bytes",
    "from_dict",
    "load_toml",
    "parse_bytes",
    "require",
    "to_dict",
]

T = TypeVar("T")


class _SizeMarker:
    def __repr__(self) -> str:
        return "size"


_SIZE = _SizeMarker()

ByteSize = Annotated[int, _SIZE]
"""A number of bytes: config files and ``--set`` may write it as ``"512MiB"`` or ``"2GB"``."""


class ConfigError(ValueError):
    """A configuration value is wrong. ``key`` is the dotted path of the offending field."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # Rebuild from (key, message): the default would call __init__ with the formatted text
        # alone, so an error raised in a worker process could not reach its parent.
        return (ConfigError, (self.key, self.message))

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix`` put in front of the key (``steps`` -> ``training.steps``)."""
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


class _OutOfRange(ConfigError):
    """A value of the field's form outside what it allows: of a union of types, the error to
    show alone (a negative size is not "or not one of 'auto'")."""


def require(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(key, message)`` unless ``condition`` holds; for ``__post_init__``."""
    if not condition:
        raise ConfigError(key, message)


# ---------------------------------------------------------------------------------------------
# sizes

_UNIT_BYTES = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, key: str = "") -> int:
    """``"512MiB"`` -> 536870912, ``"2GB"`` -> 2000000000, ``1024`` -> 1024. Never negative."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size such as '512MiB' or '2GB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if not match or match.group(2).lower() not in _UNIT_BYTES:
            raise ConfigError(
                key,
                f"expected a size such as '512MiB' or '2GB' (units: B, KB, MB, GB, TB, KiB, "
                f"MiB, GiB, TiB), got {value!r}",
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise _OutOfRange(key, f"a size cannot be negative, got {value!r}")
    return int(number * _UNIT_BYTES[unit])


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50KiB'; binary units, as memory tools print them."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f}B" if unit == "B" else f"{value:.2f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# dict -> dataclass


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, path: str = "") -> T:
    """Build the config dataclass ``cls`` from ``data``; raise ConfigError naming the dotted key."""
    assert dataclasses.is_dataclass(cls), cls
    data = dict(data or {})
    hints = get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else key
        if key not in fields:
            raise ConfigError(dotted, _unknown_key_message(key, fields))
        kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(path) from None


def _unknown_key_message(key: str, fields: Mapping[str, Any]) -> str:
    allowed = sorted(fields)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown key (allowed: {', '.join(allowed)}){hint}"


def _type_name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _either(messages: list[str], value: Any) -> str:
    """The errors of every type of a union as one sentence: what each expects, the value once."""
    got = f", got {value!r}"
    if not all(m.startswith("expected ") and m.endswith(got) for m in messages):
        return " or ".join(messages)
    return "expected " + ", or ".join(m[len("expected ") : -len(got)] for m in messages) + got


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    """See [Note: value coercion]."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        if _SIZE in extras:
            return parse_bytes(value, key=dotted)
        return _coerce(value, base, dotted)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        clears = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if clears and type(None) in get_args(tp):
            return None
        errors = []
        for option in options:
            try:
                return _coerce(value, option, dotted)
            except _OutOfRange:
                raise
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError(dotted, _either(errors, value))
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(dotted, f"expected one of {choices}, got {value!r}")
        return value
    if origin in (tuple, list):
        return _coerce_sequence(value, tp, dotted)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(dotted, f"expected a table of settings, got {value!r}")
        return from_dict(tp, value, path=dotted)
    return _coerce_scalar(value, tp, dotted)


def _coerce_scalar(value: Any, tp: Any, dotted: str) -> Any:
    wrong = ConfigError(dotted, f"expected {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise wrong
    if tp is int:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?[0-9_]+\s*", value):
            return int(value)
        raise wrong
    if tp is float:
        if isinstance(value, bool):
            raise wrong
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise wrong from None
        raise wrong
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong
    if tp is Any:
        return value
    raise AssertionError(f"config field type {tp!r} is not supported by from_dict")


def _coerce_sequence(value: Any, tp: Any, dotted: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.strip("[]()").split(",")) if v]
    if not isinstance(value, Sequence):
        raise ConfigError(dotted, f"expected a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(dotted, f"expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, dotted) for v, a in zip(value, args, strict=True))
    item_tp = args[0] if args else Any
    items = [_coerce(v, item_tp, dotted) for v in value]
    return tuple(items) if origin is tuple else items


# ---------------------------------------------------------------------------------------------
# dataclass -> dict, TOML, overrides


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config tree (tuples become lists)."""
    assert dataclasses.is_dataclass(config), config
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[field.name] = value
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a syntax error becomes a ConfigError naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("", f"{path}: not valid TOML: {err}") from None


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``["training.steps=50", ...]`` to a nested dict; values stay strings (see the Note)."""
    result = _deep_copy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError("", f"--set {item!r}: expected KEY=VALUE, e.g. training.steps=50")
        node = result
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a table of settings")
            node = child
        node[parts[-1]] = value.strip()
    return result


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def fields_of(cls: type) -> typing.Iterator[tuple[str, Any]]:
    """(name, type) of each init field of a config class; for help texts and listings."""
    hints = get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        if field.init:
            yield field.name, hints[field.name]
