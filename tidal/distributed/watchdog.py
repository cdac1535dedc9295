"""A heartbeat per rank, so that a rank that dies stops the others instead of hanging them.

[Note: dead ranks]
A rank that dies (an exception, SIGKILL, a lost node) leaves its peers in, or on the way to, a
collective that can never finish. Waiting for the collective's own timeout is not enough:
gloo's and NCCL's are long (``init_from_env`` gives 600 s, NCCL defaults to 10 minutes), a
timeout or gloo's "Connection closed by peer" does not say which rank is gone, and a main thread
blocked inside a C++ collective cannot even raise (NCCL may wait on a dead peer for ever). So
every rank runs a :class:`RankWatchdog`: a daemon thread that adds 1 to its counter
``tidal/heartbeat/{rank}`` in the job's store every ``heartbeat_s`` and reads all the others'
in the same beat. A peer whose counter has not moved for ``dead_after_s``, as timed by this
rank's own monotonic clock (so hosts' clocks need not agree), is dead. A rank that finishes
cleanly adds to ``tidal/done/{rank}`` and is never reported (``stop(done=True)``, the context
manager's clean exit, ``shutdown()``, leaving the default group, or a normal interpreter exit).

Once a peer is declared dead this rank must end within a bounded time, whatever its main thread
is doing. The watchdog first gives the main thread a chance to end the ordinary way: it sends
SIGINT to the main thread alone (``pthread_kill``: unlike ``_thread.interrupt_main``, it also
breaks a ``sleep``), and the SIGINT handler it installed raises :class:`RankDiedError` as soon
as the main thread runs Python again, so a rank between steps or waiting in Python reports the
error through its normal error path. A main thread inside C++ (a collective) never gets there,
so after ``grace_s`` the watchdog writes the error to stderr itself and calls
``os._exit(EXIT_CODE)``. It uses ``os.write``, not ``print``: a main thread blocked writing to
a full pipe would hold ``sys.stderr``'s lock, and a print would then never return. ``os._exit``
skips clean-up that could itself block on the dead peer; nothing is lost that matters, since
checkpoints are written whole or not at all ([Note: atomic checkpoints] in engine/checkpoint.py).

The collective often fails first: gloo raises "Connection closed by peer" the moment a dead
peer's sockets close, before ``dead_after_s`` has passed. :meth:`RankWatchdog.explain` turns
such an error into the watchdog's verdict: it waits until a peer is declared dead (then
``RankDiedError(...) from exc``, naming it) or until every unfinished peer has heart-beaten twice
since the error (alive, so the error is something else, which then propagates unchanged). The
context manager does this for a ``RuntimeError`` leaving its block, and the ``sys.excepthook``
the watchdog installs does it for one that ends the process (``tidal train`` under torchrun).
An error unrelated to a dead peer is reported about two heartbeats late.

The store itself can die. Under ``env://`` rank 0 hosts it, so rank 0's death makes every
store call of the others fail (at once on a closed socket; the watchdog's own copy of the store
times out after ``dead_after_s`` on a silent one). Losing the store is rank 0 going silent: if
this rank never saw rank 0 finish, rank 0 is declared dead ``dead_after_s`` after the last
answer. Under torchrun the agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``), and a lost
store means torchrun itself is gone; the error then names no rank. A store host that finishes
first would look the same, so rank 0 lingers on a clean stop until its peers are done or have
had two heartbeats to read its mark.

torchrun complements this rather than replacing it. When a worker exits non-zero, its agent
stops the node's other workers and reports the first failure as the root cause with its rank;
so on one node a crash is usually caught by torchrun within its 0.1 s monitor interval. But an
agent watches its own node's workers only: workers on other nodes, under another launcher, or
orphaned by an agent that was killed are left to their collectives. The watchdog gives every
rank the same bounded, named failure on its own, and its exit code tells a supervisor which
ranks stopped because of a peer rather than failing themselves.

[Note: a deadline apart from the store]
A store call does not always return within its timeout: with the store's host stopped (a frozen
machine, SIGSTOP) its sockets stay open and nothing answers, and on torch 2.13 a client with a
3 s timeout was seen blocked for over 40 s. So the verdict on a silent store does not rest on
the heartbeat thread getting an error back: a second thread reads only the time of the store's
last answer, and ``dead_after_s`` plus two heartbeats after it declares the store's host gone
(or, with torchrun's agent hosting the store, the store itself) while the heartbeat thread may
still be blocked in its call. Either thread's verdict is the one delivered; the other is
dropped.

Only a program starts a watchdog, since its hooks are process-wide: ``tidal train`` opts in with
``install_watchdog()``, a library user with :func:`start_watchdog` ([Note: watchdog opt-in] in
env.py).

Limits: a peer whose process lives but whose main thread hangs (a deadlock, mismatched
collectives) still heart-beats; that is the collective timeout's job. A watchdog must be started
on every rank (one that never starts looks dead), once per store: marks are never cleared.
``dead_after_s`` must outlast any pause of a live rank's heartbeat thread (see
:class:`WatchdogConfig`); a whole process stopped in a debugger like gdb looks dead, so
``TIDAL_DEAD_AFTER_S=0`` turns the watchdog off. A process that ends through ``sys.exit``, not an
uncaught exception, counts as finished, so that a library user need not call ``stop()``; the
CLI's own error exits are non-zero, and torchrun stops the other workers on those.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from tidal.config import ConfigError, require

__all__ = [
    "EXIT_CODE",
    "RankDiedError",
    "RankWatchdog",
    "WatchdogConfig",
    "config_from_env",
    "start_watchdog",
]

EXIT_CODE = 75
"""A rank the watchdog ended itself, because a peer died and the main thread did not stop.

75 is ``EX_TEMPFAIL`` of sysexits.h ("temporary failure; retry later": resume the job from its
last checkpoint), apart from the CLI's 1, 2 and 130 and from the 128 + N of a signal."""

_RESUME = "The last complete checkpoint is intact; resume with --resume."
_ENV_NAMES = {"heartbeat_s": "TIDAL_HEARTBEAT_S", "dead_after_s": "TIDAL_DEAD_AFTER_S"}


@dataclass(kw_only=True, frozen=True, slots=True)
class WatchdogConfig:
    """When a silent peer counts as dead; see [Note: dead ranks].

    Attributes:
        heartbeat_s: seconds between this rank's heartbeats (and its reads of the others').
            At 1 s a beat is two small store round trips, nothing beside a training step, and
            a faster beat would sharpen detection by less than a tenth of ``dead_after_s``.
        dead_after_s: seconds without a heartbeat after which a peer is dead. A false alarm
            kills a healthy job, so this must outlast the longest pause of a live rank's
            heartbeat thread: the GIL held by C code that does not release it (a large pickle
            in a checkpoint), a collection of a large heap, swapping, a loaded store. 10 s is
            ten missed beats, and still 60 times sooner than the 600 s collective timeout.
        grace_s: seconds the main thread gets to raise :class:`RankDiedError` and end the
            process itself before the watchdog calls ``os._exit(EXIT_CODE)``.
    """

    heartbeat_s: float = 1.0
    dead_after_s: float = 10.0
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        require(self.heartbeat_s > 0, "heartbeat_s", f"must be > 0 s, got {self.heartbeat_s}")
        require(
            self.dead_after_s >= 2 * self.heartbeat_s,
            "dead_after_s",
            f"must be at least 2 * heartbeat_s = {2 * self.heartbeat_s:g} s, so that one late "
            f"heartbeat is not a death; got {self.dead_after_s}",
        )
        require(self.grace_s >= 0, "grace_s", f"must be >= 0 s, got {self.grace_s}")


def config_from_env(environ: Mapping[str, str] | None = None) -> WatchdogConfig | None:
    """The settings ``TIDAL_HEARTBEAT_S`` and ``TIDAL_DEAD_AFTER_S`` give, defaults where unset.

    ``TIDAL_DEAD_AFTER_S=0`` turns the watchdog off (None). A bad value is a ConfigError that
    names the variable.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, float] = {}
    for field, name in _ENV_NAMES.items():
        text = environ.get(name, "").strip()
        if not text:
            continue
        try:
            values[field] = float(text)
        except ValueError:
            raise ConfigError(name, f"must be a number of seconds, got {text!r}") from None
    if values.get("dead_after_s") == 0:
        return None
    try:
        return WatchdogConfig(**values)
    except ConfigError as err:
        raise ConfigError(_ENV_NAMES.get(err.key, err.key), err.message) from None


class RankDiedError(RuntimeError):
    """Peers of this rank died, so it stops; ``dead_ranks`` names them.

    ``dead_ranks`` is empty when only the store is known to be gone (its host was torchrun's
    agent, not a rank).
    """

    def __init__(self, message: str, dead_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.dead_ranks = tuple(dead_ranks)

    def __reduce__(self) -> tuple[type[RankDiedError], tuple[str, tuple[int, ...]]]:
        return (RankDiedError, (str(self), self.dead_ranks))


def _ranks_phrase(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _silent_message(dead: Sequence[int], silence_s: float, rank: int) -> str:
    cause = "it crashed, was killed or is stuck" if len(dead) == 1 else "crashed, killed or stuck"
    return (
        f"tidal: {_ranks_phrase(dead)} stopped responding (no heartbeat for {silence_s:.1f} s: "
        f"{cause}); stopping rank {rank} so the job does not hang. {_RESUME}"
    )


def _store_lost_message(host: int | None, silence_s: float, rank: int, exc: Exception) -> str:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if host is None:
        what = f"the job's store stopped answering {silence_s:.1f} s ago ({reason})"
    else:
        what = (
            f"rank {host} stopped responding (it hosts the job's store, which stopped answering "
            f"{silence_s:.1f} s ago: {reason})"
        )
    return f"tidal: {what}; stopping rank {rank} so the job does not hang. {_RESUME}"


def _own_copy(store: dist.Store, timeout_s: float) -> dist.Store:
    # A clone has its own connection, so the heartbeat never queues behind the main thread's
    # store traffic, and its own timeout, so a silent store host is noticed like a silent peer.
    copy = store.clone()  # type: ignore[attr-defined]  # in torch's C++ Store, not its stubs
    copy.set_timeout(timedelta(seconds=timeout_s))
    return copy


class RankWatchdog:
    """This rank's heartbeat and its verdict on the others; see [Note: dead ranks].

    Start one on every rank once the process group exists (:func:`start_watchdog`), and
    ``stop(done=True)`` when the rank has finished, or use it as a context manager, which does
    both and turns a collective's ``RuntimeError`` caused by a dead peer into
    :class:`RankDiedError`. ``store_host_rank`` is the rank whose process hosts ``store``
    (None: not a rank); ``group``, if given, is the default group whose destruction means
    this rank has left the job.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        config: WatchdogConfig | None = None,
        store_host_rank: int | None = None,
        group: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config if config is not None else WatchdogConfig()
        self._store = _own_copy(store, self.config.dead_after_s)
        self._store_host_rank = store_host_rank
        self._group = group
        self._peers = [r for r in range(world_size) if r != rank]
        # Heartbeat counters, then done marks: one multi_get reads them all.
        self._keys = [f"tidal/heartbeat/{r}" for r in range(world_size)]
        self._keys += [f"tidal/done/{r}" for r in range(world_size)]
        self._lock = threading.Lock()  # guards the fields below, shared with the thread
        self._beats = dict.fromkeys(self._peers, 0)  # each peer's last counter seen
        self._heard = dict.fromkeys(self._peers, 0.0)  # monotonic time it last moved
        self._done: set[int] = set()
        self._last_answer = 0.0  # monotonic time of the store's last answer
        self._verdict: RankDiedError | None = None
        self._stopping = threading.Event()
        self._verdict_set = threading.Event()
        self._delivered = False  # the main thread has been handed the verdict
        self._failed = False  # an exception ended the main thread (sys.excepthook ran)
        self._thread = threading.Thread(target=self._run, name=f"tidal-watchdog-{rank}")
        self._thread.daemon = True
        # [Note: a deadline apart from the store]
        self._deadline = threading.Thread(target=self._watch_answers,
                                          name=f"tidal-watchdog-deadline-{rank}", daemon=True)  # fmt: skip
        self._main_ident: int | None = None  # set while the SIGINT handler is installed
        self._previous_sigint: Any = None
        self._previous_excepthook: Any = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> RankWatchdog:
        """Heart-beat from now on; returns self. Hooks into SIGINT when on the main thread."""
        assert not self._thread.is_alive() and not self._stopping.is_set(), "start once"
        if not self._peers:  # a world of one has nobody to watch
            self._stopping.set()
            return self
        for key in self._keys:  # create every counter, so that multi_get never waits for one
            self._store.add(key, 0)
        self._store.add(self._keys[self.rank], 1)
        now = time.monotonic()
        self._last_answer = now
        self._heard = dict.fromkeys(self._peers, now)
        self._install_hooks()
        self._thread.start()
        self._deadline.start()
        return self

    def stop(self, *, done: bool = True) -> None:
        """Stop heart-beating; ``done`` marks this rank finished, so it is never reported.

        A rank stopping because of an error passes ``done=False``: its peers then see it die.
        After a verdict this does nothing: the rank is ending, within ``grace_s``.
        """
        with self._lock:
            already = self._stopping.is_set()
            self._stopping.set()
            verdict = self._verdict
        if already or verdict is not None:
            return
        self._thread.join(timeout=self.config.dead_after_s + self.config.heartbeat_s)
        self._remove_hooks()
        if done:
            with contextlib.suppress(RuntimeError):  # the store may be gone with its host
                self._store.add(self._keys[self.world_size + self.rank], 1)
                if self.rank == self._store_host_rank:
                    self._linger()

    def __enter__(self) -> RankWatchdog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.stop(done=True)
            return
        verdict = self._explain_if_collective(exc)
        self.stop(done=False)
        if verdict is not None:
            raise verdict from exc

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        """The ranks declared dead so far (empty without a verdict)."""
        verdict = self._verdict
        return verdict.dead_ranks if verdict is not None else ()

    def explain(self, exc: BaseException) -> RankDiedError | None:
        """The verdict behind ``exc``, an error a collective raised; None if it has another cause.

        Waits until a peer is declared dead, or until every unfinished peer has heart-beaten
        twice since (alive), at most ``dead_after_s`` plus two heartbeats.
        """
        try:
            return self._await_verdict()
        except RankDiedError as err:  # the watchdog's SIGINT arrived while waiting
            return err.with_traceback(None)  # where it interrupted the wait is no news

    def _explain_if_collective(self, exc: BaseException) -> RankDiedError | None:
        # Collectives raise RuntimeError (gloo) or its subclass DistError (NCCL, the store).
        if isinstance(exc, RuntimeError) and not isinstance(exc, RankDiedError):
            return self.explain(exc)
        return None

    def _await_verdict(self) -> RankDiedError | None:
        with self._lock:
            since = dict(self._beats)
        deadline = time.monotonic() + self.config.dead_after_s + 2 * self.config.heartbeat_s
        while True:
            if self._verdict_set.is_set():
                self._delivered = True
                return self._verdict
            with self._lock:
                alive = all(p in self._done or self._beats[p] >= since[p] + 2 for p in self._peers)
            if alive or not self._thread.is_alive() or time.monotonic() >= deadline:
                return None
            self._verdict_set.wait(self.config.heartbeat_s)

    def _linger(self) -> None:
        # The store dies with this process: give the peers two heartbeats to read the done mark,
        # so that they do not take its disappearance for a death (see [Note: dead ranks]).
        deadline = time.monotonic() + 2 * self.config.heartbeat_s
        done_keys = self._keys[self.world_size :]
        while time.monotonic() < deadline:
            if all(int(v) for v in self._store.multi_get(done_keys)):
                return
            time.sleep(self.config.heartbeat_s / 4)

    # -- the heartbeat thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(self.config.heartbeat_s):
            if self._left_group():
                with contextlib.suppress(RuntimeError):
                    self._store.add(self._keys[self.world_size + self.rank], 1)
                return
            try:
                self._store.add(self._keys[self.rank], 1)
                values = [int(v) for v in self._store.multi_get(self._keys)]
            except RuntimeError as exc:  # DistNetworkError, DistStoreError: the store is gone
                self._on_store_lost(exc)
                return
            dead, silence_s = self._observe(values, time.monotonic())
            if dead:
                self._fire(dead, _silent_message(dead, silence_s, self.rank))
                return

    def _watch_answers(self) -> None:
        """[Note: a deadline apart from the store]: the store silent for ``dead_after_s`` and
        two heartbeats past its last answer is its host gone, whatever a store call is doing."""
        limit_s = self.config.dead_after_s + 2 * self.config.heartbeat_s
        while not self._stopping.wait(self.config.heartbeat_s) and self._thread.is_alive():
            with self._lock:
                if self._verdict is not None or self._store_host_rank in self._done:
                    return
                silence_s = time.monotonic() - self._last_answer
            if silence_s >= limit_s:
                host = self._store_host_rank
                dead = [host] if host is not None and host != self.rank else []
                lost = TimeoutError(f"no answer from the store for {silence_s:.1f} s")
                self._fire(dead, _store_lost_message(host, silence_s, self.rank, lost))
                return

    def _left_group(self) -> bool:
        # The default group destroyed (without stop()) means this rank has left the job.
        if self._group is None:
            return False
        return not dist.is_initialized() or dist.group.WORLD is not self._group

    def _observe(self, values: list[int], now: float) -> tuple[list[int], float]:
        """Record one beat; the peers silent for ``dead_after_s``, and the longest silence."""
        beats, done = values[: self.world_size], values[self.world_size :]
        with self._lock:
            self._last_answer = now
            for peer in self._peers:
                if done[peer]:
                    self._done.add(peer)
                elif beats[peer] != self._beats[peer]:
                    self._beats[peer], self._heard[peer] = beats[peer], now
            silent = [
                p
                for p in self._peers
                if p not in self._done and now - self._heard[p] >= self.config.dead_after_s
            ]
        return silent, max((now - self._heard[p] for p in silent), default=0.0)

    def _on_store_lost(self, exc: Exception) -> None:
        host = self._store_host_rank
        with self._lock:
            if host in self._done:
                return  # the host finished and its store went with it, as expected
            last_answer = self._last_answer
        remaining = last_answer + self.config.dead_after_s - time.monotonic()
        if self._stopping.wait(max(0.0, remaining)):
            return  # this rank finished first
        dead = [host] if host is not None and host != self.rank else []
        silence_s = time.monotonic() - last_answer
        self._fire(dead, _store_lost_message(host, silence_s, self.rank, exc))

    def _fire(self, dead: Sequence[int], message: str) -> None:
        """Hand the main thread a RankDiedError; end the process if it has not within grace_s."""
        verdict = RankDiedError(message, dead)
        with self._lock:
            if self._stopping.is_set() or self._verdict is not None:
                return  # this rank finished meanwhile, or the other thread spoke first
            self._verdict = verdict
        self._verdict_set.set()
        if self._main_ident is not None:
            with contextlib.suppress(OSError):
                signal.pthread_kill(self._main_ident, signal.SIGINT)
        time.sleep(self.config.grace_s)
        note = (
            f"\n(tidal: the main thread did not stop within {self.config.grace_s:g} s, likely "
            f"blocked in a collective; exiting with code {EXIT_CODE})\n"
        )
        os.write(2, f"{message}{note}".encode())
        os._exit(EXIT_CODE)

    # -- process hooks: SIGINT, sys.excepthook, atexit ------------------------------------

    def _install_hooks(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
            self._main_ident = threading.main_thread().ident
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    def _remove_hooks(self) -> None:
        atexit.unregister(self._at_exit)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        on_main = threading.current_thread() is threading.main_thread()
        if self._main_ident is not None and on_main:
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, self._previous_sigint)
            self._main_ident = None

    def claims_signal(self) -> bool:
        """Whether a SIGINT now is this watchdog's (a verdict to deliver), not a user's: for a
        handler that replaced ours for a while ([Note: interrupts at safe points] in
        tidal/train/interrupts.py)."""
        return self._verdict is not None and not self._delivered

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        verdict = self._verdict
        if verdict is None:  # a real Ctrl-C: whatever handled it before
            previous = self._previous_sigint
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # SIG_DFL: die of the signal as before
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            return
        if not self._delivered:
            self._delivered = True
            raise verdict
        # Otherwise our own signal after the main thread already had the verdict; ignored.

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        self._failed = True
        verdict = self._explain_if_collective(exc)
        if verdict is None:
            self._previous_excepthook(exc_type, exc, tb)
            return
        verdict.__cause__ = exc
        self._previous_excepthook(type(verdict), verdict, verdict.__traceback__)

    def _at_exit(self) -> None:
        # A process ending normally, without stop(), has finished; one ended by an exception has
        # not, and its peers must see it die.
        self.stop(done=not self._failed)


def _agent_hosts_store() -> bool:
    # torchrun's agent hosts the store its workers share (torch.distributed.rendezvous).
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def start_watchdog(
    config: WatchdogConfig | None = None, *, store: dist.Store | None = None
) -> RankWatchdog:
    """Start this rank's watchdog on the default process group; every rank must start one.

    ``store`` defaults to the group's own, hosted by rank 0 (``env://``) or by torchrun's
    agent; a given store's host is taken to be no rank. ``stop(done=True)`` the result when
    the rank has finished, or use it as a context manager (see [Note: dead ranks]).
    """
    if store is None:
        store = distributed_c10d._get_default_store()
        host = None if _agent_hosts_store() else 0
        group = dist.group.WORLD
    else:
        host, group = None, None
    watchdog = RankWatchdog(
        store,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        config=config,
        store_host_rank=host,
        group=group,
    )
    return watchdog.start()
