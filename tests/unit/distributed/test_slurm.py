"""[Note: srun tasks]: Slurm's variables as torchrun's, and Slurm node lists read."""

from __future__ import annotations

import pytest

from tidal.config import ConfigError
from tidal.distributed.slurm import adopt_slurm, first_host, slurm_rank_env

TASK = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "8"}  # fmt: skip


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node01", "node01"),
        ("node[01-04]", "node01"),
        ("gnode[10,20,25,37]", "gnode10"),
        ("a[1-2]-ib,b7", "a1-ib"),
        ("rack[3-4]-n[009-012]", "rack3-n009"),
        ("x1,y[2-3]", "x1"),
    ],
)
def test_the_first_host_of_a_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_an_unreadable_node_list_is_named() -> None:
    with pytest.raises(ConfigError, match="cannot read a host from 'n\\[1-2'"):
        first_host("n[1-2")


def test_a_task_of_a_step_becomes_a_rank() -> None:
    assert slurm_rank_env(TASK) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                    "MASTER_ADDR": "gpu07", "MASTER_PORT": "23456"}  # fmt: skip
    environ = {**TASK, "MASTER_PORT": "29999"}
    assert adopt_slurm(environ) and environ["MASTER_PORT"] == "29999" and environ["RANK"] == "3"


@pytest.mark.parametrize(
    "environ",
    [
        # A batch script's own shell: task 0 of the allocation, but no step of several tasks.
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"},
        {**TASK, "SLURM_STEP_NUM_TASKS": "1"},  # srun -n 1
        {**TASK, "WORLD_SIZE": "16", "RANK": "5"},  # torchrun under srun said it first
        {},
    ],
)
def test_no_rank_is_made_up_outside_a_multi_task_step(environ: dict[str, str]) -> None:
    before = dict(environ)
    assert not adopt_slurm(environ)
    assert environ == before
