"""Checkpoints: one format for every engine, through torch.distributed.checkpoint (DCP).

Layout under ``<run_dir>/checkpoints/``::

    step_00000010/          a complete checkpoint
        state/              DCP: the model and optimizer tensors ([Note: checkpoint keys]), each
                            rank writing its own pieces
        train_state.pt      written by rank 0: schedule step, data position, RNG states, counters,
                            the engine's small state (step counts, loss scale, plan choices)
        meta.json           written last: format, step, world size, every other file's size
                            and CRC-32, every model state-dict name's key and shape
    .tmp-step_00000020-4242/  a checkpoint being written (rank 0's process 4242)

[Note: checkpoint keys]
Every engine writes the same keys, so a checkpoint is the whole model whatever engine, world
size or pipeline split wrote it: ``model/<name>`` a parameter's weights (fp32, flattened to 1-D;
tied parameters once, under their first name), ``buffer/<name>`` a persistent buffer,
``optim/<name>/<state>`` a parameter's optimizer state, flattened ([Note: checkpoint tensors] in
tidal/sharding/state.py says why flat). ``<name>`` is the model's own state-dict name passed
through the run's :class:`StateDictAdapter` (the identity for tidal's GPT): the adapter is
applied here, at the boundary, so engines only ever see their model's names. An engine's other
keys (a pipeline stage's weight versions) sit beside these under their own prefix.

[Note: atomic checkpoints]
A checkpoint is written into a hidden temporary folder, every file is fsync'd, and only then is
the folder renamed to ``step_NNNNNNNN`` (a rename within one file system is atomic), followed by
an fsync of the parent folder so the rename itself is durable. Across ranks: rank 0 makes the
temporary folder and tells every rank its name; all ranks write their DCP pieces into it in
parallel (DCP's file writer fsyncs each file, and ``dcp.save`` raises on every rank if any rank
failed); rank 0 then writes the rest, renames the folder into place, and tells every rank
whether that worked. A reader only considers ``step_*`` folders with a ``meta.json``, so a
process killed at any instant leaves either the old set of checkpoints or the old set plus the
new one. A failure anywhere, a full disk included, removes the temporary folder and raises
:class:`CheckpointWriteError` on every rank, naming the previous checkpoint, which was never
touched. Leftover temporary folders of dead writers are removed by the next save; old
checkpoints are pruned only after the new one is in place.

[Note: confirmed shards]
``dcp.save`` returning on every rank means each wrote its pieces into *its* view of the folder.
Before committing, each rank records the pieces it wrote (DCP names them ``__<rank>_<n>.distcp``)
with their sizes and CRC-32s, and rank 0 confirms each is in its own folder at that size: on
disks that are not shared the pieces of other machines are not there, and a commit would make a
checkpoint that cannot be read ([Note: one run folder] in run_dir.py refuses such a run_dir
at start; this holds should the filesystem change under a run). The records go into
``meta.json``, so rank 0 does not read the other ranks' pieces back to checksum them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.parallel.protocol import CheckpointTensors, LoadTensors
from tidal.train.integrity import file_record, own_record

__all__ = [
    "FORMAT_VERSION",
    "IDENTITY",
    "Checkpoint",
    "CheckpointWriteError",
    "StateDictAdapter",
    "checkpoint_root",
    "fsync_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state",
    "read_tensors",
    "save_checkpoint",
    "write_json_durable",
    "write_tensor_file",
]

# 1: torch.save of a state dict (reference and plan engines) or per-stage files (pipelines);
# 2: DCP, written by the chunk engines only; 3: DCP written by every engine ([Note: checkpoint
# keys]). A format-2 checkpoint is a format-3 one.
FORMAT_VERSION = 3
_READABLE = (2, 3)
_STEP_DIR_RE = re.compile(r"^step_(\d{8})$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the earlier ones are intact."""


class StateDictAdapter(Protocol):
    """Maps a model's state-dict names to the names its checkpoints use, and back; see
    [Note: checkpoint keys]. The two must be inverse one-to-one maps."""

    def to_checkpoint(self, name: str) -> str: ...
    def from_checkpoint(self, name: str) -> str: ...


class _Identity:
    def to_checkpoint(self, name: str) -> str:
        return name

    def from_checkpoint(self, name: str) -> str:
        return name


IDENTITY: StateDictAdapter = _Identity()


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint, read: ``load_tensors`` fills targets keyed by the model's names."""

    path: Path
    step: int
    train_state: dict[str, Any]
    meta: dict[str, Any]  # meta.json, names mapped back, with "numels" of every DCP key
    load_tensors: LoadTensors


# -- the folder -----------------------------------------------------------------------------


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, folder), oldest first (see [Note: atomic checkpoints])."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR_RE.match(path.name)
        if match and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1][1] if checkpoints else None


def write_tensor_file(obj: Any, path: Path) -> int:
    """``torch.save`` ``obj`` to ``path`` and fsync it; returns the file's size."""
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, data: dict[str, Any], *, indent: int = 1) -> int:
    """Write ``data`` as JSON and fsync it; returns the file's size."""
    with path.open("w") as f:
        f.write(json.dumps(data, indent=indent) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def _swap_into_place(tmp: Path, final: Path, root: Path) -> None:
    if final.exists():
        # The same step saved again (e.g. a finished run resumed): swap the folders so there is
        # never a moment without a complete checkpoint for this step.
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)


def _remove_stale_temporaries(root: Path) -> None:
    for path in root.iterdir():
        if path.name.startswith((".tmp-", ".old-")) and not _written_by_live_process(path):
            shutil.rmtree(path, ignore_errors=True)


def _written_by_live_process(path: Path) -> bool:
    pid = int(path.name.rsplit("-", 1)[-1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune(run_dir: str | Path, keep: int) -> None:
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# -- names through the adapter ---------------------------------------------------------------


def _rename_key(key: str, rename: Callable[[str], str]) -> str:
    """A key of [Note: checkpoint keys] with its state-dict name renamed; other keys as they are."""
    prefix, _, rest = key.partition("/")
    if prefix in ("model", "buffer"):
        return f"{prefix}/{rename(rest)}"
    if prefix == "optim":
        name, _, state = rest.rpartition("/")
        return f"optim/{rename(name)}/{state}"
    return key


def _rename_meta(meta: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    out = dict(meta)
    if "model_keys" in meta:
        out["model_keys"] = {
            rename(n): _rename_key(k, rename) for n, k in meta["model_keys"].items()
        }
    if "model_shapes" in meta:
        out["model_shapes"] = {rename(n): shape for n, shape in meta["model_shapes"].items()}
    if "numels" in meta:
        out["numels"] = {_rename_key(k, rename): n for k, n in meta["numels"].items()}
    return out


def _rename_extras(extras: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    if "optimizer_steps" not in extras:
        return extras
    steps = {rename(name): step for name, step in extras["optimizer_steps"].items()}
    return {**extras, "optimizer_steps": steps}


# -- writing ----------------------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _from_rank0(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    state: CheckpointTensors,
    train_state: dict[str, Any],
    keep: int,
    adapter: StateDictAdapter = IDENTITY,
) -> Path:
    """Write checkpoint ``step`` from every rank; see [Note: atomic checkpoints].

    ``state``: this rank's tensors and (rank 0's) engine extras and meta; ``train_state``: the
    loop's own state, stored with the engine's extras under ``"engine"``."""
    assert keep >= 1, keep
    rename = adapter.to_checkpoint
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
    error: BaseException | None = None
    own: dict[str, dict[str, int]] = {}
    try:
        tensors = {_rename_key(k, rename): v for k, v in state.tensors.items()}
        _dcp_save(tensors, tmp / "state", state.planner)
        own = own_record(tmp, f"state/__{_rank()}_*.distcp")
    except Exception as exc:  # every rank sees DCP's error: a collective one
        error = exc
    shards = _gather((socket.gethostname(), own))
    unconfirmed = _unconfirmed(tmp, shards) if is_main and error is None else None
    if is_main and error is None and unconfirmed is None:
        try:
            extras = _rename_extras(state.extras, rename)
            write_tensor_file({**train_state, "engine": extras}, tmp / "train_state.pt")
            meta = _rename_meta(state.meta, rename)
            meta.pop("numels", None)  # DCP's own metadata is the truth; read from there
            # [Note: checkpoint integrity] in integrity.py; the ranks' pieces as they recorded
            files = file_record(tmp, known={k: v for _, rec in shards for k, v in rec.items()})
            write_json_durable(tmp / "meta.json", {"format_version": FORMAT_VERSION,
                               "step": step, "files": files, **meta})  # fmt: skip
            fsync_dir(tmp)
            _swap_into_place(tmp, final, root)
        except OSError as exc:
            error = exc
    message = unconfirmed or (None if error is None else _describe(error, step, run_dir))
    message = _from_rank0(message)
    if message is not None:
        shutil.rmtree(tmp, ignore_errors=True)  # each rank its own view of the temporaries
        raise CheckpointWriteError(message) from error
    if is_main:
        _prune(run_dir, keep)
    if _distributed():
        dist.barrier()  # no rank moves on (to exit, or to read it) before the folder is complete
    return final


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _gather(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order, on every rank."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _unconfirmed(tmp: Path, shards: list[tuple[str, dict[str, dict[str, int]]]]) -> str | None:
    """[Note: confirmed shards]: why a rank's piece is not in rank 0's folder, else None."""
    for rank, (host, own) in enumerate(shards):
        for name, record in own.items():
            path = tmp / name
            seen = path.stat().st_size if path.is_file() else None
            if seen != record["bytes"]:
                found = "missing" if seen is None else f"{seen} bytes"
                return (
                    f"checkpoint not committed: rank {rank}'s piece {name} ({record['bytes']} "
                    f"bytes, written on {host}) is {found} in {tmp} as rank 0 sees it, so "
                    f"run_dir is not one folder for all ranks; put it on a filesystem every "
                    f"machine mounts (the earlier checkpoints are as they were)"
                )
    return None


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns at every call without a process group that it assumes one process: the one case
    tidal means by ``no_dist``, so that notice alone is left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                "uninitialized", category=UserWarning)  # fmt: skip
        yield


def _dcp_save(tensors: dict[str, Any], path: Path, planner: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
                 planner=planner, no_dist=not _distributed())  # fmt: skip


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


# -- reading ----------------------------------------------------------------------------------


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(
            f"{path} is not a complete tidal checkpoint (no meta.json); pick a step_* folder "
            f"listed by list_checkpoints()"
        )
    meta = json.loads(meta_path.read_text())
    version = meta.get("format_version")
    if version not in _READABLE:
        raise ConfigError(
            "checkpoint",
            f"{path} is a checkpoint of format {version} (torch.save files of an older tidal); "
            f"this tidal reads formats {', '.join(map(str, _READABLE))} (DCP). Export or "
            f"resume it with the tidal that wrote it, or start the run again",
        )
    return meta


def _dcp_tensor_specs(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor key of a checkpoint's DCP folder: its size and dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path / "state")).read_metadata()
    return {key: (md.size, md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}  # fmt: skip


def _dcp_load(path: Path, targets: dict[str, Any], planner: Any, *, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet():
        dcp.load(targets, storage_reader=dcp.FileSystemReader(str(path / "state")),
                 planner=planner, no_dist=no_dist)  # fmt: skip


def load_checkpoint(path: str | Path, *, adapter: StateDictAdapter = IDENTITY) -> Checkpoint:
    """The checkpoint folder ``path``, every name mapped back through ``adapter``."""
    path = Path(path)
    meta = _read_meta(path)
    back, there = adapter.from_checkpoint, adapter.to_checkpoint
    numels = {key: int(size.numel()) for key, (size, _) in _dcp_tensor_specs(path).items()}
    meta = _rename_meta({**meta, "numels": numels}, back)
    train_state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    train_state["engine"] = _rename_extras(train_state["engine"], back)

    def load(targets: dict[str, Any], *, planner: Any = None) -> None:
        unknown = sorted(set(targets) - set(meta["numels"]))
        assert not unknown, f"keys the checkpoint does not hold: {unknown[:5]}"
        renamed = {_rename_key(key, there): value for key, value in targets.items()}
        _dcp_load(path, renamed, planner, no_dist=not _distributed())

    return Checkpoint(path, int(meta["step"]), train_state, meta, load)


def read_tensors(path: str | Path, *, adapter: StateDictAdapter = IDENTITY) -> dict[str, Any]:
    """Every tensor of a checkpoint, whole and flat, by key, in this process alone."""
    path = Path(path)
    _read_meta(path)
    targets = {key: torch.empty(size, dtype=dtype)
               for key, (size, dtype) in _dcp_tensor_specs(path).items()}  # fmt: skip
    _dcp_load(path, targets, None, no_dist=True)
    return {_rename_key(key, adapter.from_checkpoint): t for key, t in targets.items()}


def load_model_state(
    path: str | Path, *, adapter: StateDictAdapter = IDENTITY
) -> dict[str, torch.Tensor]:
    """The model's full state dict (``model.state_dict()`` names and shapes, fp32 weights, tied
    weights under each of their names) from a checkpoint of any engine, world size and pipeline
    split, read in this process alone."""
    path = Path(path)
    meta = _read_meta(path)
    specs = _dcp_tensor_specs(path)
    targets = {key: torch.empty(specs[key][0]) for key in set(meta["model_keys"].values())}
    _dcp_load(path, targets, None, no_dist=True)
    back = adapter.from_checkpoint
    return {back(name): targets[key].view(meta["model_shapes"][name]).clone()
            for name, key in meta["model_keys"].items()}  # fmt: skip
