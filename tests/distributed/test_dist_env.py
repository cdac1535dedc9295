"""Rank helpers and the two small collectives, in one process and on two gloo ranks."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.distributed import (
    all_reduce_mean,
    barrier,
    decided_on_main,
    gather_ints,
    init_from_env,
    install_watchdog,
    is_main,
    leave_alike,
    rank,
    world_size,
)
from tidal.testing import free_port, run_on_ranks

CPU = torch.device("cpu")


def test_one_process_is_rank_0_of_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    assert init_from_env(device=CPU) is False
    assert not dist.is_initialized()
    assert (rank(), world_size(), is_main()) == (0, 1, True)
    assert all_reduce_mean(2.5) == 2.5
    assert gather_ints(7) == [7]
    assert decided_on_main(lambda: "mine") == "mine"
    barrier()


def test_world_size_1_from_torchrun_sets_up_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert init_from_env(device=CPU) is False
    assert not dist.is_initialized()


def test_partial_torchrun_environment_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        init_from_env(device=CPU)
    assert not dist.is_initialized()


def test_a_fixed_gpu_index_on_several_ranks_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ConfigError, match="training.device: 'cuda:0' names one GPU"):
        init_from_env(device=torch.device("cuda", 0))
    assert not dist.is_initialized()


def _refused() -> str:
    raise ConfigError("memory.device_budget", f"refused on rank {rank()}")


def _helpers_on_ranks() -> tuple[bool, int, int, bool, float, list[int], list[int], str]:
    # The harness already made the group: init_from_env keeps it and says "distributed".
    distributed = init_from_env(device=CPU)
    assert init_from_env(device=CPU) is distributed  # idempotent
    barrier()
    r = rank()
    called: list[int] = []
    decided = decided_on_main(lambda: called.append(r) or [r, 7])  # only rank 0 decides
    assert called == ([0] if r == 0 else [])
    with pytest.raises(ConfigError) as refused:
        decided_on_main(_refused)
    return (
        distributed,
        r,
        world_size(),
        is_main(),
        all_reduce_mean(1.0 + 2 * r),
        gather_ints(10 * r + 3),
        decided,
        refused.value.message,
    )


def test_two_ranks_reduce_gather_and_take_rank_0s_decision() -> None:
    results = run_on_ranks(_helpers_on_ranks, world_size=2, timeout_s=60)
    assert results == [
        (True, 0, 2, True, 2.0, [3, 13], [0, 7], "refused on rank 0"),
        (True, 1, 2, False, 2.0, [3, 13], [0, 7], "refused on rank 0"),
    ]


def _tidal_hooks() -> tuple[object, str]:
    # The SIGINT handler, and the module of sys.excepthook's function: init_process_group wraps
    # sys.excepthook in torch's own, which is torch's business, not tidal's.
    return signal.getsignal(signal.SIGINT), getattr(sys.excepthook, "__module__", "")


def _init_from_torchrun_variables(opt_in: bool) -> tuple[bool, str, int, bool]:
    # Tear down the harness's group, then build one from the variables, as under torchrun (gloo
    # for a CPU device). A new port: a fast rank could otherwise reach the old store before a
    # slow one has closed it.
    port = [free_port() if rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    before = _tidal_hooks()
    if opt_in:
        assert install_watchdog() is True
    distributed = init_from_env(device=CPU, timeout_s=30)
    hooks_kept = _tidal_hooks() == before
    return distributed, dist.get_backend(), gather_ints(rank())[1], hooks_kept


@pytest.mark.parametrize("opt_in", [False, True], ids=["library", "program-opted-in"])
def test_init_from_env_builds_a_gloo_group_from_the_variables(opt_in: bool) -> None:
    # [Note: watchdog opt-in]: the library takes no process hook; install_watchdog() makes
    # init_from_env start the watchdog, which takes SIGINT and sys.excepthook.
    results = run_on_ranks(
        _init_from_torchrun_variables, world_size=2, args=(opt_in,), timeout_s=60
    )
    hooks_kept = not opt_in
    assert results == [(True, "gloo", 1, hooks_kept), (True, "gloo", 1, hooks_kept)]


def test_install_watchdog_reads_its_settings_at_once() -> None:
    # A bad value fails in the CLI before any group exists; 0 turns the watchdog off.
    with pytest.raises(ConfigError, match="TIDAL_HEARTBEAT_S: must be a number of seconds"):
        install_watchdog({"TIDAL_HEARTBEAT_S": "fast"})
    assert install_watchdog({"TIDAL_DEAD_AFTER_S": "0"}) is False
    assert not dist.is_initialized()


def _opt_in_on_an_existing_group() -> bool:
    before = _tidal_hooks()
    assert install_watchdog({"TIDAL_HEARTBEAT_S": "0.1", "TIDAL_DEAD_AFTER_S": "1.5"}) is True
    return _tidal_hooks() != before


def test_install_watchdog_on_an_existing_group_starts_it_at_once() -> None:
    assert run_on_ranks(_opt_in_on_an_existing_group, world_size=2, timeout_s=60) == [True, True]


def _leave() -> tuple[bool, bool]:
    return leave_alike(timeout_s=30.0), dist.is_initialized()


def test_ranks_that_met_one_error_leave_the_group_together() -> None:
    """leave_alike: ranks failing alike part at a barrier and leave the group, so no rank tears
    its gloo pairs down under a peer (the run's one-line error otherwise became a SIGABRT
    report now and then)."""
    assert run_on_ranks(_leave, world_size=2, timeout_s=60) == [(True, False), (True, False)]
