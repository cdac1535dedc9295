"""``tidal train``'s ranks without its launcher, for tests in any folder of the suite (this
folder is on ``sys.path``: tests/conftest.py's)."""

from __future__ import annotations

from tidal.distributed.launch import rank_argv
from tidal.testing import run_on_ranks


def run_command_on_ranks(train_argv: list[str], *, world_size: int,
                         timeout_s: float = 120.0) -> None:  # fmt: skip
    """Run ``tidal train TRAIN_ARGV`` as the launcher's ``world_size`` ranks do (its launch
    flags dropped, torchrun's variables set, one intra-op thread each as OMP_NUM_THREADS=1
    gives them) on ranks forked from the fork server: the ranks of ``tidal train --nproc N``
    without starting N interpreters (the launch itself is test_cli_nproc.py's)."""
    run_on_ranks(_run_command, world_size=world_size, args=(rank_argv(train_argv),),
                 timeout_s=timeout_s, backend=None)  # fmt: skip


def _run_command(argv: list[str]) -> None:
    import torch

    from tidal.cli.main import main

    torch.set_num_threads(1)
    code = main(["train", *argv])
    assert code == 0, f"tidal train exited {code} on this rank"
