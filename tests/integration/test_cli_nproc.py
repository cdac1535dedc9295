"""``tidal train --nproc N``: the command relaunched through torchrun, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.distributed.launch import Nodes, torchrun_command
from tidal.testing import free_port

REPO = Path(__file__).resolve().parents[2]

# Three steps of the tiny model on synthetic tokens, one validation batch, no checkpoint.
TINY_RUN = [
    "--recipe", "tiny", "--no-plots",
    "--set", "data.source=synthetic", "--set", "data.synthetic_num_tokens=20000",
    "--set", "training.steps=3", "--set", "training.val_batches=1",
    "--set", "training.log_every=1", "--set", "training.device=cpu",
    "--set", "checkpoint.every_steps=0", "--set", "checkpoint.at_end=false",
]  # fmt: skip


def tidal(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    # One thread per rank: two ranks share this machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_nproc_2_trains_on_two_ranks_and_writes_one_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = tidal("train", "--nproc", "2", *TINY_RUN, "--set", f"run_dir={run_dir}")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(summary["peak_memory_bytes_per_rank"]) == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    # Rank 0 alone prints: one start line and one line per step.
    assert result.stdout.count("tiny: starting") == 1, result.stdout
    assert result.stdout.count("step 3/3  loss") == 1, result.stdout


@pytest.mark.slow
def test_ctrl_c_in_the_terminal_stops_both_ranks_in_one_line(tmp_path: Path) -> None:
    """[Note: one line per run] in tidal/distributed/launch.py: SIGINT to the foreground
    process group (what a terminal's Ctrl-C does) ends the run with exit 130, one ``tidal:``
    line, a checkpoint, and no traceback from torchrun's agent."""
    run_dir = tmp_path / "run"
    run = [*TINY_RUN, "--set", f"run_dir={run_dir}", "--set", "training.steps=500",
           "--set", "checkpoint.on_interrupt=true"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", "train", "--nproc", "2", *run],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group, as a shell gives a foreground job
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the first step line: both ranks are inside the loop
        lines.append(line)
        if "step   1/500" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    said = [line for line in output.splitlines() if line.startswith("tidal:")]
    assert len(said) == 1 and said[0].startswith("tidal: interrupted by SIGINT after step"), output
    assert "Traceback" not in output and "death signal" not in output, output
    step = int(said[0].split("after step ")[1].split(";")[0])
    # The checkpoint written on the way out (resuming from one on 2 ranks: test_trainer_dist.py).
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file(), output


# The next two fail before anything is launched: this process's main is the command.
def test_nproc_below_1_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--nproc", "0", *TINY_RUN, "--set", f"run_dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["tidal: error: --nproc: must be >= 1 (processes to train on), got 0"]
    assert not (tmp_path / "run").exists()


def test_nproc_with_a_batch_that_does_not_split_fails_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = [*TINY_RUN, "--set", f"run_dir={tmp_path / 'run'}", "--set", "training.batch_size=3"]
    assert main(["train", "--nproc=2", *run]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tidal: error: training.batch_size: 3 ")
    assert "torch.distributed" not in err


@pytest.mark.slow
def test_an_error_every_rank_finds_is_one_line_without_torchruns_banner(tmp_path: Path) -> None:
    """Both ranks find the budget below the minimum once they have built the model: the run
    ends in one line (not one per rank), and torchrun's OMP_NUM_THREADS banner is not shown."""
    run = [*TINY_RUN, "--set", f"run_dir={tmp_path / 'run'}", "--set", "engine=chunk",
           "--set", "memory.device_budget=1KiB"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-m", "tidal", "train", "--nproc", "2", *run],
                            capture_output=True, text=True, timeout=180, cwd=REPO, env=env,
                            check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tidal: error: memory.device_budget: 1,024 bytes"), lines


def _two_machines(run: list[str], *, numbered: bool) -> list[str]:
    """``tidal train RUN`` as two machines of one rank each on loopback; their outputs."""
    endpoint = f"127.0.0.1:{free_port()}"
    machines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tidal",
                "train",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                endpoint,
                *(["--node-rank", str(r)] if numbered else []),
                *run,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        for r in range(2)
    ]
    outputs = [m.communicate(timeout=180)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    return outputs


@pytest.mark.slow
def test_two_machines_on_loopback_train_as_one_job_equal_to_one_process(tmp_path: Path) -> None:
    """``--nnodes 2 --rdzv-endpoint HOST:PORT`` run on two "machines" (two launchers here, one
    rank each, one shared run_dir) trains one job of two ranks, equal to one process: numbered
    (``--node-rank``) for 2 of its 3 steps, then resumed by two that meet at the rendezvous."""
    run = [*TINY_RUN, "--set", f"run_dir={tmp_path / 'two'}", "--set", "engine=chunk"]
    first = [*run, "--set", "training.steps=2", "--set", "checkpoint.at_end=true"]
    _two_machines(first, numbered=True)
    outputs = _two_machines([*run, "--resume"], numbered=False)
    assert "resuming at step 2" in outputs[0] + outputs[1], outputs
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["engine"] == "chunk-sharded"
    one_run = [*TINY_RUN, "--set", f"run_dir={tmp_path / 'one'}", "--set", "engine=chunk"]
    assert main(["train", *one_run]) == 0  # one process, in this one
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_srun_tasks_join_one_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: srun tasks]: two processes with the variables srun gives two tasks of one step
    train one job of two ranks (ZeRO-3), equal to one process; without a step of several tasks
    (a batch script's own shell) the same command trains alone."""
    run = [*TINY_RUN, "--set", "engine=chunk"]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
             "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": str(free_port())}  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WORLD_SIZE"))}
    tasks = [
        subprocess.Popen(
            [sys.executable, "-m", "tidal", "train", *run, "--set", f"run_dir={tmp_path / 'two'}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={
                **base,
                **slurm,
                "SLURM_PROCID": str(r),
                "SLURM_LOCALID": str(r),
                "OMP_NUM_THREADS": "1",
            },
        )  # fmt: skip
        for r in range(2)
    ]
    outputs = [t.communicate(timeout=180)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["engine"] == "chunk-sharded", two
    # a batch script's own shell: this process, as the command (one process fewer to start)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "WORLD_SIZE"))]:
        monkeypatch.delenv(key)
    for key, value in {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                       "SLURM_JOB_NODELIST": "localhost"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    assert main(["train", *run, "--set", f"run_dir={tmp_path / 'one'}"]) == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["world_size"] == 1 and one["final_loss"] == pytest.approx(
        two["final_loss"], rel=1e-5
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2"], "--rdzv-endpoint: 2 machines need a place to meet"),
        (["--nnodes", "2", "--rdzv-endpoint", "host"], "expected HOST:PORT, got 'host'"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"], "must be in 0..1"),
    ],
)
def test_bad_machine_flags_are_one_line(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *flags, *TINY_RUN, "--set", f"run_dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_the_relaunch_drops_nproc_in_every_spelling() -> None:
    argv = ["--np", "2", "--recipe", "tiny", "--nproc=2", "--set", "a=1", "--no-plots"]
    assert torchrun_command(argv, nproc=2) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "tidal", "train", "--recipe", "tiny", "--set", "a=1", "--no-plots",
    ]  # fmt: skip


def test_the_relaunch_drops_the_machine_flags_and_names_the_rendezvous() -> None:
    argv = ["--nnodes", "2", "--rdzv-endpoint=h:29400", "--nproc-per-node", "4", "--recipe", "tiny"]
    assert torchrun_command(argv, nproc=4, nodes=Nodes(num_nodes=2, rdzv_endpoint="h:29400"))[3:] == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--nproc-per-node=4",
        "-m", "tidal", "train", "--recipe", "tiny",
    ]  # fmt: skip
    fixed = Nodes(num_nodes=2, rdzv_endpoint="h:29400", node_rank=1)
    assert torchrun_command(["--node-rank", "1"], nproc=1, nodes=fixed)[3:8] == [
        "--nnodes=2", "--node-rank=1", "--master-addr=h", "--master-port=29400", "--nproc-per-node=1",
    ]  # fmt: skip
