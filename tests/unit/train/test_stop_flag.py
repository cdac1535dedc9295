"""StopFlag ([Note: interrupts at safe points] in tidal/train/interrupts.py): signals become a
flag, a second Ctrl-C raises, the watchdog's own signal goes through, handlers come back."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest

from tidal.train.interrupts import StopFlag


class _Watchdog:
    """Stands for the rank watchdog: its SIGINT handler, and whether a verdict is pending."""

    def __init__(self) -> None:
        self.pending = False

    def claims_signal(self) -> bool:
        return self.pending

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        raise RuntimeError("rank 1 stopped responding")


def _signal(signum: int) -> None:
    os.kill(os.getpid(), signum)  # Python runs the handler before the next line


@pytest.fixture
def watchdog() -> _Watchdog:
    owner = _Watchdog()
    previous = signal.signal(signal.SIGINT, owner.on_sigint)
    yield owner
    signal.signal(signal.SIGINT, previous)


def test_signals_are_a_flag_and_a_second_ctrl_c_raises(watchdog: _Watchdog) -> None:
    previous_term = signal.getsignal(signal.SIGTERM)
    with StopFlag() as stop:
        assert not stop.raised(distributed=False)
        _signal(signal.SIGTERM)
        assert stop.raised(distributed=False) and stop.signal_name == "SIGTERM"
    with StopFlag() as stop:
        _signal(signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            _signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == watchdog.on_sigint
    assert signal.getsignal(signal.SIGTERM) == previous_term


def test_the_watchdogs_own_signal_is_delivered_at_once(watchdog: _Watchdog) -> None:
    with StopFlag() as stop:
        watchdog.pending = True
        with pytest.raises(RuntimeError, match="rank 1 stopped responding"):
            _signal(signal.SIGINT)
        assert stop.signum is None
