"""The claims check: every figure and guarantee in README.md and docs/ has a row in
docs/claims.md, and every row's evidence still says what the row says.

[Note: claims]
A claim in the prose carries a marker, a link to its row: ``[CE7](claims.md#ce7)`` (from the
README, ``docs/claims.md#ce7``). Its row in docs/claims.md, under the heading that names the
document, holds the place (the section heading the marker stands under), the claim at its exact
strength, its evidence, and its state. Evidence items, separated by ``;``:

- ``test `tests/path.py::test_name``` (or ``path::Class::test_name``): the test must exist;
- ``json `benchmarks/results/F.json` `EXPR` = VALUE``: ``EXPR`` is arithmetic over keys in
  braces (``{rows[system=tidal,nproc=2].step_s} / {rows[system=plain].step_s}``; a key is a dotted
  path, a list is indexed by a number or filtered by ``[field=value,...]`` to its one match).
  Its value, rounded to VALUE's decimals, must equal VALUE, and VALUE must be written in the
  sentence that carries the marker;
- ``record `path```: a file that must exist (a device record, a plot);
- ``cite: ...``: a published figure tidal does not measure;
- ``none``: nothing measures it (the state is then "not measured").

The state starts with ``holds``, ``weaker``, ``not measured`` or ``does not hold``. A results
JSON is stale when the code its bench measures (the table "What each bench measures" in
docs/claims.md) differs from the code at the commit the JSON records: git names the files that
changed, and a Python file counts only where its syntax tree changed (a comment, a docstring or
formatting does not make a figure stale), and a change that only moved code between the
bench's files counts for nothing ([Note: moved code] in moves.py). A row citing a stale JSON
says ``stale`` in its state, and its marker says so where the figure appears, ``[CE7: stale](claims.md#ce7)``; a
re-measured row drops both. The table "Results cited" lists every results JSON the rows cite
with the commit it records and its state (current or stale). A shallow clone or an unpacked archive has no history to decide
staleness from: there the check leaves the stale marks as they are.

A paragraph, list item or table row of the prose that writes a figure (a number with a unit, a
percentage, a ratio) or a guarantee word ("equal", "exactly", "never", "within", "bit for bit"
...) outside code must carry a marker, or say why it is no claim: ``<!-- not a claim: a
setting -->``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tidal.testing.moves import only_moved, strip_docstrings

__all__ = [
    "Claims",
    "Row",
    "Unit",
    "check",
    "doc_units",
    "has_history",
    "parse_claims",
    "prose_documents",
]

CLAIMS_PATH = "docs/claims.md"
STATES = ("holds", "weaker", "not measured", "does not hold")

MARKER = re.compile(
    r"\[(?P<id>[A-Z]{1,2}\d+)(?P<stale>: stale)?\]\((?P<target>[^)#\s]*)#(?P<anchor>[a-z0-9]+)\)"
)
NOT_A_CLAIM = "<!-- not a claim"
_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:%|x\b|×|[KMGT]i?B\b|B/s|s\b|ms\b|min\b|minutes\b"
    r"|hours?\b|seconds\b|[TP]FLOP|tokens/s)"
)
_GUARANTEE = re.compile(
    r"\b(?:bit for bit|bit-exact|bit-equal|bitwise|exactly|identical|never|within|no hangs?"
    r"|guarantee[sd]?|always|equals?)\b",
    re.IGNORECASE,
)
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    """A paragraph, list item or table row of a document, outside code blocks."""

    doc: str
    line: int
    heading: str
    text: str

    def markers(self) -> list[re.Match[str]]:
        return list(MARKER.finditer(self.text))

    def makes_claim(self) -> bool:
        prose = _COMMENT.sub(" ", _LINK_TARGET.sub("]", _CODE_SPAN.sub(" ", self.text)))
        return bool(_FIGURE.search(prose) or _GUARANTEE.search(prose))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    id: str
    doc: str  # the document whose claim it is (its section of docs/claims.md)
    where: str  # the section heading the marker stands under
    claim: str
    evidence: str
    state: str
    line: int  # in docs/claims.md


def prose_documents(root: Path) -> list[str]:
    """README.md and every docs/*.md but the claims table itself."""
    docs = sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))
    return ["README.md", *(d for d in docs if d != CLAIMS_PATH)]


def doc_units(doc: str, text: str) -> list[Unit]:
    """``text`` cut into units: paragraphs, list items (with their continuation lines) and table
    rows; fenced code and headings are not units."""
    units: list[Unit] = []
    lines: list[str] = []
    start, heading, in_code = 0, "", False

    def flush() -> None:
        if lines:
            units.append(Unit(doc=doc, line=start, heading=heading, text=" ".join(lines)))
            lines.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            in_code = not in_code
        elif in_code:
            continue
        elif not stripped or stripped.startswith("#"):
            flush()
            if stripped.startswith("#"):
                heading = stripped.lstrip("#").strip()
        elif stripped.startswith("|"):
            flush()
            if not set(stripped) <= set("|-: "):
                units.append(Unit(doc=doc, line=number, heading=heading, text=stripped))
        elif re.match(r"(?:[-*]|\d+\.)\s", stripped):
            flush()
            start, lines[:] = number, [stripped]
        else:
            if not lines:
                start = number
            lines.append(stripped)
    flush()
    return units


_CELL = re.compile(r"(?<!\\)\|")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in _CELL.split(line.strip().strip("|"))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claims:
    """docs/claims.md read: its rows, the code each bench measures, and the results it cites
    (path -> the short commit and the state the table gives)."""

    rows: list[Row]
    benches: dict[str, list[str]]
    results: dict[str, tuple[str, str]]


def parse_claims(text: str) -> Claims:
    """The rows of docs/claims.md, its table of the code each bench measures and its table of
    the results cited."""
    rows: list[Row] = []
    benches: dict[str, list[str]] = {}
    results: dict[str, tuple[str, str]] = {}
    section = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        if not line.startswith("|") or set(line.strip()) <= set("|-: "):
            continue
        cells = _cells(line)
        if section == "What each bench measures":
            if cells[0] != "bench":
                benches[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[1])
            continue
        if section == "Results cited":
            if cells[0] != "results" and len(cells) == 4:
                results[cells[0].strip("`")] = (cells[2].strip("`"), cells[3])
            continue
        found = re.fullmatch(r'<a id="([a-z0-9]+)"></a>([A-Z]{1,2}\d+)', cells[0])
        if found is None or len(cells) != 5:
            continue  # a header, or a row the check reports below
        rows.append(Row(id=found.group(2), doc=section, where=cells[1], claim=cells[2],
                        evidence=cells[3], state=cells[4], line=number))  # fmt: skip
    return Claims(rows=rows, benches=benches, results=results)


def check(root: Path, *, claims_text: str | None = None, docs: Iterable[str] | None = None,
          git: bool = True) -> list[str]:  # fmt: skip
    """Every problem found, one line each (empty: the docs and their evidence agree)."""
    claims_text = claims_text if claims_text is not None else (root / CLAIMS_PATH).read_text()
    docs = list(docs) if docs is not None else prose_documents(root)
    claims = parse_claims(claims_text)
    rows, benches = claims.rows, claims.benches
    problems = _table_problems(claims_text, rows)
    by_id = {row.id: row for row in rows}
    marked: dict[str, list[tuple[Unit, bool]]] = {}
    for doc in docs:
        for unit in doc_units(doc, (root / doc).read_text()):
            problems += _unit_problems(unit, by_id, marked)
    stale = _Staleness(root, benches) if git and has_history(root) else None
    for row in rows:
        if row.doc in docs:
            problems += _row_problems(root, row, marked.get(row.id, []), stale)
    if set(docs) >= set(prose_documents(root)):  # the results table lists the whole table's
        problems += _results_problems(root, claims, stale)
    return problems


def _results_problems(root: Path, claims: Claims, stale: _Staleness | None) -> list[str]:
    """Each results JSON the rows cite has a line in "Results cited" with the commit it records
    and whether it is current or stale; no other line."""
    cited = {path for row in claims.rows for path in re.findall(r"json `([^`]+)`", row.evidence)}
    problems = [f"{CLAIMS_PATH}: Results cited lists {path}, which no row cites"
                for path in sorted(set(claims.results) - cited)]  # fmt: skip
    for path in sorted(cited):
        if path not in claims.results or not (root / path).is_file():
            problems.append(f"{CLAIMS_PATH}: Results cited has no line for {path}")
            continue
        commit, state = claims.results[path]
        recorded = (json.loads((root / path).read_text()).get("git_commit") or "none")[:7]
        if commit != recorded:
            problems.append(f"{CLAIMS_PATH}: Results cited says {path} was measured at {commit}; "
                            f"it records {recorded}")  # fmt: skip
        if stale is not None and state != ("stale" if stale.is_stale(path) else "current"):
            problems.append(f"{CLAIMS_PATH}: Results cited: {path} is "
                            f"{'stale' if stale.is_stale(path) else 'current'}, not {state}")  # fmt: skip
    return problems


def has_history(root: Path) -> bool:
    """Whether ``root`` is a git checkout with its whole history (a shallow clone or an
    unpacked archive cannot tell which results are stale)."""
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-shallow-repository"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.returncode == 0 and done.stdout.strip() == "false"


def _table_problems(text: str, rows: list[Row]) -> list[str]:
    problems = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("| <a id=") and not any(r.line == number for r in rows):
            problems.append(f"{CLAIMS_PATH}:{number}: a row must read | <a id=\"x1\"></a>X1 | "
                            "where | claim | evidence | state |")  # fmt: skip
    for row in rows:
        if row.id in seen:
            problems.append(f"{CLAIMS_PATH}:{row.line}: {row.id} has two rows")
        seen.add(row.id)
        if f'<a id="{row.id.lower()}">' not in text.splitlines()[row.line - 1]:
            problems.append(f"{CLAIMS_PATH}:{row.line}: {row.id}'s anchor must be {row.id.lower()}")
        if row.evidence == "none" and not row.state.startswith("not measured"):
            problems.append(f"{CLAIMS_PATH}:{row.line}: {row.id}'s evidence is none, so the state "
                            "is 'not measured'")  # fmt: skip
        if not row.state.startswith(STATES):
            problems.append(f"{CLAIMS_PATH}:{row.line}: {row.id}'s state must start with one of "
                            f"{', '.join(STATES)}")  # fmt: skip
    return problems


def _unit_problems(unit: Unit, by_id: dict[str, Row],
                   marked: dict[str, list[tuple[Unit, bool]]]) -> list[str]:  # fmt: skip
    place = f"{unit.doc}:{unit.line}"
    markers = unit.markers()
    if not markers and unit.makes_claim() and NOT_A_CLAIM not in unit.text:
        return [f"{place} ({unit.heading}): {_excerpt(unit.text)!r} writes a figure or a "
                f"guarantee with no row in {CLAIMS_PATH}: add a row and mark the sentence "
                f"[X1]({_link(unit.doc)}#x1), or end it with {NOT_A_CLAIM}: why -->"]  # fmt: skip
    problems = []
    for marker in markers:
        claim_id = marker["id"]
        row = by_id.get(claim_id)
        if row is None:
            problems.append(f"{place}: marker {claim_id} has no row in {CLAIMS_PATH}")
            continue
        if row.doc != unit.doc:
            problems.append(f"{place}: {claim_id}'s row is under {row.doc}, not {unit.doc}")
        if marker["target"] != _link(unit.doc) or marker["anchor"] != claim_id.lower():
            problems.append(f"{place}: {claim_id}'s link must be "
                            f"{_link(unit.doc)}#{claim_id.lower()}")  # fmt: skip
        marked.setdefault(claim_id, []).append((unit, bool(marker["stale"])))
    return problems


def _row_problems(root: Path, row: Row, units: list[tuple[Unit, bool]],
                  stale: _Staleness | None) -> list[str]:  # fmt: skip
    place = f"{CLAIMS_PATH}:{row.line} ({row.id})"
    if not units:
        return [f"{place}: no sentence in {row.doc} carries [{row.id}]({_link(row.doc)}#"
                f"{row.id.lower()}): mark the claim or remove the row"]  # fmt: skip
    problems = []
    if row.where != units[0][0].heading:
        problems.append(f"{place}: where says {row.where!r}, the marker stands under "
                        f"{units[0][0].heading!r}")  # fmt: skip
    items = [item.strip() for item in re.split(r";\s+(?=test |json |record |cite:|none)",
                                               row.evidence)]  # fmt: skip
    stale_files = []
    for item in items:
        problem = _evidence_problem(root, item, [u for u, _ in units])
        if problem:
            problems.append(f"{place}: {problem}")
        found = re.match(r"json `([^`]+)`", item)
        if (
            found
            and stale is not None
            and stale.is_stale(found.group(1))
            and found.group(1) not in stale_files
        ):
            stale_files.append(found.group(1))
    if stale is not None:
        says_stale = "stale" in row.state
        if stale_files and not (says_stale and all(flag for _, flag in units)):
            problems.append(f"{place}: {', '.join(stale_files)} is stale (its bench's code "
                            f"changed after its commit): re-measure, or say 'stale' in the "
                            f"state and write the marker [{row.id}: stale]")  # fmt: skip
        if not stale_files and (says_stale or any(flag for _, flag in units)):
            problems.append(f"{place}: no evidence is stale now: drop 'stale' from the state "
                            f"and the marker")  # fmt: skip
    return problems


def _evidence_problem(root: Path, item: str, units: list[Unit]) -> str | None:
    if item == "none" or item.startswith("cite:"):
        return None
    if found := re.fullmatch(r"test `([^`]+)`", item):
        return _test_problem(root, found.group(1))
    if found := re.fullmatch(r"record `([^`]+)`", item):
        return None if (root / found.group(1)).is_file() else f"no file {found.group(1)}"
    if found := re.fullmatch(r"json `([^`]+)` `([^`]+)` = (.+)", item):
        path, expr, written = found.groups()
        return _json_problem(root, path, expr, written, units)
    return f"evidence {item!r} is none of: test `..`, json `..` `..` = .., record `..`, cite:, none"


def _test_problem(root: Path, node: str) -> str | None:
    path, *names = node.split("::")
    if not (root / path).is_file() or not names:
        return f"test {node}: no such file, or no test named"
    scope: list[ast.stmt] = ast.parse((root / path).read_text()).body
    for name in names:
        name = name.split("[")[0]
        found = [n for n in scope if isinstance(n, ast.ClassDef | ast.FunctionDef)
                 and n.name == name]  # fmt: skip
        if not found:
            return f"test {node}: {name} is not in {path}"
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return None


def _json_problem(root: Path, path: str, expr: str, written: str, units: list[Unit]) -> str | None:
    if not (root / path).is_file():
        return f"no file {path}"
    data = json.loads((root / path).read_text())
    try:
        value = _evaluate(expr, data)
    except (KeyError, IndexError, ValueError, TypeError, ZeroDivisionError) as error:
        return f"{path}: {expr}: {error}"
    number = re.search(r"-?\d[\d,]*(?:\.\d+)?", written)
    if number is None:
        return f"{path}: the written value {written!r} has no number"
    digits = number.group(0).replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    if not math.isclose(round(value, decimals), float(digits), abs_tol=10**-decimals / 100):
        return (f"{path}: {expr} is {value:.6g}, rounded {round(value, decimals)}; the row and "
                f"the prose say {written}")  # fmt: skip
    pattern = r"(?<![\d.])" + re.escape(_squeeze(written)) + r"(?!\d)"
    if not any(re.search(pattern, _squeeze(u.text)) for u in units):
        return f"{written} is not written where the marker stands ({units[0].doc}:{units[0].line})"
    return None


def _squeeze(text: str) -> str:
    """``text`` without spaces, emphasis and thousands separators (``5,210``)."""
    return re.sub(r"[\s*]|(?<=\d),(?=\d{3}(?!\d))", "", text)


def _evaluate(expr: str, data: Any) -> float:
    """``expr``'s value: arithmetic over ``{key}`` lookups in ``data``."""
    values: list[float] = []

    def lookup(found: re.Match[str]) -> str:
        values.append(float(_lookup(data, found.group(1))))
        return f"_v{len(values) - 1}"

    tree = ast.parse(re.sub(r"\{([^}]+)\}", lookup, expr), mode="eval")
    return _arith(tree.body, values)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow}  # fmt: skip


def _arith(node: ast.expr, values: list[float]) -> float:
    if isinstance(node, ast.Name) and node.id.startswith("_v"):
        return values[int(node.id[2:])]
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand, values)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arith(node.left, values), _arith(node.right, values))
    raise ValueError(f"only + - * / ** over {{keys}} and numbers, not {ast.dump(node)}")


def _lookup(data: Any, key: str) -> Any:
    for part in re.findall(r"(?:[^.\[]|\[[^\]]*\])+", key):
        name, _, wanted = part.partition("[")
        if name:
            data = data[int(name)] if isinstance(data, list) else data[name]
        if wanted:
            pairs = dict(p.split("=", 1) for p in wanted.rstrip("]").split(","))
            matches = [d for d in data if all(str(d.get(k)) == v for k, v in pairs.items())]
            if len(matches) != 1:
                raise KeyError(f"[{wanted} matches {len(matches)} entries, not one")
            data = matches[0]
    if isinstance(data, bool) or not isinstance(data, int | float):
        raise ValueError(f"{key} is {data!r}, not a number")
    return data


# A split of a file moves code out of it, into a new one, and rewrites a few imports.
_MOST_FILES_A_MOVE_EDITS = 12


class _Staleness:
    """Whether a results JSON's commit predates a change to the code its bench measures: a
    change to what the code does, so a comment, a docstring or formatting does not count (the
    files' syntax trees, docstrings left out, are compared with the working tree's)."""

    def __init__(self, root: Path, benches: dict[str, list[str]]) -> None:
        self.root, self.benches = root, benches
        self._cache: dict[str, bool] = {}
        self._moved: dict[tuple[str, tuple[str, ...], tuple[str, ...]], bool] = {}

    def is_stale(self, path: str) -> bool:
        if path not in self._cache:
            self._cache[path] = self._decide(path)
        return self._cache[path]

    def _decide(self, path: str) -> bool:
        data = json.loads((self.root / path).read_text())
        commit, code = data.get("git_commit"), self.benches.get(data.get("bench", ""))
        if not commit or code is None:
            return True  # nothing says what it measured, or when
        if self._git("merge-base", "--is-ancestor", commit, "HEAD") is None:
            return True  # a commit this history does not hold
        changed = self._git("diff", "--name-only", commit, "--", *code)
        if changed is None:
            return True
        edited = [f for f in changed.split() if self._code_changed(commit, f)]
        if not edited:
            return False
        if len(edited) > _MOST_FILES_A_MOVE_EDITS:
            return True  # too many to read twice for a move: a change, which errs on the safe side
        # [Note: moved code] in moves.py: a change that only moved code keeps the figures
        key = (commit, tuple(edited), tuple(code))  # the bench's other files are its importers
        if key not in self._moved:
            others = (self._git("ls-files", "--", *code) or "").split()
            self._moved[key] = only_moved(
                edited, before=lambda path: self._git("show", f"{commit}:{path}"), now=self._read,
                importers=[f for f in others if f not in edited],
            )  # fmt: skip
        return not self._moved[key]

    def _read(self, path: str) -> str | None:
        file = self.root / path
        return file.read_text() if file.is_file() else None

    def _code_changed(self, commit: str, path: str) -> bool:
        before, now = self._git("show", f"{commit}:{path}"), self.root / path
        if before is None or not now.is_file() or not path.endswith(".py"):
            return before is None or not now.is_file() or before != now.read_text()
        return _code(before) != _code(now.read_text())

    def _git(self, *args: str) -> str | None:
        done = subprocess.run(["git", "-C", str(self.root), *args], capture_output=True,
                              text=True, check=False)  # fmt: skip
        return done.stdout if done.returncode == 0 else None


def _code(source: str) -> str:
    """What ``source`` does: its syntax tree without docstrings (comments and layout are not in
    a tree)."""
    return ast.dump(strip_docstrings(ast.parse(source)))


def _link(doc: str) -> str:
    return CLAIMS_PATH if doc == "README.md" else "claims.md"


def _excerpt(text: str) -> str:
    return text if len(text) <= 90 else text[:87] + "..."


def main(argv: list[str]) -> int:
    """``python -m tidal.testing.claims [DOC ...] [--claims FILE ...]``: check the documents
    named (default: all) against docs/claims.md with the sections in FILEs added to it."""
    docs = argv[: argv.index("--claims")] if "--claims" in argv else argv
    extra = argv[argv.index("--claims") + 1 :] if "--claims" in argv else []
    root = Path.cwd()
    text = "\n".join([(root / CLAIMS_PATH).read_text(), *(Path(f).read_text() for f in extra)])
    found = check(root, claims_text=text, docs=docs or None)
    print("\n".join(found) or "claims: every figure and guarantee has its row and its evidence")
    return 1 if found else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
