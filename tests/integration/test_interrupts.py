"""Ctrl-C (or SIGTERM) at any moment of a chunk-engine run: exit 130, one line, a checkpoint of the step it
stopped after, and a resume equal to the run that was never interrupted ([Note: interrupts at
safe points] in tidal/train/interrupts.py)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from tidal.testing.dist import process_context
from tidal.train import Trainer
from tidal.train.checkpoint import list_checkpoints
from tidal.train.metrics import read_metrics

STEPS = 30
OVERRIDES = [
    "engine=chunk",
    "chunk.size=128",
    "memory.device_budget=4608KiB",  # evictions: a signal may land while chunks move
    "training.grad_accum_steps=2",
    "training.val_every=0",
    "training.log_every=1",
    "checkpoint.every_steps=0",
    "checkpoint.at_end=false",
    "optimizer.decay_steps=30",
    "metrics.peak_tflops=1.0",
]


def _train_in_child(run_dir: str, err_path: str) -> None:
    """A process running ``tidal train`` as the command does, its stderr into ``err_path``."""
    from tidal.cli.main import main

    with open(err_path, "w") as err, open(os.devnull, "w") as out:
        os.dup2(err.fileno(), 2)
        os.dup2(out.fileno(), 1)  # the progress lines
    sets = [arg for o in [*OVERRIDES, f"run_dir={run_dir}", f"training.steps={STEPS}"]
            for arg in ("--set", o)]  # fmt: skip
    code = main(["train", "--recipe", "tiny", "--no-plots", *sets])
    sys.stderr.flush()
    os._exit(code)


def _wait_for_step(run_dir: Path, step: int, child: object, timeout_s: float = 120) -> None:
    """Until ``run_dir``'s metrics.jsonl holds ``step`` records (or the child has ended)."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while time.monotonic() < deadline and child.is_alive():  # type: ignore[attr-defined]
        if path.is_file() and path.read_bytes().count(b"\n") >= step:
            return
        time.sleep(0.002)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r["kind"] == "train"]


@pytest.mark.slow
def test_sigint_or_sigterm_at_random_moments_exits_130_in_one_line_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    whole = tmp_path / "whole"
    Trainer("tiny", [*OVERRIDES, f"run_dir={whole}", f"training.steps={STEPS}"]).fit()
    want = _losses(whole)
    ctx = process_context()
    rng = random.Random(0)
    stopped: dict[int, Path] = {}  # the step a trial stopped after -> its run folder
    interrupted = 0
    for trial in range(20):  # the 20 trials: at most 20 processes of 30 steps
        run_dir, err_path = tmp_path / f"trial{trial}", tmp_path / f"trial{trial}.err"
        child = ctx.Process(target=_train_in_child, args=(str(run_dir), str(err_path)))
        child.start()
        # Some while the engine is built, the rest at a random point of a random step: counted
        # in the steps logged, so a slow (or loaded) machine spreads them as a fast one does.
        if trial % 7 == 0:
            while not err_path.exists() and child.is_alive():  # the command has started
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            _wait_for_step(run_dir, rng.randint(1, 12), child)
            time.sleep(rng.uniform(0.0, 0.03))
        sent = signal.SIGTERM if trial % 5 == 4 else signal.SIGINT  # what a scheduler sends
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sent)
        child.join(timeout=120)
        lines = err_path.read_text().strip().splitlines()
        if child.exitcode == 0:  # it finished first: the signal came too late to count
            assert _losses(run_dir) == want and lines == [], (trial, lines)
            continue
        interrupted += 1
        assert child.exitcode == 130, (trial, child.exitcode, lines)
        assert len(lines) == 1 and lines[0].startswith("tidal: interrupted"), (trial, lines)
        if "before anything started" in lines[0]:  # while the command was parsing its flags
            assert not run_dir.exists(), (trial, lines)
            continue
        checkpoints = list_checkpoints(run_dir)
        if "after step" in lines[0]:  # stopped while training: a checkpoint of that step
            step = checkpoints[-1][0]
            assert [s for s, _ in checkpoints] == [step] and f"after step {step};" in lines[0]
            assert lines[0].startswith(f"tidal: interrupted by {sent.name} after step")
            stopped.setdefault(step, run_dir)
        else:  # before the first step: nothing to keep
            assert checkpoints == [], (trial, lines)
    assert interrupted >= 15 and len(stopped) >= 4, (interrupted, stopped)
    # Four of the steps stopped after, first and last among them: a resume's mechanics do not
    # depend on the step (test_resume.py holds every engine to that), the state it reads does.
    steps = sorted(stopped)
    for step in sorted({steps[round(i * (len(steps) - 1) / 3)] for i in range(4)}):
        run_dir = stopped[step]
        Trainer("tiny", [*OVERRIDES, f"run_dir={run_dir}", f"training.steps={STEPS}"]).fit(
            resume=True
        )
        assert _losses(run_dir) == want, step  # bit for bit, floats compared with ==


def test_ctrl_c_while_the_command_imports_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After parsing, the command imports what it handles errors with; a Ctrl-C landing there
    (a random-moment trial once did) is still one line and exit 130, not a traceback."""
    from tidal.cli import main as cli

    def interrupted(_args: object) -> tuple[type[Exception], ...]:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_plan_errors", interrupted)
    try:
        code = cli.main(["models"])
    except KeyboardInterrupt:  # not the test run's own Ctrl-C: fail this test alone
        pytest.fail("a Ctrl-C while the command imports escaped main as a traceback")
    assert code == 130
    assert capsys.readouterr().err.strip() == "tidal: interrupted before anything started"
