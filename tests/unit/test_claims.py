"""The claims table (docs/claims.md) against the prose and the evidence ([Note: claims] in
tidal/testing/claims.py), and the check itself on small made-up repositories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tidal.testing.claims import check, doc_units

ROOT = Path(__file__).resolve().parents[2]


def _header(commit: str = "none", state: str = "current") -> str:
    return f"""# Claims

## What each bench measures

| bench | code |
|---|---|
| offload | `tidal/memory` |

## Results cited

| results | bench | commit | state |
|---|---|---|---|
| `benchmarks/results/o.json` | offload | `{commit}` | {state} |

## README.md

| id | where | claim | evidence | state |
|---|---|---|---|---|
"""


HEADER = _header()


def _repo(tmp_path: Path, prose: str, rows: str, result: dict | None = None) -> Path:
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "README.md").write_text(prose)
    (tmp_path / "docs" / "claims.md").write_text(HEADER + rows)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_overhead():\n    assert True\n")
    if result is not None:
        (tmp_path / "benchmarks" / "results").mkdir(parents=True)
        (tmp_path / "benchmarks" / "results" / "o.json").write_text(json.dumps(result))
    return tmp_path


RESULT = {"bench": "offload", "git_commit": None,
          "rows": [{"system": "tidal", "step_s": 1.2}, {"system": "plain", "step_s": 1.0}]}  # fmt: skip
PROSE = "# tidal\n\nThe overhead is 1.20x plain PyTorch [R1](docs/claims.md#r1).\n"
ROW = ('| <a id="r1"></a>R1 | tidal | 1.20x plain PyTorch | json `benchmarks/results/o.json` '
       "`{rows[system=tidal].step_s} / {rows[system=plain].step_s}` = 1.20x | holds |\n")  # fmt: skip


def test_every_claim_has_its_row_and_its_evidence() -> None:
    problems = check(ROOT)
    assert not problems, "\n".join(problems)


def test_the_made_up_repository_passes(tmp_path: Path) -> None:
    assert check(_repo(tmp_path, PROSE, ROW, RESULT), git=False) == []


def test_a_changed_figure_fails(tmp_path: Path) -> None:
    changed = {**RESULT, "rows": [{"system": "tidal", "step_s": 1.3}, RESULT["rows"][1]]}
    problems = check(_repo(tmp_path, PROSE, ROW, changed), git=False)
    assert (
        len(problems) == 1 and "is 1.3, rounded 1.3; the row and the prose say 1.20x" in problems[0]
    )


def test_a_figure_the_prose_no_longer_writes_fails(tmp_path: Path) -> None:
    prose = PROSE.replace("1.20x", "1.1x")
    problems = check(_repo(tmp_path, prose, ROW, RESULT), git=False)
    assert len(problems) == 1 and "1.20x is not written where the marker stands" in problems[0]


def test_a_claim_with_no_row_fails_and_a_setting_may_say_so(tmp_path: Path) -> None:
    prose = PROSE + "\nEvery step is bit for bit the reference's.\n\nIt waits 10 s.\n"
    problems = check(_repo(tmp_path, prose, ROW, RESULT), git=False)
    assert len(problems) == 2, problems
    assert 'README.md:5 (tidal): "Every step is bit for bit' in problems[0]
    assert "with no row in docs/claims.md" in problems[0] and "README.md:7" in problems[1]
    setting = prose.replace("10 s.", "10 s. <!-- not a claim: a default -->")
    problems = check(_repo(tmp_path / "again", setting, ROW, RESULT), git=False)
    assert len(problems) == 1 and "bit for bit" in problems[0]


def test_a_result_the_rows_cite_needs_its_line_in_results_cited(tmp_path: Path) -> None:
    rows = ROW.replace("o.json", "p.json")
    root = _repo(tmp_path, PROSE, rows, RESULT)
    (root / "benchmarks" / "results" / "p.json").write_text(json.dumps(RESULT))
    problems = check(root, git=False)
    assert problems == [
        "docs/claims.md: Results cited lists benchmarks/results/o.json, which no row cites",
        "docs/claims.md: Results cited has no line for benchmarks/results/p.json",
    ]


def test_a_missing_test_a_marker_with_no_row_and_a_row_with_no_marker_fail(tmp_path: Path) -> None:
    prose = PROSE + "\nResume is exact [R2](docs/claims.md#r2) [R9](docs/claims.md#r9).\n"
    rows = ROW + ('| <a id="r2"></a>R2 | tidal | exact resume | test `tests/test_x.py::test_resume` '
                  "| holds |\n| <a id=\"r3\"></a>R3 | tidal | x | none | holds |\n")  # fmt: skip
    problems = check(_repo(tmp_path, prose, rows, RESULT), git=False)
    assert any("marker R9 has no row" in p for p in problems), problems
    assert any("test_resume is not in tests/test_x.py" in p for p in problems), problems
    assert any("no sentence in README.md carries [R3]" in p for p in problems), problems
    assert any("evidence is none, so the state is 'not measured'" in p for p in problems), problems
    assert len(problems) == 4, problems


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


def test_a_result_older_than_its_code_must_say_it_is_stale(tmp_path: Path) -> None:
    root = _repo(tmp_path, PROSE, ROW, None)
    (root / "tidal" / "memory").mkdir(parents=True)
    (root / "tidal" / "memory" / "store.py").write_text("A = 1\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x", "--allow-empty")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    measured = _git(root, "rev-parse", "HEAD")
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "o.json").write_text(json.dumps({**RESULT, "git_commit": measured}))
    assert check(root) == [f"docs/claims.md: Results cited says benchmarks/results/o.json was "
                           f"measured at none; it records {measured[:7]}"]  # fmt: skip
    (root / "docs" / "claims.md").write_text(_header(measured[:7]) + ROW)
    assert check(root) == []
    (root / "tidal" / "memory" / "store.py").write_text('"""Says why."""\n\nA = 1  # still\n')
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "docs")
    assert check(root) == [], "a docstring and a comment do not change what the code does"
    (root / "tidal" / "memory" / "store.py").write_text("A = 2\n")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "changed")
    problems = check(root)
    assert len(problems) == 2 and "o.json is stale" in problems[0], problems
    assert problems[1].endswith("o.json is stale, not current"), problems
    (root / "README.md").write_text(PROSE.replace("[R1]", "[R1: stale]"))
    stale_row = ROW.replace("| holds |", "| holds; stale (measured before a change) |")
    (root / "docs" / "claims.md").write_text(_header(measured[:7], "stale") + stale_row)
    assert check(root) == []
    (results / "o.json").write_text(json.dumps({**RESULT, "git_commit": "0" * 40}))
    (root / "docs" / "claims.md").write_text(_header("0000000", "stale") + stale_row)
    assert check(root) == [], "a commit git does not know is stale too"


def test_a_change_that_only_moved_code_keeps_a_result_current(tmp_path: Path) -> None:
    """[Note: moved code] in tidal/testing/moves.py, through git as the check runs it."""
    root = _repo(tmp_path, PROSE, ROW, None)
    code = root / "tidal" / "memory"
    code.mkdir(parents=True)
    (code / "store.py").write_text("LIMIT = 3\n\n\ndef fits(n):\n    return n <= LIMIT\n")
    (code / "user.py").write_text("from tidal.memory.store import fits\n")
    commit = ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, *commit, "code")
    measured = _git(root, "rev-parse", "HEAD")
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "o.json").write_text(json.dumps({**RESULT, "git_commit": measured}))
    (root / "docs" / "claims.md").write_text(_header(measured[:7]) + ROW)
    (code / "limits.py").write_text("LIMIT = 3\n")
    (code / "store.py").write_text("from tidal.memory.limits import LIMIT\n\n\n"
                                   "def fits(n):\n    return n <= LIMIT\n")  # fmt: skip
    _git(root, "add", "-A")
    _git(root, *commit, "moved")
    assert check(root) == [], "a constant carried to another file changes nothing measured"
    (code / "limits.py").write_text("LIMIT = 4\n")
    _git(root, *commit, "edited", "-a")
    assert any("o.json is stale" in p for p in check(root))


@pytest.mark.parametrize(
    ("text", "claims"),
    [
        ("Runs `--set memory.device_budget=2MiB` here.", False),
        ("A budget of 40 MiB holds it.", True),
        ("The losses equal the reference's.", True),
        ("See [the record](results/x-12s.md).", False),
    ],
)
def test_what_counts_as_a_claim(text: str, claims: bool) -> None:
    (unit,) = doc_units("README.md", f"# t\n\n{text}\n")
    assert unit.makes_claim() is claims
