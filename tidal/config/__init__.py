"""Typed configuration machinery shared by every component (see configurable.py)."""

from tidal.config.configurable import (
    ByteSize,
    ConfigError,
    apply_overrides,
    format_bytes,
    from_dict,
    load_toml,
    parse_bytes,
    require,
    to_dict,
)

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
