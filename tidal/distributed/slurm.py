"""Under ``srun``: each Slurm task is a rank, joined from Slurm's variables as from torchrun's.

[Note: srun tasks]
``srun tidal train ...`` (or ``srun python train.py`` calling ``tidal.initialize``) starts one
process per task, on every node of the allocation. Slurm tells each its place, and
:func:`adopt_slurm` writes that as the variables torchrun would have set, so the one way of
joining (``init_from_env``) serves both:

=================  ==========================================================================
``RANK``           ``SLURM_PROCID``
``WORLD_SIZE``     ``SLURM_STEP_NUM_TASKS``: the tasks of *this* step. A batch script's own
                   shell has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole allocation,
                   but it is no step of several tasks, so a command run there without ``srun``
                   stays one process instead of waiting for peers that never come.
``LOCAL_RANK``     ``SLURM_LOCALID`` (which GPU of the node a rank takes)
``MASTER_ADDR``    the first host of ``SLURM_STEP_NODELIST`` (``node[03-05,9]`` -> ``node03``)
``MASTER_PORT``    ``20000 + SLURM_JOB_ID % 10000``: one port per job, the same on every task
=================  ==========================================================================

Variables already set win (a ``MASTER_PORT`` of your own, or torchrun started by ``srun``, whose
``WORLD_SIZE`` is there first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

from tidal.config import ConfigError

__all__ = ["adopt_slurm", "first_host", "slurm_rank_env"]

_PORT_BASE, _PORT_SPAN = 20000, 10000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``a[01-03,7]-ib,b2`` -> ``a01-ib``."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas outside brackets split

    def first_of(group: re.Match[str]) -> str:
        return re.split(r"[,-]", group.group(1))[0]

    host = re.sub(r"\[([^\]]*)\]", first_of, first)
    if not host or "[" in host or "]" in host:
        raise ConfigError("SLURM_STEP_NODELIST", f"cannot read a host from {nodelist!r}")
    return host


def slurm_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for this srun task ([Note: srun tasks]); empty when this process is
    no task of a Slurm step of several tasks."""
    tasks = environ.get("SLURM_STEP_NUM_TASKS")
    if tasks is None or "SLURM_PROCID" not in environ or int(tasks) <= 1:
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_STEP_NODELIST", "an srun task without a node list: set "
                          "MASTER_ADDR to the host of task 0")  # fmt: skip
    job_id = int(environ.get("SLURM_JOB_ID", "0"))
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": tasks,
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": first_host(nodelist),
        "MASTER_PORT": str(_PORT_BASE + job_id % _PORT_SPAN),
    }


def adopt_slurm(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set torchrun's variables from Slurm's where they are unset; whether this process is an
    srun task of a multi-task step (see [Note: srun tasks])."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" in environ:  # torchrun (or the user) said it already
        return False
    found = slurm_rank_env(environ)
    for key, value in found.items():
        environ.setdefault(key, value)
    return bool(found)
