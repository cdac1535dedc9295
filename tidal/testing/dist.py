"""Run a function on ``world_size`` local processes with ``torch.distributed`` set up.

[Note: harness failure propagation]
A test passes only if every rank reported ok and exited 0. Anything else -- a rank that raised,
died without reporting, was killed by a signal, or did not finish in time -- makes
:func:`run_on_ranks` raise :class:`RankFailure`, an ``AssertionError`` naming every bad rank.
Nothing is swallowed: a harness that kills a failed worker and calls the run a success hides
exactly the bugs distributed tests exist to find. Once one rank has failed, its peers get a
short grace period to report and are then killed, because a peer stuck in a collective with the
dead rank would otherwise hold the test until the full timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Literal

__all__ = [
    "RankFailure",
    "RankOutcome",
    "free_port",
    "process_context",
    "run_on_ranks",
]

# Long enough for a peer to report its own error, short enough not to matter in a test run.
_GRACE_S = 3.0

Status = Literal["ok", "error", "no_report", "signal", "timeout", "killed"]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank did. ``detail`` is the human-readable failure, empty when ``ok``."""

    rank: int
    status: Status
    exitcode: int | None
    detail: str = ""


class RankFailure(AssertionError):
    """At least one rank failed; see [Note: harness failure propagation]."""

    def __init__(self, outcomes: list[RankOutcome], world_size: int) -> None:
        self.outcomes = outcomes
        bad = [o for o in outcomes if o.status != "ok"]
        lines = [f"{len(bad)} of {world_size} ranks failed:"]
        lines += [f"rank {o.rank}: {o.detail}" for o in bad]
        super().__init__("\n".join(lines))


# [Note: ports outside the ephemeral range]
# Binding port 0 hands out a port from the kernel's ephemeral range, the same range every
# outgoing connection (each gloo pair, each store client of a test still tearing down) takes its
# local port from; one of those took the chosen port before rank 0 listened on it and CI failed
# with EADDRINUSE. A port below that range is handed out only by an explicit bind, so the window
# narrows to another test picking the same random port, and run_on_ranks retries that case.
_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 15000


def _ephemeral_low() -> int:
    try:
        with open(_PORT_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port that was free a moment ago, outside the kernel's ephemeral range where one
    exists ([Note: ports outside the ephemeral range]); else one the OS picks."""
    import random

    pick = random.SystemRandom()  # not the random module's state, which a test may have seeded
    high = _ephemeral_low()
    if high - _LOWEST_PORT >= 1000:
        for _ in range(64):
            port = pick.randrange(_LOWEST_PORT, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _describe(exc: BaseException) -> str:
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{type(exc).__name__}: {exc}\n{trace}"


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    # Plain pickle, not the multiprocessing pickler: torch registers reductions there that
    # pass tensors as shared-memory handles, which die with this process before the parent
    # unpickles them. Pickling completes before any byte is written.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> tuple[str, Any] | None:
    try:
        data = conn.recv_bytes()
    except EOFError:
        return None  # the child closed the pipe without a word
    try:
        return pickle.loads(data)
    except Exception as exc:  # e.g. the result's class cannot be imported in the parent
        return ("error", f"{type(exc).__name__} while the parent unpickled its result: {exc}")


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout_s: float,
    conn: Connection,
    environ: dict[str, str],
    stdio: None,  # _ParentStdio, which its unpickling already adopted
) -> None:
    # Own process group, so the parent can also kill anything this rank starts.
    os.setpgrp()
    # The parent's environment now, as a spawned rank would have it: the fork server's is
    # that of the moment it started ([Note: ranks from a fork server]).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist  # here, so importing tidal.testing stays cheap

    # As torchrun does (OMP_NUM_THREADS=1): ranks sharing the cores with default thread pools
    # oversubscribe them and every collective waits on a descheduled peer.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend is not None:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        value = fn(*args)
        _send(conn, ("ok", value))
        if not dist.is_initialized():
            return
        # Every rank reaches teardown before any tears its connections down: a rank destroying
        # its gloo group while a peer still used the pairs aborted the peer now and then
        # ("terminate called without an active exception", about 1 run in 25). A peer that
        # failed instead makes the barrier raise, which is that peer's failure, not this one's.
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        # Report before cleaning up: the parent must learn of the failure even if cleanup hangs.
        _send(conn, ("error", _describe(exc)))
        with contextlib.suppress(BaseException):
            if dist.is_initialized():
                dist.destroy_process_group()
        sys.exit(1)
    finally:
        conn.close()


class _Rank:
    """Parent-side bookkeeping for one child process."""

    def __init__(self, rank: int, process: BaseProcess, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn: Connection | None = conn
        self.message: tuple[str, Any] | None = None
        self.exitcode: int | None = None

    def waitables(self) -> list[Any]:
        found: list[Any] = [self.conn] if self.conn is not None else []
        return found + ([self.process.sentinel] if self.exitcode is None else [])

    def update(self, ready: list[Any]) -> None:
        # Drain the pipe whenever it is readable: a child blocked writing a large result
        # would otherwise never exit.
        if self.conn is not None and self.conn in ready:
            self.message = _receive(self.conn)
            self.conn.close()
            self.conn = None
        if self.exitcode is None and self.process.sentinel in ready:
            self.process.join()
            self.exitcode = self.process.exitcode

    @property
    def finished(self) -> bool:
        return self.conn is None and self.exitcode is not None

    @property
    def failed(self) -> bool:
        if self.message is not None and self.message[0] == "error":
            return True
        return self.finished and (self.exitcode != 0 or self.message is None)


def _exit_outcome(r: _Rank) -> RankOutcome:
    code = r.exitcode
    assert code is not None
    if r.message is not None and r.message[0] == "error":
        return RankOutcome(r.rank, "error", code, f"raised {r.message[1]}")
    if code < 0:
        name = signal.Signals(-code).name
        return RankOutcome(r.rank, "signal", code, f"killed by signal {name}")
    if r.message is None:
        detail = f"exited with code {code} without reporting a result"
        return RankOutcome(r.rank, "no_report", code, detail)
    if code != 0:
        return RankOutcome(r.rank, "no_report", code, f"reported ok but exited with code {code}")
    return RankOutcome(r.rank, "ok", 0)


def _unfinished_outcome(r: _Rank, timeout_s: float, first_failure: int | None) -> RankOutcome:
    if r.message is not None and r.message[0] == "error":
        return RankOutcome(r.rank, "error", None, f"raised {r.message[1]}")
    if first_failure is None:
        return RankOutcome(
            r.rank, "timeout", None, f"did not finish within {timeout_s:g} s; killed"
        )
    detail = f"still running {_GRACE_S:g} s after rank {first_failure} failed; killed"
    return RankOutcome(r.rank, "killed", None, detail)


def _kill(process: BaseProcess) -> None:
    if process.pid is not None and process.exitcode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()  # the child may not have made its own group yet
    process.join(timeout=10)


def _supervise(ranks: list[_Rank], timeout_s: float) -> list[RankOutcome]:
    deadline = time.monotonic() + timeout_s
    failure_order: list[int] = []
    while True:
        pending = [r for r in ranks if not r.finished]
        now = time.monotonic()
        if not pending or now >= deadline:
            break
        ready = wait([w for r in pending for w in r.waitables()], timeout=deadline - now)
        for r in pending:
            r.update(ready)
            if r.failed and r.rank not in failure_order:
                failure_order.append(r.rank)
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    first = failure_order[0] if failure_order else None
    outcomes = {
        r.rank: _exit_outcome(r) if r.finished else _unfinished_outcome(r, timeout_s, first)
        for r in ranks
    }
    # Root causes first: the rank that failed first is usually the one to read.
    order = failure_order + [r.rank for r in ranks if r.rank not in failure_order]
    return [outcomes[i] for i in order]


# [Note: ranks from a fork server]
# A spawned rank starts a new interpreter and imports torch (2-3 s here), tidal, and then
# torch._dynamo at its first torch optimizer (another 3 s): most of a short distributed test.
# Ranks are forked instead from multiprocessing's fork server, one process per test session
# that imports those modules once and computes nothing, so a fork of it is as clean as a new
# interpreter: no threads, no process group, no device context. What a spawned rank would
# take from its parent at start, the environment and stdout/stderr, is passed along explicitly.
# DTensor's modules too (tensor_stage's): most ranks shard, and every checkpoint of a sharded
# stage reads them (another 1-2 s each). And what a rank imports with the test function it runs
# (its module, unpickled in the rank): pytest, and the planner's search with scipy (about a
# second a rank) for the many tests that plan; a module that is not installed is passed over.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "tidal",
    "tidal.train",
    "tidal.parallel.tensor_stage",
    "tidal.planner.search",
    "torch.distributed.checkpoint",
    "pytest",
]


class _ParentStdio:
    """Pickles as the parent's stdout and stderr file descriptors (sent with the process, as
    multiprocessing sends a pipe's), which the rank then writes to: a forked rank's own are
    the fork server's, whatever they were when it started (another test's capture)."""

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_adopt_stdio, (DupFd(1), DupFd(2)))


def _adopt_stdio(out: Any, err: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def process_context(start: Literal["forkserver", "spawn"] = "forkserver") -> Any:
    """The multiprocessing context :func:`run_on_ranks` starts ranks from: with "forkserver",
    processes forked from a server that imported torch and tidal once ([Note: ranks from a
    fork server]), for a test that needs a process of its own to signal or kill."""
    return _context(start)


def _context(start: str) -> Any:
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, once
    return ctx


def run_on_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    backend: str | None = "gloo",
    start: Literal["forkserver", "spawn"] = "forkserver",
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` ranks (forked from a fork server: [Note: ranks from
    a fork server]); return their results in rank order.

    ``fn`` must be picklable (defined at module level) and reads its rank from
    ``torch.distributed.get_rank()``. Raises :class:`RankFailure` unless every rank reported
    ok and exited 0 within ``timeout_s`` (counted from start-up, which imports torch in each
    rank); see [Note: harness failure propagation]. ``timeout_s`` is also the process-group
    timeout, so a collective with a missing peer errors inside the rank rather than hanging.
    ``start="spawn"``: a fresh interpreter per rank, for a benchmark whose ranks
    measure their own memory (a forked rank holds the fork server's modules).
    ``backend=None``: no process group is made; ``fn`` joins one from torchrun's variables,
    which are set, as a program torchrun started does.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start)
    for attempt in range(_PORT_ATTEMPTS):
        outcomes, results = _launch(ctx, fn, args, world_size, backend, timeout_s)
        taken = any("EADDRINUSE" in o.detail for o in outcomes if o.status != "ok")
        if not taken or attempt == _PORT_ATTEMPTS - 1:
            break
    if any(o.status != "ok" for o in outcomes):
        raise RankFailure(outcomes, world_size)
    return results


# A port taken between free_port and rank 0's listen fails the rendezvous before fn did any
# work, so launching again on a new port repeats nothing ([Note: ports outside the ephemeral
# range]).
_PORT_ATTEMPTS = 3


def _launch(
    ctx: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    backend: str | None,
    timeout_s: float,
) -> tuple[list[RankOutcome], list[Any]]:
    port = free_port()
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            worker_args = (fn, args, rank, world_size, port, backend, timeout_s, send_end,
                           dict(os.environ), _ParentStdio())  # fmt: skip
            process = ctx.Process(target=_rank_main, args=worker_args, name=f"tidal-rank-{rank}")
            process.start()
            send_end.close()  # so the parent sees EOF once the child is gone
            ranks.append(_Rank(rank, process, recv_end))
        outcomes = _supervise(ranks, timeout_s)
    finally:
        for r in ranks:
            _kill(r.process)
            if r.conn is not None:
                r.conn.close()
    return outcomes, [r.message[1] for r in ranks if r.message is not None]
