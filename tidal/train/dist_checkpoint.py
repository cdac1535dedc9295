"""Sharded checkpoints of the chunk engines through torch.distributed.checkpoint (format 2).

Layout of ``<run_dir>/checkpoints/step_NNNNNNNN/``::

    state/            DCP: every rank's pieces of the model and optimizer tensors ([Note:
                      checkpoint tensors] in tidal/sharding/state.py), one file per rank
    train_state.pt    written by rank 0: schedule step, data position, RNG, counters, step counts
    meta.json         written last: format 2, step, world size, tensor sizes, model shapes

[Note: atomic sharded checkpoints]
The one-process rule ([Note: atomic checkpoints] in checkpoint.py) holds across ranks: rank 0
makes the hidden temporary folder and tells every rank its name; all ranks write their pieces
into it in parallel (DCP's file writer fsyncs each file, and ``dcp.save`` raises on every rank
if any rank failed); rank 0 then writes the rest, fsyncs and renames the folder into place, and
tells every rank whether that worked. A failure anywhere, a full disk included, removes the
temporary folder and raises :class:`CheckpointWriteError` on every rank, naming the previous
checkpoint, which was never touched.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tidal.parallel.protocol import LoadTensors
from tidal.train.checkpoint import (
    _prune,
    _remove_stale_temporaries,
    _write_tensor_file,
    checkpoint_root,
    fsync_dir,
    latest_checkpoint,
    swap_into_place,
    write_json_durable,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointWriteError",
    "load_sharded_checkpoint",
    "read_model_state",
    "read_tensors",
    "save_sharded_checkpoint",
]

FORMAT_VERSION = 2


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the earlier ones are intact."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _from_rank0(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_sharded_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    tensors: dict[str, Any],
    train_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    planner: Any = None,
) -> Path:
    """Write checkpoint ``step`` from every rank; see [Note: atomic sharded checkpoints]."""
    root = checkpoint_root(run_dir)
    is_main = not _distributed() or dist.get_rank() == 0
    tmp: Path | None = None
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
        tmp.mkdir()
    tmp = Path(_from_rank0(str(tmp)))
    final = root / f"step_{step:08d}"
    error = None
    try:
        _dcp_save(tensors, tmp / "state", planner)
    except Exception as exc:  # every rank sees DCP's error: a collective one
        error = exc
    if is_main and error is None:
        try:
            sizes = {"train_state.pt": _write_tensor_file(train_state, tmp / "train_state.pt")}
            _write_meta(tmp, {"format_version": FORMAT_VERSION, "step": step,
                              "file_bytes": sizes, **meta})  # fmt: skip
            swap_into_place(tmp, final, root)
        except OSError as exc:
            error = exc
    message = _from_rank0(None if error is None else _describe(error, step, run_dir))
    if message is not None:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(message) from error
    if is_main:
        _prune(run_dir, keep)
    if _distributed():
        dist.barrier()
    return final


def _dcp_save(tensors: dict[str, Any], path: Path, planner: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sharded-tensor deprecation notices
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
                 planner=planner)  # fmt: skip


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    write_json_durable(folder / "meta.json", meta)
    fsync_dir(folder)


def _describe(error: BaseException, step: int, run_dir: str | Path) -> str:
    previous = latest_checkpoint(run_dir)
    intact = (f"the previous checkpoint {previous} is intact" if previous is not None
              else "there is no earlier checkpoint")  # fmt: skip
    return (
        f"could not write the checkpoint of step {step} under {checkpoint_root(run_dir)}: "
        f"{_root_cause(error)}; {intact}. Free disk space (or point run_dir at a larger disk) "
        f"and resume with --resume"
    )


def _root_cause(error: BaseException) -> str:
    # DCP wraps each rank's failure; the OSError inside is what a user can act on.
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{type(seen).__name__}: {seen}"
        failures = getattr(seen, "failures", None)
        if isinstance(failures, dict) and failures:
            rank, failure = next(iter(failures.items()))
            cause = failure[0] if isinstance(failure, tuple) else failure
            return (
                f"rank {rank}: {_root_cause(cause) if isinstance(cause, BaseException) else cause}"
            )
        seen = seen.__cause__ or seen.__context__
    return f"{type(error).__name__}: {error}"


def load_sharded_checkpoint(
    path: str | Path, meta: dict[str, Any]
) -> tuple[dict[str, Any], LoadTensors]:
    """(train_state, a function that loads DCP tensors into the given targets in place)."""
    path = Path(path)
    train_state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)

    def load(targets: dict[str, Any], *, planner: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        unknown = sorted(set(targets) - set(meta["numels"]))
        assert not unknown, f"keys the checkpoint does not hold: {unknown[:5]}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(path / "state")),
                     planner=planner, no_dist=not _distributed())  # fmt: skip

    return train_state, load


def read_model_state(path: str | Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full model state dict (``model.state_dict()`` names and shapes, tied names
    included) from a format-2 checkpoint, in this process alone."""
    import torch.distributed.checkpoint as dcp

    keys = {name: key for name, key in meta["model_keys"].items()}
    targets = {key: torch.empty(meta["numels"][key], dtype=torch.float32)
               for key in set(keys.values())}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(Path(path) / "state")),
                 no_dist=True)  # fmt: skip
    return {name: targets[key].view(meta["model_shapes"][name]).clone()
            for name, key in keys.items()}  # fmt: skip


def read_tensors(path: str | Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a format-2 checkpoint, whole and flat, by key, in this process alone."""
    import torch.distributed.checkpoint as dcp

    targets = {key: torch.empty(numel) for key, numel in meta["numels"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(Path(path) / "state")),
                 no_dist=True)  # fmt: skip
    return targets
