"""A rank killed mid-run under ``tidal train --nproc 2`` ends the job, naming the rank.

The fault comes from ``TIDAL_FAULT_INJECT`` (tidal/distributed/faults.py), a testing aid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from command_ranks import run_command_on_ranks

from tidal.config import ConfigError
from tidal.distributed.faults import Fault, maybe_inject, parse_fault
from tidal.train.checkpoint import list_checkpoints
from tidal.train.integrity import choose_checkpoint

REPO = Path(__file__).resolve().parents[2]

# Four steps of the tiny model on synthetic tokens, no checkpoint.
TINY_RUN = [
    "--recipe", "tiny", "--no-plots",
    "--set", "data.source=synthetic", "--set", "data.synthetic_num_tokens=20000",
    "--set", "training.steps=4", "--set", "training.val_batches=1",
    "--set", "training.log_every=1", "--set", "training.device=cpu",
    "--set", "checkpoint.every_steps=0", "--set", "checkpoint.at_end=false",
]  # fmt: skip

BOUND_S = 60.0


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TIDAL_FAULT_INJECT": "kill:rank=1:step=2",
        "TIDAL_HEARTBEAT_S": "0.1",
        "TIDAL_DEAD_AFTER_S": "3",  # a loaded machine stalls for a second or two
    }
    run_dir = tmp_path / "run"
    argv = ["train", "--nproc", "2", *TINY_RUN, "--set", f"run_dir={run_dir}",
            "--set", "checkpoint.every_steps=1"]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tidal", *argv],
        capture_output=True,
        text=True,
        timeout=2 * BOUND_S,  # a hang fails here rather than holding the suite
        cwd=REPO,
        env=env,
        check=False,
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    # A dead rank, whoever names it: the code that says resume (docs/multinode.md).
    assert result.returncode == 75, output
    assert elapsed < BOUND_S, output
    # Named either by the launcher (the agent saw the SIGKILL and stopped rank 0) or by rank 0's
    # watchdog, whichever comes first; in one line, without torchrun's report.
    named_by_launcher = "tidal: rank 1 was killed by SIGKILL" in output
    assert named_by_launcher or "tidal: rank 1 stopped responding" in output, output
    assert "Traceback" not in output and "Root Cause" not in output, output
    assert "step 1/4" in output and "step 2/4" not in output, output
    assert [step for step, _ in list_checkpoints(run_dir)] == [1]  # what was saved is kept
    assert choose_checkpoint(list_checkpoints(run_dir), step=None)[1] == []  # and intact


@pytest.mark.slow
def test_a_killed_rank_under_max_restarts_resumes_and_ends_as_an_unbroken_run(
    tmp_path: Path,
) -> None:
    """``--max-restarts 1``: rank 1 is killed as step 3 begins; torchrun's agent restarts both
    ranks, which resume from step 2's checkpoint by themselves (--resume auto) and finish with
    the losses of a run that was never killed. --overwrite meant the first attempt only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_HEARTBEAT_S": "0.1",
           "TIDAL_DEAD_AFTER_S": "1.5"}  # fmt: skip
    run = [*TINY_RUN[:-4], "--set", "checkpoint.every_steps=2", "--set", "engine=chunk"]

    def train(run_dir: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess[str]:
        argv = ["train", "--nproc", "2", *run, "--set", f"run_dir={run_dir}", *extra]
        return subprocess.run([sys.executable, "-m", "tidal", *argv], capture_output=True,
                              text=True, timeout=4 * BOUND_S, cwd=REPO, check=False,
                              env={**env, "TIDAL_FAULT_INJECT": fault} if fault else env)  # fmt: skip

    killed = train(tmp_path / "killed", "--max-restarts", "1", "--overwrite",
                   fault="kill:rank=1:step=3")  # fmt: skip
    output = killed.stdout + killed.stderr
    assert killed.returncode == 0, output
    assert "tidal: a rank failed; restart 1 of 1, from the last complete checkpoint" in output, (
        output
    )
    assert "Traceback" not in output and "connectFullMesh" not in output, output
    # the same ranks never killed, forked from the test's fork server (three processes fewer
    # to start than a launch)
    unbroken = [*run, "--set", f"run_dir={tmp_path / 'unbroken'}"]
    run_command_on_ranks(unbroken, world_size=2, timeout_s=BOUND_S)
    summaries = [json.loads((tmp_path / r / "summary.json").read_text())
                 for r in ("killed", "unbroken")]  # fmt: skip
    assert summaries[0]["resumed_from_step"] == 2 and summaries[0]["steps"] == 4
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]
    losses = [[(r["step"], r.get("loss")) for r in _records(tmp_path / r)]
              for r in ("killed", "unbroken")]  # fmt: skip
    assert losses[0] == losses[1]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fault_specs_parse_or_name_the_variable() -> None:
    assert parse_fault("kill:rank=1:step=2") == Fault(action="kill", rank=1, step=2)
    assert parse_fault("raise:step=7:rank=0") == Fault(action="raise", rank=0, step=7)
    for spec, problem in [
        ("explode:rank=1:step=2", "unknown action 'explode'"),
        ("kill:rank=1", "needs both rank=N and step=N"),
        ("kill:rank=one:step=2", "'rank=one' in"),
        ("kill:rank=1:step=2:rank=3", "'rank=3' in"),
    ]:
        with pytest.raises(ConfigError, match=f"TIDAL_FAULT_INJECT: .*{problem}"):
            parse_fault(spec)


def test_a_fault_fires_on_its_rank_and_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    maybe_inject(1)  # unset: nothing
    monkeypatch.setenv("TIDAL_FAULT_INJECT", "raise:rank=1:step=2")
    maybe_inject(2)  # one process is rank 0
    monkeypatch.setenv("TIDAL_FAULT_INJECT", "raise:rank=0:step=2")
    maybe_inject(1)
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at step 2"):
        maybe_inject(2)
