"""docs/results.md and README.md's results table are what ``tidal bench report`` writes from
benchmarks/results/ (benchmarks/report.py), and the report's rules on made-up results."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.report import README_BEGIN, README_END, readme_with, render
from benchmarks.runs import Results, changed_since, current_runs, replaced_runs
from benchmarks.targets import TARGETS, read
from tidal.cli.args import build_parser
from tidal.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PARSER = build_parser()
# A small committed run the tests copy: the newest `tidal bench make` (a new one replaces it).
MAKE_RUN = max(path.name for path in RESULTS.glob("make-*.json"))


def test_the_results_page_and_the_readme_table_are_what_the_report_writes() -> None:
    results = Results.load(RESULTS, PARSER)
    assert (ROOT / "docs" / "results.md").read_text() == render(results), (
        "docs/results.md is not what `tidal bench report` writes: run it"
    )
    readme = (ROOT / "README.md").read_text()
    assert readme == readme_with(readme, results), (
        "README.md's results table: run `tidal bench report`"
    )


def test_the_results_folder_holds_no_replaced_run() -> None:
    replaced = [run.path.name for run in replaced_runs(Results.load(RESULTS, PARSER).runs)]
    assert not replaced, f"later runs replaced {replaced}: `tidal bench report --prune`"


def test_every_target_reads_a_committed_run_and_the_readme_has_at_most_twelve() -> None:
    results = Results.load(RESULTS, PARSER)
    unread = [t.key for t in TARGETS if read(t, results).run is None]
    assert not unread, f"no run measures {unread}"
    assert 6 <= sum(t.headline for t in TARGETS) <= 12
    assert len({t.key for t in TARGETS}) == len(TARGETS)


def _report(folder: Path, *flags: str) -> int:
    argv = ["bench", "report", "--results-dir", str(folder / "results"),
            "--page", str(folder / "results.md"), "--readme", str(folder / "README.md"), *flags]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


@pytest.fixture
def made_up(tmp_path: Path) -> Path:
    """A folder that is no git checkout, with one committed run and a README with the markers."""
    (tmp_path / "results").mkdir()
    shutil.copy(RESULTS / MAKE_RUN, tmp_path / "results" / MAKE_RUN)
    (tmp_path / "README.md").write_text(f"# x\n\n{README_BEGIN}\n{README_END}\n\nend\n")
    return tmp_path


def _edit(path: Path, minutes: float) -> None:
    data = json.loads(path.read_text())
    next(r for r in data["rows"] if r["target"] == "test")["minutes"] = minutes
    path.write_text(json.dumps(data, indent=2) + "\n")


def test_an_edited_figure_fails_the_check_until_the_page_is_written_again(made_up: Path) -> None:
    assert _report(made_up, "--check") == 1  # nothing written yet
    assert _report(made_up) == 0
    assert _report(made_up, "--check") == 0
    page = (made_up / "results.md").read_text()
    data = json.loads((made_up / "results" / MAKE_RUN).read_text())
    minutes = next(r for r in data["rows"] if r["target"] == "test")["minutes"]
    assert f"| test | {minutes:.1f} |" in page
    assert f"{minutes:.1f} min" in (made_up / "README.md").read_text()
    assert (made_up / "README.md").read_text().endswith("\n\nend\n")  # only the block changes
    _edit(made_up / "results" / MAKE_RUN, 16.2)
    assert _report(made_up, "--check") == 1
    assert _report(made_up) == 0 and _report(made_up, "--check") == 0
    readme = (made_up / "README.md").read_text()
    assert "16.2 min" in readme and "| misses |" in readme  # over the 15-minute target now


def test_a_later_run_of_the_same_settings_replaces_an_earlier_one(made_up: Path) -> None:
    first = made_up / "results" / MAKE_RUN
    data = json.loads(first.read_text())
    later = made_up / "results" / "make-cpu-x86-64-20991201-000000.json"  # after any real run
    later.write_text(json.dumps({**data, "created_at": "2099-12-01T00:00:00+00:00"}))
    other = made_up / "results" / "make-cpu-x86-64-20991202-000000.json"
    other.write_text(json.dumps({**data, "command": "tidal bench make --targets test",
                                 "created_at": "2099-12-02T00:00:00+00:00"}))  # fmt: skip
    runs = Results.load(made_up / "results", PARSER).runs
    assert [r.path.name for r in replaced_runs(runs)] == [MAKE_RUN]
    assert [r.path.name for r, _ in current_runs(runs)] == [other.name, later.name]
    assert _report(made_up, "--prune") == 0
    assert not first.exists() and later.exists() and other.exists()


def test_a_result_the_parser_cannot_read_is_one_line(made_up: Path, capsys) -> None:
    path = made_up / "results" / MAKE_RUN
    path.write_text(path.read_text().replace('"tidal bench make"', '"tidal bench make --nope"'))
    assert _report(made_up, "--check") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert MAKE_RUN in line and "unrecognized arguments: --nope" in line


def test_a_readme_without_the_markers_is_refused_in_one_line(made_up: Path, capsys) -> None:
    (made_up / "README.md").write_text("# x\n")
    assert _report(made_up) == 2
    assert "--readme: the file has no results block" in capsys.readouterr().err
    assert (made_up / "README.md").read_text() == "# x\n"  # nothing lost


def test_stale_says_which_runs_code_changed_since_their_commit_and_writes_nothing(
    made_up: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=made_up, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (made_up / "Makefile").write_text("test:\n\ttrue\n")  # code the make bench measures
    git("add", "-A")
    git("commit", "-qm", "one")
    path = made_up / "results" / MAKE_RUN
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "git_commit": git("rev-parse", "HEAD")}))
    assert _report(made_up) == 0
    (run,) = Results.load(made_up / "results", PARSER).runs
    assert changed_since(run, made_up) == []
    (made_up / "Makefile").write_text("test:\n\tfalse\n")
    assert changed_since(run, made_up) == ["Makefile"]
    monkeypatch.chdir(made_up)
    page = (made_up / "results.md").read_text()
    assert main(["bench", "report", "--results-dir", "results", "--page", "results.md",
                 "--readme", "README.md", "--stale", "--check"]) == 0  # fmt: skip
    assert f"{run.name}: 1 files, e.g. Makefile" in capsys.readouterr().out
    assert (made_up / "results.md").read_text() == page  # the page does not say it
