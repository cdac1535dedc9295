"""The multi-process harness must fail loudly; see [Note: harness failure propagation]."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.testing import RankFailure, run_on_ranks

WORLD = 2


def _all_reduce_and_large_tensor() -> tuple[float, torch.Tensor]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    # 8 MiB, far beyond a pipe buffer: the parent must read while the child writes. A tensor
    # also checks results are copied, not shared through memory that dies with the rank.
    return value.item(), torch.full((2 * 1024 * 1024,), float(dist.get_rank()))


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")


def _silent_exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _sigkill_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def _hang_on_rank_1(pid_dir: str) -> None:
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(600)


def _raise_before_collective() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up before the all_reduce")
    try:
        dist.all_reduce(torch.ones(1))
    finally:
        # Gloo notices the dead peer and raises; NCCL would hang. Hang either way, so only
        # the harness's fail-fast kill can end this rank before the 60 s timeout.
        time.sleep(600)


def _environment_and_output(name: str) -> str | None:
    print(f"stdout of rank {dist.get_rank()}", flush=True)
    print(f"stderr of rank {dist.get_rank()}", file=sys.stderr, flush=True)
    return os.environ.get(name)


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_parents_environment_and_output_now(
    start: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Set after any fork server started (an earlier test's run): a forked rank must still see
    # it, and write where this test's output goes, as a spawned one does.
    run_on_ranks(_environment_and_output, world_size=WORLD, args=("TIDAL_TEST_VALUE",))
    capfd.readouterr()
    monkeypatch.setenv("TIDAL_TEST_VALUE", f"set-for-{start}")
    got = run_on_ranks(_environment_and_output, world_size=WORLD, args=("TIDAL_TEST_VALUE",),
                       start=start)  # fmt: skip
    assert got == [f"set-for-{start}"] * WORLD
    out, err = capfd.readouterr()
    for rank in range(WORLD):
        assert f"stdout of rank {rank}" in out and f"stderr of rank {rank}" in err


def _failure(fn: Callable[..., Any], **kwargs: Any) -> RankFailure:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(fn, world_size=WORLD, **kwargs)
    return info.value


def test_success_returns_per_rank_values_in_rank_order() -> None:
    results = run_on_ranks(_all_reduce_and_large_tensor, world_size=WORLD)
    assert [reduced for reduced, _ in results] == [3.0, 3.0]
    assert [big.numel() for _, big in results] == [2 * 1024 * 1024] * WORLD
    assert [big.unique().tolist() for _, big in results] == [[0.0], [1.0]]


def test_raising_rank_reports_exception_and_traceback() -> None:
    failure = _failure(_raise_on_rank_1, timeout_s=30)
    message = str(failure)
    assert "rank 1: raised ValueError: boom from rank 1" in message
    assert "Traceback" in message and "_raise_on_rank_1" in message
    assert isinstance(failure, AssertionError)
    assert [(o.rank, o.status) for o in failure.outcomes] == [(1, "error"), (0, "ok")]


def test_silent_exit_reports_exit_code() -> None:
    failure = _failure(_silent_exit_on_rank_1, timeout_s=30)
    assert "rank 1: exited with code 3 without reporting a result" in str(failure)
    assert failure.outcomes[0].exitcode == 3


def test_signal_death_names_the_signal() -> None:
    failure = _failure(_sigkill_on_rank_1, timeout_s=30)
    assert "rank 1: killed by signal SIGKILL" in str(failure)
    assert failure.outcomes[0].status == "signal"


def test_hang_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    start = time.monotonic()
    failure = _failure(_hang_on_rank_1, args=(str(tmp_path),), timeout_s=8)
    assert time.monotonic() - start < 30
    assert "rank 1: did not finish within 8 s" in str(failure)
    assert mp.active_children() == []
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == WORLD
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_fails_fast_when_a_peer_is_stuck_in_a_collective() -> None:
    start = time.monotonic()
    failure = _failure(_raise_before_collective, timeout_s=60)
    assert time.monotonic() - start < 20
    assert [(o.rank, o.status) for o in failure.outcomes] == [(1, "error"), (0, "killed")]
    assert "rank 1: raised RuntimeError: rank 1 gives up before the all_reduce" in str(failure)
    assert "rank 0: still running 3 s after rank 1 failed; killed" in str(failure)


_GENERATED_TEST = """
    from tidal.testing import run_on_ranks


    def _worker():
        import torch.distributed as dist  # only in the ranks: keeps this pytest run quick

        if dist.get_rank() == 1:
            raise ValueError("generated failure on rank 1")


    def test_uses_harness():
        run_on_ranks(_worker, world_size=2, timeout_s=30)
"""


def test_pytest_reports_a_rank_failure_as_a_test_failure(tmp_path: Path) -> None:
    test_file = tmp_path / "test_generated_rank_failure.py"
    test_file.write_text(textwrap.dedent(_GENERATED_TEST))
    repo_root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "RankFailure" in output
    assert "generated failure on rank 1" in output
    assert "1 failed" in output


def test_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    import socket

    from tidal.testing import free_port
    from tidal.testing.dist import _ephemeral_low

    ports = {free_port() for _ in range(8)}
    assert all(port < _ephemeral_low() for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_taken_port_is_retried_on_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI once failed with EADDRINUSE: a port free when picked was taken before rank 0 listened."""
    import socket

    import tidal.testing.dist as harness

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks: list[int] = []
        real = harness.free_port

        def first_the_taken_port() -> int:
            picks.append(real() if picks else int(taken.getsockname()[1]))
            return picks[-1]

        monkeypatch.setattr(harness, "free_port", first_the_taken_port)
        results = run_on_ranks(_all_reduce_and_large_tensor, world_size=WORLD, timeout_s=60)
    assert [reduced for reduced, _ in results] == [3.0, 3.0]
    assert len(picks) == 2, picks  # the taken port, then a fresh one that worked
