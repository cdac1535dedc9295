"""A bench's tables as plain data: what ``tidal bench NAME`` prints and what ``docs/results.md``
shows are the same :class:`ResultTable` values, made from the same JSON by the bench's own
``tables`` function ([Note: one table per result] below).

[Note: one table per result]
Every bench writes its figures as JSON and then builds its tables from that JSON alone (its
``tables(result, args)``, where ``args`` are the bench's parsed options). ``tidal bench report``
calls the same function on the stored file, so the page cannot show a figure the bench would not
print, and there is no second formatter to drift from the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is the CLI's: the benchmarks package imports without it
    from rich.console import Console

__all__ = ["ResultTable", "markdown", "show"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResultTable:
    """One table of a bench's result: a title, column headers and rows of cells (text)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left_columns: int = 1  # the first columns hold names; the rest figures, right-aligned
    note: str | None = None  # printed under the table

    def __post_init__(self) -> None:
        for row in self.rows:
            assert len(row) == len(self.columns), (self.title, self.columns, row)

    @classmethod
    def of(
        cls,
        title: str,
        columns: Sequence[str],
        rows: Iterable[Sequence[str]],
        *,
        left_columns: int = 1,
        note: str | None = None,
    ) -> ResultTable:
        return cls(
            title=title,
            columns=tuple(columns),
            rows=tuple(tuple(row) for row in rows),
            left_columns=left_columns,
            note=note,
        )


def show(console: Console, tables: Iterable[ResultTable]) -> None:
    """Print each table with rich (cells are text, never markup: an error may hold brackets)."""
    from rich.table import Table
    from rich.text import Text

    for table in tables:
        view = Table(title=table.title, title_justify="left", caption=table.note)
        for i, column in enumerate(table.columns):
            view.add_column(column, justify="left" if i < table.left_columns else "right")
        for row in table.rows:
            view.add_row(*(Text(cell) for cell in row))
        console.print(view)


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") or " "


def markdown(table: ResultTable) -> str:
    """The table as GitHub markdown: a bold title line, the table, its note."""
    aligns = ["---" if i < table.left_columns else "---:" for i in range(len(table.columns))]
    lines = [
        f"**{table.title}**",
        "",
        "| " + " | ".join(_cell(c) for c in table.columns) + " |",
        "|" + "|".join(aligns) + "|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows),
    ]
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines) + "\n"
