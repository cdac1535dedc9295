"""The compatibility table of ``tidal bench compat``: one line per model family, one column per
mode, made from a ``compat-*.json`` file alone ([Note: one table per result] in
benchmarks/tables.py), so the terminal and docs/results.md show the same cells."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.tables import ResultTable

__all__ = ["COLUMNS", "load_results", "tables"]

# (column, mode) in table order; rank modes are found by prefix, whatever N the run used.
COLUMNS = (
    ("fp32 unlimited", "fp32-unlimited"),
    ("fp32 tight", "fp32-tight"),
    ("bf16 tight", "bf16-tight"),
    ("accumulation 2, tight", "accum2-tight"),
    ("ranks, unlimited", "-unlimited"),
    ("ranks, tight", "-tight"),
)


def load_results(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if data.get("bench") != "compat":
        raise ValueError(f"{path} is a {data.get('bench')!r} result, not a compat one")
    return data


def _rank_mode(row: dict[str, Any], suffix: str) -> bool:
    return row["ranks"] > 1 and row["mode"].endswith(suffix)


def _find(rows: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    for row in rows:
        if row["mode"] == mode or (mode.startswith("-") and _rank_mode(row, mode)):
            return row
    return None


def _diff(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def _cell(row: dict[str, Any] | None, notes: list[str]) -> str:
    if row is None:
        return "-"
    result = row["result"]
    if result.startswith("error") or result == "skipped":
        reason = row.get("reason") or result.removeprefix("error: ")
        if reason not in notes:  # one footnote per distinct cause
            notes.append(reason)
        word = "error" if result.startswith("error") else "skipped"
        return f"{word} [{notes.index(reason) + 1}]"
    word = result
    diff = row["max_rel_loss_diff"]
    text = f"{word} {'-' if diff is None else _diff(diff)}"
    if row["precision"] != "fp32":
        text += f" {'≤' if result == 'match' else '>'} {row['tolerance']:.1e}"
    if row.get("budget_bytes") is not None:
        text += f" @ {row['budget_bytes'] / 1024:.0f}KiB"
    if row.get("same_as_unlimited") is False:
        text += " †"
    return text


def _one_line(text: str) -> str:
    return text.replace("\n", " ")


def tables(result: dict[str, Any], args: object = None) -> list[ResultTable]:
    """The table (one line per family, in the file's order); its footnotes below it."""
    rows: list[dict[str, Any]] = result["rows"]
    families: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        families.setdefault(row["family"], []).append(row)
    ranks = max((r["ranks"] for r in rows), default=1)
    headers = ["family", "kind", "what it exercises"] + [
        name.replace("ranks", f"{ranks} ranks") for name, _ in COLUMNS
    ]
    notes: list[str] = []
    cells = []
    for name, group in families.items():
        first = group[0]
        cells.append(
            [name, first["kind"], _one_line(first["notes"])]
            + [_cell(_find(group, mode), notes) for _, mode in COLUMNS]
        )
    steps = {int(r["steps"]) for r in rows if r.get("steps") is not None}
    chunk = {int(r["chunk_elements"]) for r in rows if r.get("chunk_elements") is not None}
    head = (
        f"{'/'.join(map(str, sorted(steps)))} steps, chunks of "
        f"{'/'.join(map(str, sorted(chunk)))} elements; each cell: the result and the largest "
        "relative loss difference from the reference engine (bf16: against its tolerance), "
        "the budget of a tight run, † where a tight run's losses differ from its unlimited one's."
    )
    tail = [f"[{i}] {_one_line(note)}" for i, note in enumerate(notes, start=1)]
    bf16 = _low_precision_summary(rows)
    note = " ".join([head, *tail, *([bf16] if bf16 else [])])
    title = "tidal bench compat: the chunk engine against the reference engine"
    return [ResultTable.of(title, headers, cells, left_columns=3, note=note)]


def _low_precision_summary(rows: list[dict[str, Any]]) -> str | None:
    """Which bf16 runs began where plain PyTorch on the model cast to bf16 begins."""
    low = [r for r in rows if r["precision"] != "fp32" and r["ranks"] == 1]
    if not low:
        return None
    same = [r["family"] for r in low if r.get("first_loss_as_plain") is True]
    differ = [r["family"] for r in low if r.get("first_loss_as_plain") is False]
    fails = [f"{r['family']} ({_one_line(r['plain_error'])})" for r in low if "plain_error" in r]
    unknown = [
        r["family"] for r in low if "first_loss_as_plain" not in r and "plain_error" not in r
    ]
    text = (
        f"First {low[0]['precision']} loss equal, bit for bit, to plain PyTorch's on the model "
        f"with its parameters and norm statistics cast to {low[0]['precision']}, under autocast "
        f"(as in the chunk engine; before any update): {len(same)} of {len(low)} families"
    )
    if differ:
        text += f"; different: {', '.join(differ)}"
    if fails:
        text += f"; plain PyTorch fails too: {'; '.join(fails)}"
    if unknown:
        text += f"; not compared (no first loss): {', '.join(unknown)}"
    return text + "."
