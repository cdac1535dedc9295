"""Exact resumption: split runs equal one run, and a kill mid-checkpoint loses nothing saved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tidal.testing.trees import assert_equal_tree
from tidal.train import Trainer
from tidal.train.checkpoint import list_checkpoints, load_checkpoint, read_tensors
from tidal.train.metrics import read_metrics

# Dropout on, so that restoring torch's RNG state is part of what is tested; accumulation on, so
# that the micro-batch counter is too.
COMMON = [
    "model.dropout=0.1",
    "optimizer.decay_steps=20",
    "training.grad_accum_steps=2",
    "training.val_every=5",
    "training.log_every=5",
    "checkpoint.every_steps=0",
    "metrics.peak_tflops=1.0",
]


def _run(run_dir: Path, steps: int, *, resume: bool = False, extra: tuple[str, ...] = ()) -> dict:
    overrides = [*COMMON, f"run_dir={run_dir}", f"training.steps={steps}", *extra]
    return Trainer("tiny", overrides).fit(resume=resume)


def _records(run_dir: Path, kind: str, *fields: str) -> list[tuple]:
    return [
        tuple(r[f] for f in ("step", *fields)) for r in read_metrics(run_dir) if r["kind"] == kind
    ]


def _assert_same_state(a: Path, b: Path) -> None:
    ckpt_a = load_checkpoint(list_checkpoints(a)[-1][1])
    ckpt_b = load_checkpoint(list_checkpoints(b)[-1][1])
    assert ckpt_a.step == ckpt_b.step
    assert_equal_tree(ckpt_a.train_state["engine"], ckpt_b.train_state["engine"])
    # Every engine writes the one format: every model and optimizer tensor by key.
    tensors_a, tensors_b = read_tensors(ckpt_a.path), read_tensors(ckpt_b.path)
    assert tensors_a.keys() == tensors_b.keys() and tensors_a
    assert any(key.startswith("optim/") for key in tensors_a)
    for key, tensor in tensors_a.items():
        assert torch.equal(tensor, tensors_b[key]), key


ENGINES = {
    "reference": (),
    # Parameters in 23 small chunks under a budget (activations included) that forces evictions.
    "chunk": ("engine=chunk", "chunk.size=128", "memory.device_budget=4608KiB"),
    # bf16 parameter chunks: resuming must restore the fp32 masters, not the bf16 copies.
    "chunk-bf16": (
        "engine=chunk",
        "chunk.size=128",
        "memory.device_budget=4608KiB",
        "training.precision=bf16",
    ),
    # bf16 with the NVMe tier on one process, host memory for little more than staging: most
    # parameter, gradient, master and moment shards live on disk, and the checkpoint reads and
    # writes their pieces there ([Note: checkpoint pieces on disk]) within the host budget.
    "chunk-nvme": (
        "engine=chunk",
        "chunk.size=128",
        "memory.device_budget=4608KiB",
        "memory.host_budget=1200000",
        f"memory.nvme_dir={tempfile.gettempdir()}/tidal-test-resume-nvme",
        "training.precision=bf16",
    ),
    # fp16: the dynamic loss scale is part of what a checkpoint restores.
    "chunk-fp16": (
        "engine=chunk",
        "chunk.size=128",
        "memory.device_budget=4608KiB",
        "training.precision=fp16",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_twenty_steps_equal_ten_plus_resume_plus_ten(tmp_path: Path, engine: str) -> None:
    extra = ENGINES[engine]
    whole = _run(tmp_path / "whole", 20, extra=extra)
    _run(tmp_path / "split", 10, extra=extra)
    split = _run(tmp_path / "split", 20, resume=True, extra=extra)

    losses = _records(tmp_path / "whole", "train", "loss", "grad_norm", "lr")
    assert [r[0] for r in losses] == list(range(1, 21))
    # Bit for bit: floats compared with ==, not a tolerance.
    assert _records(tmp_path / "split", "train", "loss", "grad_norm", "lr") == losses
    assert _records(tmp_path / "split", "val", "val_loss") == _records(
        tmp_path / "whole", "val", "val_loss"
    )
    assert split["final_loss"] == whole["final_loss"]
    assert split["resumed_from_step"] == 10 and split["tokens"] == whole["tokens"]
    assert whole["engine"] == {"chunk-nvme": "chunk-sharded"}.get(engine, engine.split("-")[0])
    if engine.startswith("chunk"):
        assert whole["evictions"] > 0 and whole["peak_device_bytes"] <= 4608 * 1024
    if engine == "chunk-nvme":
        assert whole["param_shards_on_nvme"] > 0 and whole["peak_host_bytes"] <= 1_200_000
    _assert_same_state(tmp_path / "whole", tmp_path / "split")
    # Resuming a finished run trains nothing and keeps the summary of the runs that trained.
    kept = (tmp_path / "split" / "summary.json").read_text()
    again = _run(tmp_path / "split", 20, resume=True, extra=extra)
    assert again == split and (tmp_path / "split" / "summary.json").read_text() == kept
    assert again["tokens_per_s"] is not None and again["final_loss"] == whole["final_loss"]
    # The loss fell: the run trained at all.
    assert losses[-1][1] < losses[0][1] - 1.0


_KILLED_WRITER = textwrap.dedent(
    """
    import importlib, sys, time
    from pathlib import Path
    from tidal.train import Trainer

    run_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])
    ckpt = importlib.import_module(sys.argv[3])  # the module whose file writes are torn
    torn_call = int(sys.argv[4])
    real_write = ckpt.write_tensor_file
    calls = []

    def write_then_hang(obj, path):
        calls.append(path)
        size = real_write(obj, path)
        if len(calls) == torn_call:  # a file of the second checkpoint
            with open(path, "r+b") as f:
                f.truncate(size // 2)  # a torn file, as a kill mid-write leaves it
            marker.touch()
            time.sleep(600)
        return size

    ckpt.write_tensor_file = write_then_hang
    overrides = sys.argv[5:] + [f"run_dir={run_dir}"]
    Trainer("tiny", overrides).fit()
    """
)


# (module whose writes are torn, which call, overrides): every engine's train_state.pt of the
# second checkpoint, after every rank wrote its DCP pieces.
KILLED = {
    "reference": ("tidal.train.checkpoint", 2, ()),
    "chunk": ("tidal.train.checkpoint", 2, ENGINES["chunk"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", KILLED)
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(
    tmp_path: Path, engine: str
) -> None:
    run_dir, marker = tmp_path / "killed", tmp_path / "writing"
    module, torn_call, extra = KILLED[engine]
    overrides = [*COMMON, "training.steps=10", "checkpoint.every_steps=5", *extra]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _KILLED_WRITER,
            str(run_dir),
            str(marker),
            module,
            str(torn_call),
            *overrides,
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer never reached the second checkpoint"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    # The torn write is in a temporary folder; the complete checkpoint of step 5 is the latest.
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert any(name.startswith(".tmp-step_00000010") for name in leftovers), leftovers
    assert [step for step, _ in list_checkpoints(run_dir)] == [5]
    assert load_checkpoint(list_checkpoints(run_dir)[-1][1]).step == 5

    # Resuming from it gives exactly the run that was never killed, and cleans the torn folder.
    _run(run_dir, 10, resume=True, extra=("checkpoint.every_steps=5", *extra))
    _run(tmp_path / "clean", 10, extra=("checkpoint.every_steps=5", *extra))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [
        p.name for p in (tmp_path / "clean" / "checkpoints").iterdir()
    ]
    assert _records(run_dir, "train", "loss") == _records(tmp_path / "clean", "train", "loss")
    _assert_same_state(run_dir, tmp_path / "clean")


def test_resume_auto_starts_an_empty_folder_and_continues_a_saved_one(tmp_path: Path) -> None:
    """``--resume auto`` (what an elastic restart does): no checkpoint, a new run; one, resume."""
    run = tmp_path / "run"
    first = Trainer("tiny", [*COMMON, f"run_dir={run}", "training.steps=2"]).fit(resume="auto")
    assert first["resumed_from_step"] is None and first["steps"] == 2
    again = Trainer("tiny", [*COMMON, f"run_dir={run}", "training.steps=3"]).fit(resume="auto")
    assert again["resumed_from_step"] == 2 and again["steps"] == 3
    assert [r[0] for r in _records(run, "train", "step")] == [1, 2, 3]
