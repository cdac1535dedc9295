"""The README as a new user meets it: its library blocks run as they are written, its command-line
quick start runs line by line in an empty folder, every other ``tidal`` command it shows is one
the CLI accepts (with recipes and files that exist), and every path it names is in the tree."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from tidal.cli.args import build_parser
from tidal.cli.main import main
from tidal.train.job import find_recipe
from tidal.train.report import summary_rows

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _section(heading: str) -> str:
    text = README[README.index(f"## {heading}") :]
    return text[: text.index("\n## ", 1)]


def _commands(block: str) -> list[list[str]]:
    """The block's ``tidal ...`` lines as argv, comments dropped."""
    lines = (line.split("  #")[0].strip() for line in block.splitlines())
    return [shlex.split(line) for line in lines if line.startswith("tidal ")]


def test_the_library_examples_run_and_the_chunks_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own_model, meta_gpt, language_model = _blocks("python", _section("Quick start: the library"))
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(own_model, "README.md (own model)", "exec"), namespace)
        exec(compile(meta_gpt, "README.md (GPT on the meta device)", "exec"), namespace)
    steps, evictions = map(int, out.getvalue().split())
    assert steps == 2 and evictions > 0  # what the comment in the example says
    assert float(namespace["loss"].item()) > 0  # type: ignore[attr-defined]
    monkeypatch.chdir(tmp_path)  # its run folder, runs/lm
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(language_model, "README.md (a language model)", "exec"), namespace)
    steps = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in steps[:2]] == ["step 2/4", "step 4/4"]
    assert namespace["summary"]["tokens"] == 4 * 4 * 32  # type: ignore[index]


@pytest.mark.slow
def test_the_command_line_quick_start_runs_line_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (block, *_) = _blocks("bash", _section("Quick start: the command line"))
    commands = _commands(block)
    assert len(commands) >= 6
    monkeypatch.chdir(tmp_path)  # an empty folder, as a new user's
    printed = {}
    for argv in commands:  # in this process, as `tidal` would run them (torchrun for --nproc)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv[1:])
        assert code == 0, f"{shlex.join(argv)}:\n{out.getvalue()[-2000:]}{err.getvalue()[-2000:]}"
        printed[argv[1]] = out.getvalue()
    summaries = {
        run_dir: json.loads((tmp_path / run_dir / "summary.json").read_text())
        for run_dir in re.findall(r"run_dir=(\S+)", block)
    }
    engines = {d: (s["engine"].split()[0], s["world_size"]) for d, s in summaries.items()}
    assert engines == {
        "runs/tiny": ("reference", 1), "runs/chunk": ("chunk", 1),
        "runs/zero3": ("chunk-sharded", 2), "runs/plan": ("plan", 2),
        "runs/pipe": ("pipeline", 2), "runs/llama": ("reference", 1),
    }  # fmt: skip
    assert all(s["steps"] == 20 for s in summaries.values())
    assert 0 < summaries["runs/chunk"]["peak_device_bytes"] <= 3 * 2**20  # its budget
    assert (tmp_path / "runs/plan/checkpoints").is_dir()  # written by the two ranks
    # issue 49: `tidal plan` prints how to train its plan, a command the CLI takes
    (line,) = [x for x in printed["plan"].splitlines() if x.startswith("train it: ")]
    train = build_parser().parse_args(shlex.split(line.removeprefix("train it: "))[1:])
    assert (train.recipe, train.plan, train.nproc) == ("tiny", "plan.json", 2)
    assert "priced, not run by tidal train: the baselines" in printed["plan"]
    # and the summary table of the ZeRO-3 run says its world size and what it gathered
    rows = dict(summary_rows(summaries["runs/zero3"]))
    assert rows["world size"] == "2 ranks" and "ZeRO-3 over 2 ranks" in rows["engine"]
    assert rows["gathered per step"].startswith("all-gathered ")
    assert summaries["runs/zero3"]["bytes_all_gathered"] > 0


def test_every_command_it_shows_is_one_the_cli_accepts() -> None:
    parser = build_parser()
    commands = [argv for block in _blocks("bash") for argv in _commands(block)]
    assert len(commands) >= 12
    for argv in commands:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                args = parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{shlex.join(argv)}: {err.getvalue().strip()}")
        if getattr(args, "recipe", None):
            find_recipe(args.recipe)  # a recipe tidal ships, by name


def test_every_path_it_names_is_in_the_tree() -> None:
    named = set(re.findall(r"\b((?:tidal|docs|benchmarks|tests)/[\w./-]*[\w-])", README))
    named |= {"constraints.txt", "Makefile"} & set(re.findall(r"[\w.-]+", README))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
