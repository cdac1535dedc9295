"""``tidal train --nproc N``: the same command again, as N ranks under torchrun's agent.

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
not speak (killed by a signal) or crashed with a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence

__all__ = ["launch_train", "torchrun_args", "torchrun_command", "without_flag"]

EXIT_INTERRUPTED = 130
# How long the ranks get to finish their step and write the interrupt checkpoint after the
# agent forwards Ctrl-C, before it kills them (torchrun's own default is 30 s).
_SHUTDOWN_GRACE_S = 600
# Exit codes with which a rank has already printed its one line (cli/main.py).
_SPOKEN_EXIT_CODES = frozenset((2, 75, EXIT_INTERRUPTED))


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


def torchrun_args(train_argv: Sequence[str], *, nproc: int) -> list[str]:
    """torchrun's arguments for ``nproc`` ranks of ``tidal train`` on this machine, with
    ``train_argv`` minus ``--nproc``."""
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", "tidal", "train",
            *without_flag(train_argv, "--nproc")]  # fmt: skip


def torchrun_command(train_argv: Sequence[str], *, nproc: int) -> list[str]:
    """The ``torchrun`` command line that starts the same ranks as ``--nproc``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(train_argv, nproc=nproc)]


def launch_train(train_argv: Sequence[str], *, nproc: int) -> int:
    """Run ``tidal train`` as ``nproc`` ranks; return 0, 130 when interrupted, else the exit
    code of the rank that failed first ([Note: one line per run])."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 to launch ranks, got {nproc}")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(_SHUTDOWN_GRACE_S))
    with _quiet_agent():
        try:
            run(parse_args(torchrun_args(train_argv, nproc=nproc)))
        except SignalException:
            return EXIT_INTERRUPTED  # the ranks were stopped and rank 0 said how
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            if failure.exitcode in _SPOKEN_EXIT_CODES:
                return failure.exitcode
            print(_failure_line(rank, failure.exitcode), file=sys.stderr)
            return 1
    return 0


def _failure_line(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"tidal: rank {rank} was killed by {name} (out of host memory, or stopped by hand?)"
    return f"tidal: rank {rank} failed with exit code {exitcode}; its error is printed above"


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
