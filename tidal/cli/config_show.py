"""``tidal config show``: the resolved config as a recipe (TOML) with each key's doc line, read
from the config classes' own ``Attributes:`` docstrings, so the two cannot drift apart."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from typing import Any

__all__ = ["attribute_docs", "render"]

_ENTRY = re.compile(r"^    ([A-Za-z_][\w, ]*):\s*(.*)$")


def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's first sentence from ``cls``'s ``Attributes:`` section (``a, b: ...`` too)."""
    doc = inspect.getdoc(cls) or ""
    _, found, section = doc.partition("Attributes:\n")
    if not found:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in section.splitlines():
        if line and not line.startswith(" "):
            break  # the section ended
        match = _ENTRY.match(line)
        if match:
            names = [n.strip() for n in match.group(1).split(",")]
            for name in names:
                docs[name] = match.group(2)
        elif line.startswith("        ") and names:
            for name in names:
                docs[name] += " " + line.strip()
    return {name: _first_sentence(text) for name, text in docs.items()}


def _first_sentence(text: str) -> str:
    text = text.replace("``", "")
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _line(name: str, value: Any, doc: str) -> str:
    setting = f"# {name} = (unset)" if value is None else f"{name} = {_toml(value)}"
    return f"{setting:<40} # {doc}" if doc else setting


def render(config: Any) -> str:
    """``config`` (a JobConfig) as TOML, a comment with each key's doc line."""
    docs = attribute_docs(type(config))
    top, sections = [], []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            section_docs = attribute_docs(type(value))
            lines = [f"[{field.name}]"]
            for inner in dataclasses.fields(value):
                inner_value = getattr(value, inner.name)
                if dataclasses.is_dataclass(inner_value):
                    inner_value = dataclasses.asdict(inner_value)  # type: ignore[arg-type]
                lines.append(_line(inner.name, inner_value, section_docs.get(inner.name, "")))
            sections.append("\n".join(lines))
        else:
            top.append(_line(field.name, value, docs.get(field.name, "")))
    return "\n\n".join(["\n".join(top), *sections]) + "\n"
