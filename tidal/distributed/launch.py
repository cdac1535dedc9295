"""``tidal train --nproc N [--nnodes M --rdzv-endpoint HOST:PORT]``: the same command again,
as N ranks (on each of M machines) under torchrun's agent.

The launcher only rebuilds argv and runs torchrun's elastic agent *in this process*; each rank
is an ordinary ``python -m tidal train`` that finds torchrun's variables and joins the group
(``init_from_env``). So ``--nproc N`` and ``torchrun --nproc-per-node N -m tidal train ...``
run exactly the same ranks.

[Note: one line per run]
A terminal's Ctrl-C reaches the foreground process group: this process (the agent) but not the
ranks, which torchrun starts in sessions of their own. The agent forwards the signal to every
rank and waits for them to stop ([Note: interrupts at safe points] in tidal/train/interrupts.py:
each finishes its step, the run writes its checkpoint, rank 0 prints one line, all exit 130).
Run as a separate ``torchrun`` process the agent would then print its own traceback; here it is
caught, and the agent's log is quieted while it runs, so a run's ending is the ranks' one line.
A rank that fails says why itself (one line, or its traceback); the launcher returns that rank's
exit code (2 bad input, 75 dead rank, 130 interrupted) and adds a line only when the rank could
not speak (killed by a signal: a dead rank, 75) or crashed with a traceback (1). Ranks that fail
alike (a config error every rank finds, the survivors' verdict on one dead rank) say it once
between them: a rank prints its line only if it is the first of this machine's ranks to claim
that line (:func:`say_once`); a line that differs, a rank's own error, is printed whatever the
others said.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tidal.config import require

__all__ = [
    "Nodes",
    "launch_train",
    "rank_argv",
    "say_once",
    "torchrun_args",
    "torchrun_command",
    "without_flag",
]

EXIT_INTERRUPTED = 130
# How long the ranks get to finish their step and write the interrupt checkpoint after the
# agent forwards Ctrl-C (or stops the survivors of a failed rank), before it kills them;
# torchrun's own default is 30 s. TORCH_ELASTIC_SHUTDOWN_TIMEOUT set by hand wins.
_SHUTDOWN_GRACE_S = 180
# Exit codes with which a rank has already printed its one line (cli/main.py).
_SPOKEN_EXIT_CODES = frozenset((2, 75, EXIT_INTERRUPTED))
# The folder in which this machine's ranks claim the lines they print (say_once); set by the
# launcher for its ranks only.
_LINES_DIR_VAR = "TIDAL_RUN_LINES_DIR"


def say_once(line: str) -> None:
    """Print ``line`` to stderr unless another rank of this launch printed the same line
    ([Note: one line per run]). Outside a launch, or if the claim cannot be made, it prints."""
    folder = os.environ.get(_LINES_DIR_VAR)
    if folder is not None:
        claim = Path(folder) / hashlib.sha256(line.encode()).hexdigest()[:32]
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        except OSError:
            pass  # a line printed twice beats a line lost
    print(line, file=sys.stderr)


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``, also in the prefixes argparse accepts
    for it (``--np 2`` for ``--nproc 2``). Tokens after a bare ``--`` are kept as they are."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out.append(token)
            out.extend(tokens)
            break
        name, has_value, _ = token.partition("=")
        # "--" alone is not a prefix argparse would expand; anything longer is, if unique.
        if len(name) > 2 and flag.startswith(name):
            if not has_value:
                next(tokens, None)
            continue
        out.append(token)
    return out


@dataclass(kw_only=True, frozen=True, slots=True)
class Nodes:
    """The machines of a job: how many, where they meet (``HOST:PORT``), and this one's index
    (``None``: the rendezvous numbers them in the order they arrive)."""

    num_nodes: int = 1
    rdzv_endpoint: str | None = None
    node_rank: int | None = None

    def __post_init__(self) -> None:
        require(self.num_nodes >= 1, "--nnodes", f"must be >= 1, got {self.num_nodes}")
        if self.num_nodes > 1:
            require(self.rdzv_endpoint is not None, "--rdzv-endpoint",
                    f"{self.num_nodes} machines need a place to meet: give --rdzv-endpoint "
                    f"HOST:PORT (one of them, a free port), the same on each")  # fmt: skip
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            require(bool(host) and port.isdigit(), "--rdzv-endpoint",
                    f"expected HOST:PORT, got {self.rdzv_endpoint!r}")  # fmt: skip
        if self.node_rank is not None:
            require(0 <= self.node_rank < self.num_nodes, "--node-rank",
                    f"must be in 0..{self.num_nodes - 1} for --nnodes {self.num_nodes}, got "
                    f"{self.node_rank}")  # fmt: skip
            require(self.rdzv_endpoint is not None, "--node-rank",
                    "numbers a machine of a job that meets at --rdzv-endpoint HOST:PORT")  # fmt: skip


# The flags of the launcher, which the ranks' own `tidal train` must not see again.
_LAUNCH_FLAGS = ("--nproc-per-node", "--nproc", "--nnodes", "--rdzv-endpoint", "--node-rank",
                 "--max-restarts")  # fmt: skip


def torchrun_args(
    train_argv: Sequence[str], *, nproc: int, nodes: Nodes = Nodes(), max_restarts: int = 0
) -> list[str]:
    """torchrun's arguments for ``nproc`` ranks of ``tidal train`` on this machine (and as many
    on each of ``nodes``), restarted up to ``max_restarts`` times, with ``train_argv`` minus the
    launch flags."""
    ranks = rank_argv(train_argv)
    if nodes.rdzv_endpoint is None:
        where = ["--standalone"]
    elif nodes.node_rank is None:  # c10d rendezvous: numbered as they arrive
        where = [f"--nnodes={nodes.num_nodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={nodes.rdzv_endpoint}"]  # fmt: skip
    else:  # fixed places: rank 0's machine hosts the store at the endpoint
        host, _, port = nodes.rdzv_endpoint.rpartition(":")
        where = [f"--nnodes={nodes.num_nodes}", f"--node-rank={nodes.node_rank}",
                 f"--master-addr={host}", f"--master-port={port}"]  # fmt: skip
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    return [*where, *restarts, f"--nproc-per-node={nproc}", "-m", "tidal", "train", *ranks]


def rank_argv(train_argv: Sequence[str]) -> list[str]:
    """What each rank's ``tidal train`` is given: ``train_argv`` minus the launch flags."""
    argv = list(train_argv)
    for flag in _LAUNCH_FLAGS:
        argv = without_flag(argv, flag)
    return argv


def torchrun_command(train_argv: Sequence[str], *, nproc: int, nodes: Nodes = Nodes()) -> list[str]:
    """The ``torchrun`` command line that starts the same ranks as ``--nproc``."""
    args = torchrun_args(train_argv, nproc=nproc, nodes=nodes)
    return [sys.executable, "-m", "torch.distributed.run", *args]


def launch_train(
    train_argv: Sequence[str], *, nproc: int, nodes: Nodes = Nodes(), max_restarts: int = 0
) -> int:
    """Run ``tidal train`` as ``nproc`` ranks here (of ``nodes.num_nodes`` machines); return 0,
    130 when interrupted, else the exit code of the rank that failed first, 75 if a signal killed
    it ([Note: one line per run])."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from tidal.distributed.watchdog import EXIT_CODE as RANK_DIED

    if nproc * nodes.num_nodes < 2:
        raise ValueError(f"a launch needs >= 2 ranks, got {nproc} on {nodes.num_nodes} machine(s)")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(_SHUTDOWN_GRACE_S))
    if max_restarts:
        # [Note: a fresh store per attempt]
        # By default the ranks share the rendezvous' store across restarts, and a restarted
        # rank can read a key the previous attempt left there: gloo then connects to a dead
        # peer's port ("Connection refused"), NCCL takes an old unique id (pytorch/pytorch
        # issue 135712). Apart, rank 0 of each attempt hosts a new store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun sets 1 when it is unset, with a banner on every launch; the same, unannounced.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with _quiet_agent(), _agent_guard(nodes), _lines_dir():
        try:
            args = torchrun_args(train_argv, nproc=nproc, nodes=nodes, max_restarts=max_restarts)
            run(parse_args(args))
        except SignalException:
            return EXIT_INTERRUPTED  # the ranks were stopped and rank 0 said how
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            if failure.exitcode in _SPOKEN_EXIT_CODES:
                return failure.exitcode
            print(_failure_line(rank, failure.exitcode), file=sys.stderr)
            # Killed (out of memory, by hand): to the job a dead rank, whose code says resume,
            # as the survivors' watchdog verdict does ([Note: dead ranks] in watchdog.py).
            return RANK_DIED if failure.exitcode < 0 else 1
    return 0


# [Note: an agent stuck after its ranks]
# torchrun's agent talks to the rendezvous store after its ranks end (its exit barrier waits
# there for the other machines, then it shuts the rendezvous down). When the machine hosting
# that store froze, those calls never return: the ranks here stopped in seconds (the watchdog's
# verdict, exit 75) but the agent, and so the job on this machine, hung (seen: still running
# after 200 s). So with several machines a thread of the launcher watches this process's
# children: once it had ranks and all have ended, every TIDAL_AGENT_GRACE_S (default 30) it
# asks the store for a key, from a thread of its own with a 5 s deadline. A store that answers
# is alive (the agent is waiting for a slower machine: nothing to do); one that does not means
# the agent cannot finish, and the launcher says so and exits 75 (a peer failed: resume).
# Linux only (it reads /proc); elsewhere, and on one machine, nothing changes.
_AGENT_GRACE_S = 30.0
_PROBE_S = 5.0


@contextlib.contextmanager
def _agent_guard(nodes: Nodes) -> Iterator[None]:
    proc = Path("/proc")
    if not proc.is_dir() or nodes.rdzv_endpoint is None:
        yield
        return
    host, _, port = nodes.rdzv_endpoint.rpartition(":")
    grace_s = float(os.environ.get("TIDAL_AGENT_GRACE_S", _AGENT_GRACE_S))
    done = threading.Event()
    thread = threading.Thread(target=_guard_agent, args=(proc, (host, int(port)), grace_s, done),
                              daemon=True, name="tidal-agent-guard")  # fmt: skip
    thread.start()
    try:
        yield
    finally:
        done.set()


def _guard_agent(proc: Path, store: tuple[str, int], grace_s: float, done: threading.Event) -> None:
    had_ranks = False
    ended_at: float | None = None
    while not done.wait(0.5):
        alive = bool(_children(proc, os.getpid()))
        had_ranks = had_ranks or alive
        if alive or not had_ranks:
            ended_at = None
            continue
        ended_at = ended_at if ended_at is not None else time.monotonic()
        if time.monotonic() - ended_at < grace_s:
            continue
        if _store_answers(*store):
            ended_at = time.monotonic()  # alive: the agent waits for another machine
            continue
        os.write(2, (
            f"tidal: this machine's ranks have ended, but torchrun's agent cannot finish: the "
            f"rendezvous store at {store[0]}:{store[1]} does not answer (its machine stopped?); "
            f"exiting with code 75. The last complete checkpoint is intact; resume with "
            f"--resume.\n"
        ).encode())  # fmt: skip
        os._exit(75)


def _store_answers(host: str, port: int) -> bool:
    """Whether the TCP store at ``host:port`` answers a query within ``_PROBE_S``; asked from a
    thread of its own, since a client of a stopped host can block past its own timeout."""
    import torch.distributed as dist

    answered = threading.Event()

    def ask() -> None:
        with contextlib.suppress(Exception):
            client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=_PROBE_S))  # fmt: skip
            client.check(["tidal/probe"])
            answered.set()

    threading.Thread(target=ask, daemon=True, name="tidal-store-probe").start()
    return answered.wait(_PROBE_S + 1)


def _children(proc: Path, pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _failure_line(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return (
            f"tidal: rank {rank} was killed by {name} (out of host memory, or stopped by hand?); "
            f"the last complete checkpoint is intact: resume with --resume"
        )
    return f"tidal: rank {rank} failed with exit code {exitcode}; its error is printed above"


@contextlib.contextmanager
def _lines_dir() -> Iterator[None]:
    """A folder for the ranks' claims on their lines (say_once), removed after the run."""
    with tempfile.TemporaryDirectory(prefix="tidal-lines-") as folder:
        before = os.environ.get(_LINES_DIR_VAR)
        os.environ[_LINES_DIR_VAR] = folder
        try:
            yield
        finally:
            if before is None:
                del os.environ[_LINES_DIR_VAR]
            else:
                os.environ[_LINES_DIR_VAR] = before


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's warnings and errors, which repeat what the ranks said, silenced. Each of
    its modules' loggers has a level of its own (torch's ``get_logger``), so each is set."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch.distributed.elastic")
    ]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
