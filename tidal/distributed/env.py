"""The process group from torchrun's environment, rank helpers and two small collectives.

``torchrun --nproc-per-node N`` (or ``tidal train --nproc N``) starts N processes and tells each
who it is through ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
:func:`init_from_env` turns that into the default process group. Every helper here also works
without a group, as the one process of a world of one, so single-process code needs no branches.
A program that opted in with :func:`install_watchdog` (``tidal train`` does) gets a
:class:`~tidal.distributed.watchdog.RankWatchdog` on the group made here until :func:`shutdown`, so a
rank that dies stops the others instead of hanging them ([Note: dead ranks] in watchdog.py).

[Note: watchdog opt-in]
The watchdog takes process-wide hooks: a SIGINT handler, ``sys.excepthook`` and an ``atexit``
handler. Those belong to the program, not to a library it imports, and a program may have its
own (an elastic agent, a notebook, a job runner), so the library never starts a watchdog by
itself: ``tidal.initialize`` and a ``Trainer`` used from Python leave every process hook as it
was. ``tidal train`` is a program, so it opts in with :func:`install_watchdog` before it builds
its trainer; the group :func:`init_from_env` then makes gets a watchdog. A Python program that
wants one does the same, or wraps its work in ``start_watchdog()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.distributed.slurm import adopt_slurm
from tidal.distributed.watchdog import (
    RankDiedError,
    RankWatchdog,
    WatchdogConfig,
    config_from_env,
    start_watchdog,
)

T = TypeVar("T")

__all__ = [
    "all_reduce_mean",
    "barrier",
    "decided_on_main",
    "explain_failure",
    "gather_ints",
    "init_from_env",
    "install_watchdog",
    "is_main",
    "join_alone",
    "leave_alike",
    "rank",
    "shutdown",
    "world_size",
]

_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# The watchdog of the group init_from_env made, stopped by shutdown(); None otherwise.
_watchdog: RankWatchdog | None = None
# What install_watchdog() asked for; None: no watchdog ([Note: watchdog opt-in]).
_watchdog_config: WatchdogConfig | None = None


def install_watchdog(environ: Mapping[str, str] | None = None) -> bool:
    """Opt this process in to a watchdog on its process group; return whether one will run.

    For programs only ([Note: watchdog opt-in]): ``tidal train`` calls it before building its
    trainer. The settings come from ``TIDAL_HEARTBEAT_S`` and ``TIDAL_DEAD_AFTER_S`` (read now,
    so a bad value fails before any group exists; ``TIDAL_DEAD_AFTER_S=0`` turns it off). The
    group :func:`init_from_env` makes next gets the watchdog, and so does one that already
    exists with more than one rank.
    """
    global _watchdog, _watchdog_config
    _watchdog_config = config_from_env(environ)
    if _watchdog_config is None:
        return False
    if _watchdog is None and _initialized() and dist.get_world_size() > 1:
        _watchdog = start_watchdog(_watchdog_config)
    return True


def explain_failure(exc: BaseException) -> RankDiedError | None:
    """The dead peer behind ``exc``, an error a collective raised, as the watchdog's verdict
    (after waiting for it, at most ``dead_after_s`` and two heartbeats); None when no watchdog
    runs or the peers are alive, so ``exc`` has another cause."""
    if _watchdog is None or not isinstance(exc, RuntimeError) or isinstance(exc, RankDiedError):
        return None
    return _watchdog.explain(exc)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_from_env(*, device: torch.device, timeout_s: float = 600.0) -> bool:
    """Join the default process group torchrun's variables describe; return whether distributed.

    Idempotent: an existing group (a second call, a test harness, a user's own set-up) is kept.
    Without the variables, or with ``WORLD_SIZE=1``, nothing is set up and the answer is False.
    ``device`` picks the backend: NCCL for CUDA, whose rank then uses ``cuda:LOCAL_RANK``, gloo
    otherwise. ``timeout_s`` bounds every collective, so a lost peer fails a rank, not hangs it;
    in a program that called :func:`install_watchdog`, the watchdog started with the group stops
    the job much sooner when a rank dies, naming it.
    """
    global _watchdog
    if _initialized():
        return dist.get_world_size() > 1
    adopt_slurm()  # an srun task: its rank from Slurm's variables ([Note: srun tasks])
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} unset; start the "
            f"ranks with torchrun (or tidal train --nproc N), which sets all of "
            f"{', '.join(_TORCHRUN_VARS)}"
        )
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; run one process")
    if device.type == "cuda":
        if device.index is not None:
            # Every rank reads the same config, so a fixed index would put them all on one GPU.
            raise ConfigError(
                "training.device",
                f"{str(device)!r} names one GPU for all {os.environ['WORLD_SIZE']} ranks; use "
                f"'cuda' or 'auto' (each rank takes cuda:LOCAL_RANK)",
            )
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if _watchdog_config is not None:
        _watchdog = start_watchdog(_watchdog_config)
    return dist.get_world_size() > 1


def join_alone(*, device: torch.device, timeout_s: float = 600.0) -> None:
    """A process group of this one process, where there is none ([Note: a group of one]).

    [Note: a group of one]
    A run on stages builds its mesh and its stages' groups from the default process group, also
    with one process (``pp = dp = tp = 1``: a model of one stage whose parameters a transform
    holds, such as FSDP2 with its CPU offload on one device); every collective over a group of
    one moves nothing. Without torchrun's variables there is no rendezvous to make, so the group
    lives in this process's own store. It stays until :func:`shutdown` (or the process's end),
    and later runs in the process reuse it, as they reuse torchrun's.
    """
    if _initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip


def shutdown() -> None:
    """Leave the default process group, if any (the end of a torchrun process).

    First marks this rank done for the watchdog, so its peers never take its exit for a death.
    """
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop(done=True)
        _watchdog = None
    if _initialized():
        dist.barrier()  # see the teardown comment in tidal/testing/dist.py
        dist.destroy_process_group()


def leave_alike(*, timeout_s: float = 30.0) -> bool:
    """Leave the default process group after an error every rank meets alike (a bad setting,
    a device budget below the step), as :func:`shutdown` does after a run: together, so that no
    rank tears its gloo pairs down while a peer still uses them (that aborted a rank now and
    then, its one-line error turned into a SIGABRT report: see the teardown comment in
    tidal/testing/dist.py). A peer that does not come within ``timeout_s`` (it failed
    otherwise, or works on) is not waited for: the group is left to the process's end, and its
    watchdog goes on, so that the peer learns of this rank's exit. NCCL has no barrier that
    times out, so there the group is left as before; a group of one ([Note: a group of one])
    has no peer to part from and stays for the process's later runs. Whether the group was
    left."""
    global _watchdog
    if not _initialized() or dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return False
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        return False
    if _watchdog is not None:
        _watchdog.stop(done=True)
        _watchdog = None
    dist.destroy_process_group()
    return True


def rank() -> int:
    """This process's rank; 0 without a process group."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """Processes in the default group; 1 without one."""
    return dist.get_world_size() if _initialized() else 1


def is_main() -> bool:
    """Whether this is rank 0, the one that writes files and prints."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank; nothing to wait for in a world of one."""
    if world_size() > 1:
        dist.barrier()


def decided_on_main(decide: Callable[[], T]) -> T:
    """Rank 0's ``decide()`` on every rank (a collective with a process group of several; the
    other ranks do not call it): for a decision the ranks could otherwise make differently. A
    :class:`~tidal.config.ConfigError` it raises is raised on every rank."""
    if world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except ConfigError as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ConfigError):
        raise box[0]
    return cast(T, box[0])


def _collective_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(value: float) -> float:
    """The mean of ``value`` over all ranks (reduced in float64); ``value`` itself for one."""
    if world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total.item()) / dist.get_world_size()


def gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, indexed by rank, on every rank; ``[value]`` for one."""
    if world_size() == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]
