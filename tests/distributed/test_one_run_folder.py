"""A run_dir that is not one folder for all ranks ([Note: one run folder] in
tidal/train/run_dir.py, [Note: confirmed shards] in tidal/train/checkpoint.py): refused on
every rank before the first step, and a checkpoint whose pieces are not all in rank 0's folder is
never committed. Machine-local disks are simulated by giving each rank its own folder, or by
moving a rank's piece out of the shared one right after it was written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import CheckpointWriteError, list_checkpoints

JOB: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "engine": "chunk",
    "chunk": {"size": 20_000},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {"steps": 4, "batch_size": 4, "device": "cpu", "val_every": 0},
    "checkpoint": {"every_steps": 2},
}


def _node_local(root: str) -> str:
    rank = dist.get_rank()
    job = {**JOB, "run_dir": str(Path(root) / f"node{rank}" / "run")}
    try:
        Trainer(job).fit()
    except ConfigError as err:
        return str(err)
    raise AssertionError("a run_dir each rank sees alone was not refused")


def test_a_run_dir_each_machine_keeps_alone_is_refused_on_every_rank(tmp_path: Path) -> None:
    said = run_on_ranks(_node_local, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert said[0] == said[1].replace("node1", "node0"), said  # each names its own path
    assert "is not one folder for all ranks: rank 0 (on " in said[0], said[0]
    assert "does not see what rank(s) 1 wrote there" in said[0], said[0]
    assert not list(tmp_path.rglob("checkpoints")) and not list(tmp_path.rglob(".tidal-rank-*"))


def _piece_elsewhere(root: str) -> dict[str, Any]:
    import tidal.train.checkpoint as checkpoint

    run_dir = Path(root) / "run"
    if dist.get_rank() == 1:  # from its third step on, rank 1's pieces land on "its own disk"
        record = checkpoint.own_record

        def own_record_then_move(folder: Path, pattern: str) -> dict:
            found = record(folder, pattern)
            if "step_00000004" in str(folder) or "step_00000004" in folder.name:
                for name in found:
                    shutil.move(folder / name, Path(root) / f"rank1-{Path(name).name}")
            return found

        checkpoint.own_record = own_record_then_move
    trainer = Trainer({**JOB, "run_dir": str(run_dir)})
    try:
        trainer.fit()
    except CheckpointWriteError as err:
        return {"error": str(err), "steps": [s for s, _ in list_checkpoints(run_dir)]}
    raise AssertionError("a checkpoint missing a rank's piece was committed")


@pytest.mark.slow
def test_a_checkpoint_missing_a_ranks_piece_is_not_committed(tmp_path: Path) -> None:
    said = run_on_ranks(_piece_elsewhere, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert said[0] == said[1], said
    assert said[0]["steps"] == [2]  # step 4's was not committed; step 2's is as it was
    assert "rank 1's piece state/__1_0.distcp" in said[0]["error"], said[0]["error"]
    assert "is missing in" in said[0]["error"] and "as rank 0 sees it" in said[0]["error"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def _other_corpus(root: str) -> str:
    rank = dist.get_rank()
    data = {**JOB["data"], "synthetic_num_tokens": 20_000 + rank}  # rank 1: another corpus
    try:
        Trainer({**JOB, "data": data, "run_dir": str(Path(root) / "run")}).fit()
    except ConfigError as err:
        return str(err)
    raise AssertionError("ranks on different corpora were not refused")


def test_ranks_on_different_corpora_are_refused_before_the_first_step(tmp_path: Path) -> None:
    """[Note: same data on every rank] in tidal/train/same_data.py."""
    said = run_on_ranks(_other_corpus, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert said[0] == said[1], said
    assert said[0].startswith(
        "data: the ranks would train on different data (fingerprints ranks 0: "
    )
    assert "; ranks 1: " in said[0] and not list(tmp_path.rglob("checkpoints"))
