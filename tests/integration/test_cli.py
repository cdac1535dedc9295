"""The ``tidal`` command end to end, in subprocesses as a user runs it (its main in this process
where the process boundary is another test's)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def tidal(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        check=False,
    )


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("training.stepz=3", "training.stepz", "unknown key"),
        ("training.steps=many", "training.steps", "expected an integer"),
        ("memory.device_budget=-2GiB", "memory.device_budget", "cannot be negative"),
        ("training.precision=fp8", "training.precision", "expected one of"),
        ("data.source=web", "data.source", "expected one of"),
    ],
)
def test_config_errors_exit_2_with_one_line(
    override: str, key: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (the command's main): the process boundary is the next test's.
    assert main(["train", "--recipe", "tiny", "--set", override]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tidal: error: {key}: ")
    assert fragment in lines[0]
    assert "Traceback" not in err + out


def test_a_config_error_in_a_process_is_one_line_and_exit_2() -> None:
    result = tidal("train", "--recipe", "tiny", "--set", "training.stepz=3")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tidal: error: training.stepz: unknown key (allowed: batch_size, device, "
        "grad_accum_steps, grad_clip_norm, log_every, precision, seed, steps, val_batches, "
        "val_every); did you mean 'steps'?"
    ]
    assert result.stdout == ""


def test_unknown_recipe_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--recipe", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'no-such-recipe'" in err and "demo" in err


@pytest.mark.slow
def test_train_report_resume_cycle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--recipe",
        "tiny",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        "training.steps=12",
    ]
    first = tidal(*args)
    assert first.returncode == 0, first.stderr
    assert "step 10/12  loss" in first.stdout and "val_loss" in first.stdout

    summary = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "steps",
        "tokens",
        "final_loss",
        "val_loss",
        "tokens_per_s",
        "model_tflops_per_s",
        "peak_memory_bytes",
        "wall_s",
    ):
        assert summary[key] is not None, key
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 4 * 64
    assert summary["peak_memory_bytes"]["host"] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    for plot in ("loss.png", "memory.png"):
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second start in the same folder refuses to clobber the checkpoints.
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "step_00000012" / "meta.json").is_file()

    # The resume and the report in this process: the first run was the process boundary.
    assert main([*args[:-1], "training.steps=15", "--resume"]) == 0
    assert "resuming at step 12" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 15

    (run_dir / "loss.png").unlink()
    assert main(["report", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert "validation loss" in report and "tokens/s" in report
    assert (run_dir / "loss.png").exists()


def test_report_of_a_missing_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "summary.json does not exist" in err and "Traceback" not in err


@pytest.mark.slow
def test_demo_recipe_runs(tmp_path: Path) -> None:
    # The main job's recipe, cut to a few steps: it must build, train and checkpoint.
    result = tidal(
        "train",
        "--recipe",
        "demo",
        "--no-plots",
        "--set",
        f"run_dir={tmp_path / 'demo'}",
        "--set",
        "training.steps=3",
        "--set",
        "training.val_batches=1",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo" / "checkpoints" / "step_00000003").is_dir()


def test_a_device_budget_below_the_activations_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--recipe", "demo", "--no-plots",
                 "--set", f"run_dir={tmp_path / 'demo'}", "--set", "memory.device_budget=8MiB"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "memory.device_budget: 8,388,608 bytes (8.00MiB) is too small" in err
    assert "activations" in err and "Traceback" not in err
    assert not (tmp_path / "demo" / "checkpoints").exists()


def test_models_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    models = capsys.readouterr().out
    assert "gpt2-small" in models and "124,439,808" in models and "gpt3-175b" in models
    for args, wanted in ((["--help"], ("train", "report", "models")),
                         (["train", "--help"], ("--recipe", "--set", "--resume", "--overwrite"))):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:  # argparse's help exits 0
            main(args)
        assert exit_.value.code == 0
        help_text = capsys.readouterr().out
        for word in wanted:
            assert word in help_text


def test_version_names_tidal_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    import platform

    import tomllib
    import torch

    import tidal

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert tidal.__version__ == version  # the package's one version, as pyproject has it
    torch_version = torch.__version__.split("+")[0]
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"tidal {version} (torch {torch_version}")
    assert out.endswith(f"Python {platform.python_version()})")


def test_the_bench_programs_name_the_same_options_alike() -> None:
    """Issue 17 found --out beside --results-dir and --warmup beside --warmup-steps."""
    from tidal.cli.args import build_parser

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(action.choices)

    benches = subcommands(subcommands(build_parser())["bench"])
    assert set(benches) >= {"train", "offload", "dp", "plan", "pipemare", "pipeline", "compat"}
    for name, parser in benches.items():
        options = {s for a in parser._actions for s in a.option_strings}
        assert "--results-dir" in options, name
        primary = {a.option_strings[0] for a in parser._actions if a.option_strings}
        assert not primary & {"--out", "--warmup", "--results", "--output"}, (name, primary)
