"""Fault injection, a testing aid: make one rank crash at a given training step.

``TIDAL_FAULT_INJECT="kill:rank=1:step=2"`` makes rank 1 SIGKILL itself as step 2 begins, the
way the OOM killer or a lost node ends a process: no exception, no clean-up, no message.
``raise:rank=1:step=2`` raises ``RuntimeError`` there instead, an ordinary Python failure;
``interrupt:rank=1:step=2`` sends that rank a SIGINT, as a Ctrl-C reaching one process. The
variable is read here and nowhere else; the Trainer calls :func:`maybe_inject` once per step,
which costs one environment lookup when it is unset. It fires in the first attempt only, not
again after an elastic restart (``--max-restarts``). Tests use it to check that the other ranks
stop, naming the dead one, instead of hanging ([Note: dead ranks] in watchdog.py).
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass

from tidal.config import ConfigError
from tidal.distributed.env import rank

__all__ = ["ENV_VAR", "Fault", "maybe_inject", "parse_fault"]

ENV_VAR = "TIDAL_FAULT_INJECT"
_ACTIONS = ("kill", "raise", "interrupt")
_EXAMPLE = "'kill:rank=1:step=2'"


@dataclass(kw_only=True, frozen=True, slots=True)
class Fault:
    """``action`` (``kill``, ``raise`` or ``interrupt``) on rank ``rank`` as step ``step``
    begins."""

    action: str
    rank: int
    step: int


@functools.lru_cache(maxsize=4)
def parse_fault(spec: str) -> Fault:
    """``ACTION:rank=R:step=S`` as a Fault; a ConfigError naming the variable otherwise."""
    action, *fields = spec.strip().split(":")
    if action not in _ACTIONS:
        raise ConfigError(
            ENV_VAR,
            f"unknown action {action!r} in {spec!r}; use kill, raise or interrupt, e.g. {_EXAMPLE}",
        )
    values: dict[str, int] = {}
    for field in fields:
        key, _, value = field.partition("=")
        if key not in ("rank", "step") or key in values or not value.isdigit():
            raise ConfigError(
                ENV_VAR, f"{field!r} in {spec!r}: expected rank=N and step=N, e.g. {_EXAMPLE}"
            )
        values[key] = int(value)
    if len(values) != 2:
        raise ConfigError(ENV_VAR, f"{spec!r} needs both rank=N and step=N, e.g. {_EXAMPLE}")
    return Fault(action=action, **values)


def maybe_inject(step: int) -> None:
    """Carry out the fault ``TIDAL_FAULT_INJECT`` describes, if it is for this rank and step."""
    spec = os.environ.get(ENV_VAR, "")
    if not spec:
        return
    fault = parse_fault(spec)
    if fault.step != step or fault.rank != rank():
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return  # the fault was the first attempt's; a restart runs on past it
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
        return
    raise RuntimeError(f"{ENV_VAR}={spec}: injected failure on rank {fault.rank} at step {step}")
