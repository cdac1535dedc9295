"""The run folder, checked before the first step: one folder for every rank, and one that
holds checkpoints only when the run resumes or overwrites them (:func:`check_run_dir`).

[Note: one run folder]
Every rank writes its shard of each checkpoint into ``run_dir`` and rank 0 commits the folder
([Note: atomic checkpoints] in checkpoint.py), so ``run_dir`` must be one folder for all ranks:
on one machine, or on a filesystem every machine mounts. On machine-local disks each machine
would keep only its own shards and rank 0 would commit checkpoints missing the others'. At start
(:func:`check_one_run_dir`) each rank writes a marker named by a token rank 0 chose, and every
rank looks for every other rank's; a rank that does not see them all names itself and what it
misses, and every rank raises the same error (the check is collective, so no rank goes on to
wait for a peer that stopped). A checkpoint is still confirmed shard by shard at commit time
([Note: confirmed shards] in checkpoint.py), should the filesystem change under a run.

Refusals before the first step are collective for the same reason (:func:`agree`): a check that
fails on one rank only (its disk holds no checkpoint to resume) fails on every rank.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from tidal.config import ConfigError
from tidal.train.checkpoint import list_checkpoints

__all__ = ["agree", "check_one_run_dir", "check_run_dir"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(check: Callable[[], None]) -> None:
    """Run ``check`` on every rank; if it raised :class:`ConfigError` on any, raise the first
    such error on all of them."""
    error: ConfigError | None = None
    try:
        check()
    except ConfigError as err:
        error = err
    if not _distributed():
        if error is not None:
            raise error
        return
    found: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else (error.key, error.message))
    for rank, said in enumerate(found):
        if said is not None:
            key, message = said
            raise ConfigError(key, message if rank == 0 else f"(rank {rank}) {message}")


def check_one_run_dir(run_dir: Path) -> None:
    """Refuse a ``run_dir`` that is not one folder for every rank ([Note: one run folder])."""
    if not _distributed():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    box = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    token = box[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    mine = run_dir / f".tidal-rank-{token}-{rank}"
    mine.write_text(socket.gethostname())
    dist.barrier()  # every marker written before any rank looks
    unseen = [r for r in range(world_size) if not (run_dir / f".tidal-rank-{token}-{r}").exists()]
    views: list[tuple[str, list[int]] | None] = [None] * world_size
    dist.all_gather_object(views, (socket.gethostname(), unseen))
    dist.barrier()  # every rank looked before any removes its marker
    mine.unlink(missing_ok=True)
    for r, view in enumerate(views):
        assert view is not None, "all_gather_object fills every rank's entry"
        host, missing = view
        if missing:
            ranks = ", ".join(map(str, missing))
            raise ConfigError(
                "run_dir",
                f"{run_dir} is not one folder for all ranks: rank {r} (on {host}) does not see "
                f"what rank(s) {ranks} wrote there; put run_dir on a filesystem every machine "
                f"mounts (NFS, Lustre, a shared volume), at the same path on each",
            )


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a run that would clobber checkpoints or has none to resume from."""
    if resume and overwrite:
        raise ConfigError("", "--resume and --overwrite contradict each other; pick one")
    existing = list_checkpoints(run_dir)
    if existing and not resume and not overwrite:
        raise ConfigError(
            "run_dir",
            f"{run_dir} already holds checkpoints up to step {existing[-1][0]}; pass "
            f"--resume to continue that run, --overwrite to start over (deletes them), or "
            f"--set run_dir=PATH for a new folder",
        )
    if resume and not existing:
        raise ConfigError(
            "run_dir",
            f"--resume: no checkpoint under {run_dir / 'checkpoints'}; run without "
            f"--resume to start a new run",
        )
