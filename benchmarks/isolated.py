"""Cases run in a worker process, so that a case that kills its process becomes a result.

[Note: isolated cases]
A model tidal did not write may do anything in its forward, including crash the interpreter (a
kernel on freed storage ends the process with SIGSEGV, which no ``except`` sees). So
:func:`run_isolated` runs the cases in a spawned worker, in order, and the worker sends each
result as soon as it has it. If the worker dies (a signal, an exit) or a case outlasts its time,
that case's result is an error naming the cause (``killed by signal 11 (SIGSEGV)``), and a fresh
worker carries on with the next case: cases already reported keep their results, later ones
still run. One worker serves many cases, so what they share (a family's reference run) can be
computed once per worker; a case must not rely on that, since after a crash it runs in a new
one. An exception inside a case is the case function's to report; the worker reports one that
escapes as an error too, with its type, first line and traceback.

Workers start from a fork server that has imported ``preload`` (torch and tidal take seconds to
import; a fork of a process that imported them but ran nothing is safe), or are spawned where
there is no fork server.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

__all__ = ["error_result", "run_isolated"]

Case = TypeVar("Case")
Result = dict[str, Any]


def error_result(err: BaseException) -> Result:
    """``{"error": "<Type>: <first line>", "traceback": ...}`` for an exception."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return {"error": f"{type(err).__name__}: {first}".rstrip(": "), "traceback": trace}


def _worker(fn: Callable[[Any], Result], cases: Sequence[Any], conn: Connection) -> None:
    try:
        for index, case in enumerate(cases):
            started = time.perf_counter()
            try:
                result = fn(case)
            except Exception as err:
                result = error_result(err)
            result = {**result, "case_wall_s": time.perf_counter() - started}
            # Plain pickle: torch's multiprocessing reductions would send tensors as handles to
            # shared memory that dies with this process.
            conn.send_bytes(pickle.dumps((index, result), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        conn.close()


def _death(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-code}{name}"
    return f"the worker exited with code {code} without a result"


def _stop(process: BaseProcess) -> None:
    if process.exitcode is None:
        process.kill()
    process.join(timeout=10)


def _context(preload: Sequence[str]) -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # once the server runs, later lists are moot
    return context


def _one_worker(
    fn: Callable[[Any], Result], cases: Sequence[Any], timeout_s: float, preload: Sequence[str]
) -> tuple[list[Result], str | None]:
    """Results of the leading cases one worker finished, and why it stopped early (or None)."""
    context = _context(preload)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_worker, args=(fn, cases, send), name="tidal-case")
    process.start()
    send.close()  # so that ``receive`` sees EOF once the worker is gone
    results: list[Result] = []
    try:
        while len(results) < len(cases):
            if not receive.poll(timeout_s):
                return results, f"timed out after {timeout_s:g} s"
            try:
                _, result = pickle.loads(receive.recv_bytes())
            except EOFError:
                process.join(timeout=10)
                return results, _death(process)
            results.append(result)
        process.join(timeout=30)
        return results, None
    finally:
        _stop(process)
        with contextlib.suppress(OSError):
            receive.close()


def run_isolated(
    fn: Callable[[Case], Result],
    cases: Sequence[Case],
    *,
    timeout_s: float,
    preload: Sequence[str] = (),
) -> list[Result]:
    """``fn(case)`` for each case, in worker processes; see [Note: isolated cases].

    ``fn`` must be importable (defined at module level) and the cases picklable; ``preload``
    names modules the fork server imports once (``fn``'s own, say). Returns one result per
    case, in order; a case whose worker died or that ran past ``timeout_s`` has
    ``{"error": ...}``.
    """
    results: list[Result] = []
    while len(results) < len(cases):
        done, stopped = _one_worker(fn, cases[len(results) :], timeout_s, preload)
        results += done
        if stopped is not None and len(results) < len(cases):
            results.append({"error": stopped})
    return results
