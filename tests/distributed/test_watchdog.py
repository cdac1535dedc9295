"""A rank that dies stops its peers, naming it, instead of hanging them ([Note: dead ranks]).

Every run uses a fast watchdog (a beat every 0.1 s, dead after 1.5 s). The harness gives the
survivors of a failed rank 3 s to report before it kills them ([Note: harness failure
propagation]), so a survivor whose outcome is "error" has stopped on its own, within 3 s of the
death, far inside the 40 s the harness and gloo would otherwise wait.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import time
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from tidal.config import ConfigError
from tidal.distributed import RankDiedError, WatchdogConfig, start_watchdog
from tidal.distributed.watchdog import EXIT_CODE, config_from_env
from tidal.testing import RankFailure, RankOutcome, run_on_ranks

WORLD = 2
DEAD_AFTER_S = 1.5
FAST = WatchdogConfig(heartbeat_s=0.1, dead_after_s=DEAD_AFTER_S, grace_s=1.0)
TIMEOUT_S = 40.0  # the harness's and gloo's; every failure below must come far sooner
BOUND_S = 25.0  # start-up of two ranks on two cores included

Death = Literal["raise", "sigkill", "sigstop"]


def _collectives_until_a_rank_dies(victim: int, death: Death) -> None:
    me = dist.get_rank()
    try:
        with start_watchdog(FAST):
            for i in itertools.count():
                if me == victim and i == 5:
                    if death == "raise":
                        raise ValueError(f"rank {me} fails mid-loop")
                    os.kill(os.getpid(), getattr(signal, death.upper()))
                dist.all_reduce(torch.ones(1))
    except RankDiedError as err:
        assert err.dead_ranks == (victim,), err.dead_ranks
        raise


def _run(victim: int, death: Death) -> tuple[dict[int, RankOutcome], float]:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(
            _collectives_until_a_rank_dies,
            world_size=WORLD,
            args=(victim, death),
            timeout_s=TIMEOUT_S,
        )
    elapsed = time.monotonic() - start
    return {o.rank: o for o in info.value.outcomes}, elapsed


@pytest.mark.parametrize(
    ("victim", "death"),
    [(1, "raise"), (1, "sigkill"), (0, "sigkill")],
    ids=["rank-1-raises", "rank-1-sigkilled", "store-host-rank-0-sigkilled"],
)
def test_a_dead_rank_stops_its_peer_with_an_error_naming_it(victim: int, death: Death) -> None:
    # Gloo's own "Connection closed by peer" comes first; the watchdog names the rank behind it.
    # Rank 0 hosts the store, so its death is seen as the store going away.
    outcomes, elapsed = _run(victim, death)
    survivor = outcomes[1 - victim]
    assert outcomes[victim].status == ("error" if death == "raise" else "signal")
    assert survivor.status == "error", survivor.detail
    assert f"RankDiedError: tidal: rank {victim} stopped responding" in survivor.detail
    assert f"stopping rank {1 - victim} so the job does not hang" in survivor.detail
    assert elapsed < BOUND_S


def test_a_rank_blocked_in_a_collective_is_ended_with_the_exit_code(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A stopped peer keeps its sockets open, so gloo blocks in C++, where no Python exception
    # reaches the main thread: after grace_s the watchdog ends the process itself.
    outcomes, elapsed = _run(1, "sigstop")
    assert outcomes[0].exitcode == EXIT_CODE, outcomes[0]
    assert outcomes[1].status == "killed"  # by the harness, after rank 0 failed
    stderr = capfd.readouterr().err
    assert "tidal: rank 1 stopped responding" in stderr
    assert f"exiting with code {EXIT_CODE}" in stderr
    assert elapsed < BOUND_S


def _busy_then_finish_at_different_times() -> tuple[int, ...]:
    me = dist.get_rank()
    with start_watchdog(FAST) as watchdog:
        dist.all_reduce(torch.ones(1))
        if me == 1:  # pure Python holds the GIL between switches, yet the thread heart-beats
            deadline = time.monotonic() + 2 * DEAD_AFTER_S
            while time.monotonic() < deadline:
                pass
        dist.all_reduce(torch.ones(1))  # rank 0 waits here meanwhile
        if me == 1:
            # Rank 0 finishes, and its process, which hosts the store, exits: not a death.
            time.sleep(2 * DEAD_AFTER_S)
    return watchdog.dead_ranks


def test_busy_and_finished_ranks_are_not_reported_dead() -> None:
    results = run_on_ranks(
        _busy_then_finish_at_different_times, world_size=WORLD, timeout_s=TIMEOUT_S
    )
    assert results == [(), ()]


def _unrelated_error_on_rank_0() -> None:
    with start_watchdog(FAST):
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 0:
            raise RuntimeError("a bug of rank 0, not a dead peer")
        time.sleep(TIMEOUT_S)


def test_an_error_with_live_peers_is_not_blamed_on_them() -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_unrelated_error_on_rank_0, world_size=WORLD, timeout_s=TIMEOUT_S)
    outcomes = {o.rank: o for o in info.value.outcomes}
    assert "RuntimeError: a bug of rank 0, not a dead peer" in outcomes[0].detail
    assert "RankDiedError" not in outcomes[0].detail
    # Rank 1, waiting in Python, is interrupted once rank 0 is gone.
    assert "RankDiedError: tidal: rank 0 stopped responding" in outcomes[1].detail


def test_settings_from_the_environment() -> None:
    assert config_from_env({}) == WatchdogConfig()
    fast = {"TIDAL_HEARTBEAT_S": "0.1", "TIDAL_DEAD_AFTER_S": "1.5"}
    assert config_from_env(fast) == WatchdogConfig(heartbeat_s=0.1, dead_after_s=1.5)
    assert config_from_env({"TIDAL_DEAD_AFTER_S": "0"}) is None  # off
    with pytest.raises(ConfigError, match="TIDAL_HEARTBEAT_S: must be a number of seconds"):
        config_from_env({"TIDAL_HEARTBEAT_S": "fast"})
    with pytest.raises(ConfigError, match=r"TIDAL_DEAD_AFTER_S: must be at least 2 \* heartbeat"):
        config_from_env({"TIDAL_HEARTBEAT_S": "1", "TIDAL_DEAD_AFTER_S": "1.5"})
    with pytest.raises(ConfigError, match="heartbeat_s: must be > 0"):
        WatchdogConfig(heartbeat_s=0)


def test_the_error_names_the_dead_ranks_and_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(RankDiedError("tidal: ranks 1 and 3 stopped", (1, 3))))
    assert isinstance(err, RuntimeError)
    assert (str(err), err.dead_ranks) == ("tidal: ranks 1 and 3 stopped", (1, 3))


def test_a_frozen_store_host_ends_its_peer_within_the_deadline(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Rank 0 hosts the store and is stopped (SIGSTOP: its sockets stay open, nothing answers).
    A store call of rank 1 may then block far past its own timeout; the watchdog's deadline
    does not wait for it ([Note: a deadline apart from the store])."""
    outcomes, elapsed = _run(0, "sigstop")
    assert outcomes[1].exitcode == EXIT_CODE, outcomes[1]
    stderr = capfd.readouterr().err
    assert "tidal: rank 0 stopped responding (it hosts the job's store" in stderr, stderr
    assert f"exiting with code {EXIT_CODE}" in stderr
    assert elapsed < BOUND_S
