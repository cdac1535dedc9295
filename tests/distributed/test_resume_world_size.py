"""Sharded checkpoints of the chunk engine resume on another world size (2 -> 1, 1 -> 2).

A one-process chunk-engine run of 8 steps is the reference. The same job trained for 4 steps on
2 ranks (sharded) and resumed on 1 process, or trained on 1 and resumed on 2, must continue
with the same losses (1e-5 relative) and end with the same parameters; the checkpoint also
reads back whole in one process (what `tidal export` uses).
"""

from __future__ import annotations

import copy
import errno
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import (
    CheckpointWriteError,
    latest_checkpoint,
    list_checkpoints,
    load_model_state,
)
from tidal.train.export import export_run, load_export
from tidal.train.metrics import read_metrics

STEPS, HALF = 8, 4
RTOL = 1e-5

JOB: dict[str, Any] = {
    "name": "resume-ws",
    "engine": "chunk",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,
        "device": "cpu",
        "log_every": 1,
        "val_every": 0,
        "val_batches": 1,
    },  # fmt: skip
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "chunk": {"size": 128},
    "checkpoint": {"every_steps": HALF, "keep": 3},
    "metrics": {"peak_tflops": 1.0},
}


def _job(run_dir: Path, **memory: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["memory"] = memory
    return job


def _fit(job: dict[str, Any], steps: int, resume: bool) -> list[str]:
    """Train; returns every warning the run raised (issue 23: none of DCP's deprecations)."""
    job = copy.deepcopy(job)
    job["training"]["steps"] = steps
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(job).fit(resume=resume, overwrite=not resume)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen]


def _fit_and_logits(job: dict[str, Any], steps: int) -> torch.Tensor:
    """Train on the ranks, then the logits on a fixed batch of the weights the run holds (its
    one chunk stage's, gathered from the ZeRO-3 shards on every rank)."""
    from tidal.models import build_gpt

    job = copy.deepcopy(job)
    job["training"]["steps"] = steps
    trainer = Trainer(job)
    trainer.fit(overwrite=True)
    weights = trainer.engine.model_state_dict()  # type: ignore[attr-defined]
    model = build_gpt(trainer.model_config)  # type: ignore[arg-type]
    loaded = model.load_state_dict(weights, strict=False)  # a tied weight under its first name
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys, loaded
    with torch.no_grad():
        return model.eval()(EXPORT_BATCH).detach().clone()


EXPORT_BATCH = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def _assert_continues(run_dir: Path, reference: Path) -> None:
    got, want = _losses(run_dir), _losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]), (step, got, want)
    got_state = load_model_state(latest_checkpoint(run_dir))
    want_state = load_model_state(latest_checkpoint(reference))
    assert got_state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one-process")
    _fit(_job(run_dir), STEPS, resume=False)
    return run_dir


@pytest.mark.slow
def test_two_ranks_then_one(tmp_path: Path, reference: Path) -> None:
    job = _job(tmp_path)
    seen = run_on_ranks(_fit, world_size=2, args=(job, HALF, False), timeout_s=180)
    assert seen == [
        [],
        [],
    ]  # a sharded save warns of nothing (it used ShardedTensor's deprecated API)
    meta = (latest_checkpoint(tmp_path) / "meta.json").read_text()
    assert '"world_size": 2' in meta
    assert len(list((latest_checkpoint(tmp_path) / "state").glob("*.distcp"))) == 2  # per rank
    _fit(job, STEPS, resume=True)
    _assert_continues(tmp_path, reference)


@pytest.mark.slow
def test_one_rank_then_two_under_a_budget(tmp_path: Path, reference: Path) -> None:
    # The resumed part also runs under a device budget that forces gathers to be evicted.
    job = _job(tmp_path)
    _fit(job, HALF, resume=False)
    tight = _job(tmp_path, device_budget="2MiB")
    seen = run_on_ranks(_fit, world_size=2, args=(tight, STEPS, True), timeout_s=180)
    assert seen == [[], []]  # nor does a sharded load
    _assert_continues(tmp_path, reference)


@pytest.mark.slow
def test_two_ranks_on_disk_then_one_on_disk(tmp_path: Path, reference: Path) -> None:
    """Host memory for little more than staging on both sides: most shards live on the NVMe
    tier, and the checkpoint reads and writes their pieces there ([Note: checkpoint pieces on
    disk]), under another chunk layout on each side (the alignment follows the world size)."""
    nvme_dir = str(tmp_path / "nvme")
    run_on_ranks(_fit, world_size=2, timeout_s=180,
                 args=(_job(tmp_path, host_budget=600_000, nvme_dir=nvme_dir), HALF, False))  # fmt: skip
    job = _job(tmp_path, host_budget=1_200_000, nvme_dir=nvme_dir)
    _fit(job, STEPS, resume=True)
    _assert_continues(tmp_path, reference)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["param_shards_on_nvme"] > 0 and summary["peak_host_bytes"] <= 1_200_000


def test_a_full_disk_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path)
    _fit(job, HALF, resume=False)
    before = list_checkpoints(tmp_path)

    def full_disk(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("tidal.train.checkpoint.write_tensor_file", full_disk)
    with pytest.raises(
        CheckpointWriteError, match=r"No space left on device.*step_00000004 is intact"
    ):
        _fit(job, STEPS, resume=True)
    assert list_checkpoints(tmp_path) == before
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    load_model_state(before[-1][1])  # still whole


def test_export_of_a_sharded_run_gives_the_engines_logits(tmp_path: Path) -> None:
    logits = run_on_ranks(_fit_and_logits, world_size=2, args=(_job(tmp_path), HALF),
                          timeout_s=180)  # fmt: skip
    assert torch.equal(logits[0], logits[1])
    model = load_export(export_run(tmp_path, out=tmp_path / "exported"))
    with torch.no_grad():
        torch.testing.assert_close(model(EXPORT_BATCH), logits[0], rtol=0, atol=1e-6)
