"""Ctrl-C and SIGTERM stop a run at a step boundary, with a checkpoint.

[Note: interrupts at safe points]
Python delivers SIGINT as a KeyboardInterrupt raised wherever the main thread happens to be,
and that may be a finalizer (a saved tensor's ``__del__``, where the exception is printed as
"Exception ignored" and lost, so training went on) or a hook halfway through moving a chunk.
So while a run trains, SIGINT and SIGTERM only set a flag; the trainer reads it after each step,
where the engine is between iterations and a checkpoint is consistent. Under torch.distributed
the ranks agree on it (a mean over ranks each step), so every rank stops after the same step and
writes its pieces of the same checkpoint. A second SIGINT raises at once, for a run that hangs
inside a step. The handlers are installed only from the main thread and put back afterwards.
The rank watchdog also signals the main thread, to break a collective that waits on a dead peer
([Note: dead ranks] in tidal/distributed/watchdog.py): a handler replaced here whose owner
``claims_signal()`` gets that signal at once, not at the next step (which never comes).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from tidal.distributed import all_reduce_mean

__all__ = ["Interrupted", "StopFlag"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped at a step boundary because of a signal."""

    def __init__(self, *, step: int, signal_name: str, checkpoint: str | None) -> None:
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        saved = (f"checkpoint {checkpoint} written" if checkpoint is not None
                 else "no checkpoint written (checkpoint.on_interrupt = false)")  # fmt: skip
        super().__init__(f"{signal_name} after step {step}; {saved}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.step, self.signal_name, self.checkpoint))


def _rebuild(step: int, signal_name: str, checkpoint: str | None) -> Interrupted:
    return Interrupted(step=step, signal_name=signal_name, checkpoint=checkpoint)


class StopFlag:
    """SIGINT and SIGTERM as a flag while in use ([Note: interrupts at safe points])."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        claims = getattr(getattr(previous, "__self__", None), "claims_signal", None)
        if callable(previous) and claims is not None and claims():
            previous(signum, frame)  # the rank watchdog's verdict: a peer died, stop now
            return
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: now, wherever it is
        self.signum = self.signum or signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"

    def raised(self, *, distributed: bool) -> bool:
        """Whether to stop now: this process got a signal, or (``distributed``) any rank did."""
        mine = self.signum is not None
        if not distributed:
            return mine
        return all_reduce_mean(float(mine)) > 0.0
