"""What a user can type ends in one line on stderr, the right exit code, and nothing saved lost
(issue 49): each defect fed to ``tidal train`` in this process, as test_cli.py runs it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.config import ConfigError
from tidal.train import Trainer
from tidal.train.engine_state import PipelineStages
from tidal.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

# The tiny model on synthetic tokens, a checkpoint after every step.
TINY = [
    "--recipe", "tiny", "--no-plots",
    "--set", "data.source=synthetic", "--set", "data.synthetic_num_tokens=20000",
    "--set", "training.val_every=0", "--set", "training.val_batches=1",
    "--set", "training.log_every=1", "--set", "training.device=cpu",
    "--set", "checkpoint.every_steps=1",
]  # fmt: skip


def _train(run_dir: Path, *sets: str, steps: int, flags: tuple[str, ...] = ()) -> int:
    overrides = [arg for s in (f"run_dir={run_dir}", f"training.steps={steps}", *sets)
                 for arg in ("--set", s)]  # fmt: skip
    return main(["train", *TINY, *flags, *overrides])


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    return lines[0]


def _saved(run_dir: Path) -> dict[str, bytes]:
    root = run_dir / "checkpoints"
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _least(line: str, before: str) -> int:
    """The byte count the line names right after ``before``."""
    match = re.search(re.escape(before) + r" ([0-9,]+) bytes", line)
    assert match is not None, line
    return int(match.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 steps (reference engine), its checkpoints what the errors must not lose."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert _train(run_dir, steps=2) == 0
    return run_dir


@pytest.fixture
def resumable(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def test_a_chunk_budget_below_every_module_names_a_budget_that_trains(
    resumable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _saved(resumable)
    flags = ("--resume",)
    chunk = ("engine=chunk", "chunk.size=4096")
    assert _train(resumable, *chunk, "memory.device_budget=1KiB", steps=4, flags=flags) == 2
    line = _one_line(capsys)
    assert line.startswith("tidal: error: memory.device_budget: 1,024 bytes"), line
    assert _saved(resumable) == before
    least = _least(line, "needs at least")
    assert _train(resumable, *chunk, f"memory.device_budget={least}", steps=4, flags=flags) == 0
    assert [r["step"] for r in read_metrics(resumable) if r["kind"] == "train"] == [1, 2, 3, 4]


def test_a_host_budget_too_small_without_nvme_names_the_least_and_nvme_dir(
    resumable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _saved(resumable)
    flags = ("--resume",)
    chunk = ("engine=chunk", "memory.device_budget=3MiB")
    assert _train(resumable, *chunk, "memory.host_budget=1MiB", steps=3, flags=flags) == 2
    line = _one_line(capsys)
    assert line.startswith("tidal: error: memory.host_budget: 1,048,576 bytes"), line
    assert "memory.nvme_dir" in line
    assert _saved(resumable) == before
    least = _least(line, "Raise it to at least")
    assert _train(resumable, *chunk, f"memory.host_budget={least}", steps=3, flags=flags) == 0


def test_the_reference_engine_over_its_budget_suggests_the_chunk_engine(
    resumable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _saved(resumable)
    assert _train(resumable, "memory.device_budget=1MiB", steps=3, flags=("--resume",)) == 2
    line = _one_line(capsys)
    assert line.startswith("tidal: error: memory.device_budget: the reference engine"), line
    assert 'set engine = "chunk" (--set engine=chunk)' in line
    assert _saved(resumable) == before


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (["--set", "memory.device_budget=-1MiB"],
         "tidal: error: memory.device_budget: a size cannot be negative, got '-1MiB'"),
        (["--set", "memory.device_budget=lots"],
         "tidal: error: memory.device_budget: expected a size such as '512MiB' or '2GB' (units: "
         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or one of 'auto', got 'lots'"),
        (["--pipeline-stages", "1"],
         "tidal: error: --pipeline-stages: must be >= 2 (one process per stage), got 1; without "
         "it the run trains without a pipeline"),
    ],
)  # fmt: skip
def test_a_value_is_one_clear_message(
    args: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--recipe", "tiny", *args]) == 2
    assert _one_line(capsys) == want


def test_a_misspelt_recipe_gets_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--recipe", "tinny"]) == 2
    assert _one_line(capsys).endswith("(known: cnn-tiny, demo, gpt2-small, llama-tiny, tiny); "
                                      "did you mean 'tiny'?")  # fmt: skip


def _interrupt_at_once(*_args: object, **_kwargs: object) -> None:
    raise KeyboardInterrupt  # the second Ctrl-C: raised wherever the run is


def test_a_ctrl_c_at_once_before_any_checkpoint_says_nothing_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(Trainer, "fit", _interrupt_at_once)
    assert _train(tmp_path / "run", steps=2) == 130
    assert _one_line(capsys) == (
        "tidal: interrupted; no checkpoint was written, so there is nothing to resume; run the "
        "command again to start over"
    )


def test_a_ctrl_c_at_once_names_the_checkpoint_to_resume_from(
    resumable: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _saved(resumable)
    monkeypatch.setattr(Trainer, "fit", _interrupt_at_once)
    assert _train(resumable, steps=4, flags=("--resume",)) == 130
    latest = resumable / "checkpoints" / "step_00000002"
    assert _one_line(capsys) == (
        f"tidal: interrupted; the last checkpoint, {latest}, is intact (continue with --resume)"
    )
    assert _saved(resumable) == before


def test_an_asynchronous_pipeline_refuses_an_engines_checkpoint_saying_what_each_is() -> None:
    """A synchronous pipeline resumes from an engine's checkpoint (test_pipeline_mesh.py);
    PipeMare's stages would need weight versions the engine never had."""
    split = {"schedule": "pipemare", "block_ranges": [[0, 1], [1, 2]]}
    stages = PipelineStages(runtime=None, layout={}, split=split)
    with pytest.raises(ConfigError) as err:
        stages.restore_checkpoint(lambda targets: None, {"global_step": 2, "micro_step": 2}, {})
    assert str(err.value) == (
        "pipeline: the checkpoint was trained without a pipeline, this run is a pipemare "
        "pipeline of 2 stages (blocks [0, 1), [1, 2)), whose stages would need weight versions "
        "it does not have; resume it with a synchronous schedule (gpipe, 1f1b, interleaved) or "
        "without --pipeline-stages (and [parallel] pp = 1)"
    )


def test_an_asynchronous_pipeline_resumes_on_its_own_split_only() -> None:
    """[Note: resuming on another split]: PipeMare's stages keep versions and delays of their
    own blocks, so its checkpoint does not resume on another split, said in one line."""
    split = {"schedule": "pipemare", "block_ranges": [[0, 1], [1, 2]]}
    other = {"schedule": "pipemare", "block_ranges": [[0, 2], [2, 4]]}
    stages = PipelineStages(runtime=None, layout={}, split=split)
    with pytest.raises(ConfigError) as err:
        stages.restore_checkpoint(lambda targets: None, {"global_step": 2, "split": other}, {})
    assert str(err.value) == (
        "pipeline: the checkpoint was trained as a pipemare pipeline of 2 stages (blocks [0, 2), "
        "[2, 4)), this run is a pipemare pipeline of 2 stages (blocks [0, 1), [1, 2)); an "
        "asynchronous pipeline resumes with the same [pipeline] settings (or without "
        "--pipeline-stages, or export it with `tidal export RUN_DIR`)"
    )


@pytest.mark.slow
def test_a_pipelines_checkpoint_resumes_in_every_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two stages train 2 steps (two processes, as a user runs them); the reference and the chunk
    engine go on from its checkpoint with the losses of a run that never changed engine."""
    pipeline = tmp_path / "pipeline"
    overrides = [arg for s in (f"run_dir={pipeline}", "training.steps=2")
                 for arg in ("--set", s)]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "tidal", "train", *TINY, *overrides,
                             "--pipeline-stages", "2"], capture_output=True, text=True,
                            timeout=300, cwd=REPO, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _train(tmp_path / "whole", steps=4) == 0
    want = [r["loss"] for r in read_metrics(tmp_path / "whole") if r["kind"] == "train"]
    for engine in ("reference", "chunk"):
        run_dir = tmp_path / engine
        shutil.copytree(pipeline, run_dir)
        assert _train(run_dir, f"engine={engine}", steps=4, flags=("--resume",)) == 0, engine
        losses = [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]
        assert losses == pytest.approx(want, rel=1e-5), engine
    assert "Traceback" not in capsys.readouterr().err
