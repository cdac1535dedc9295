"""A matrix two stages hold (tied embeddings) under an asynchronous schedule.

[Note: tied matrices without a flush]
A synchronous schedule sums the two copies' gradients at the flush and both copies take the same
update ([Note: the update's order] in update.py). An asynchronous one has no moment when both
stages have finished the same step: stage ``s``'s ``k``-th update comes after its ``(k+1)m``-th
backward, and the last stage gets there first (1F1B runs a microbatch's backwards from the last
stage to the first). So one copy, the *owner* (the first of the pair: the embedding on the first
stage), is the matrix, and the other follows it:

- at its update of step ``t`` the second copy sends the owner its gradient of ``t`` (after its
  dp reduction) and drops it, then takes the ordinary update of its stage, the tied matrix
  left out of it (``drop_gradient``: plain parameters are not stepped and keep no optimizer
  state for it; a chunk's update moves it, and it is overwritten next);
- the owner's update of step ``t`` waits for that gradient, adds it to its own (``own +
  second``, the order of the synchronous sum), clips by its stage's norm with the sum in it, and
  steps; it then sends the new value to the second copy;
- the second copy, after its update of ``t``, takes the owner's value of ``t - 1`` (at a
  program's first update, the value it began the program with: a program starts with the
  copies equal), and, after its last update, the owner's last value: the copies are equal
  whenever a program ends (the flush point a checkpoint is taken at, [Note: synchronous and
  asynchronous training] in distributed.py). So at version ``v`` the second copy holds the
  owner's version ``v - 1`` (``0`` while ``v <= 1``).

So the matrix is updated once per step by the sum of both uses' gradients, each use computed
with the weights its stage held then, as every PipeMare weight is; the second copy runs one
update behind the owner (with ``m >= p`` microbatches per update the owner's value of ``t - 1``
is there before the second copy's update of ``t``, so nothing waits; with fewer the last stage
waits for it). Both messages are in the sender's update order on their own tag ([Note:
point-to-point protocol] in p2p.py), and the sum is taken in one process in the owner's order,
so a distributed run equals :func:`~tidal.runtime.local.run_local` bit for bit. Learning rates
are the owner stage's (PipeMare rescheduling by the owner's delays). A weight version stashed
for an in-flight backward (PipeDream, 2BW) is a copy of the stage's weights as its forward saw
them, so it keeps the older value the second copy held then. A checkpoint holds the owner's
optimizer state for the matrix, not the second copy's ([Note: pipeline checkpoints] in
tidal/train/engine_state.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tidal.parallel.stage_params import StageParams
from tidal.runtime.p2p import TiedKey, Transport

__all__ = ["TiedExchange"]

# ((stage, parameter name), (stage, parameter name)): one matrix held by two stages.
TiedPair = tuple[tuple[int, str], tuple[int, str]]


class TiedExchange:
    """One rank's part in [Note: tied matrices without a flush], for the stages it holds."""

    def __init__(
        self,
        pairs: Sequence[TiedPair],
        weights: Mapping[int, StageParams],
        transport: Transport,
        *,
        first_step: int,
    ) -> None:
        self._pairs = tuple(enumerate(pairs))
        self._weights = weights
        self._transport = transport
        self._first_step = first_step
        self._last_step: dict[int, int] = {}  # second-copy stage -> its last update's step
        self._began: dict[int, torch.Tensor] = {}  # pair -> the second copy's value at the start

    def _owned(self, stage: int) -> list[tuple[int, str, int]]:
        """(pair, name here, second copy's stage) for each matrix ``stage`` owns."""
        return [(i, na, sb) for i, ((sa, na), (sb, _)) in self._pairs if sa == stage]

    def _followed(self, stage: int) -> list[tuple[int, str, int]]:
        """(pair, name here, owner's stage) for each second copy ``stage`` holds."""
        return [(i, nb, sa) for i, ((sa, _), (sb, nb)) in self._pairs if sb == stage]

    def ready(self, stage: int, step: int) -> bool:
        """Whether ``stage``'s update of ``step`` has every message it will receive."""
        ready = self._transport.ready
        return all(ready(TiedKey(i, step, sb, stage)) for i, _, sb in self._owned(stage)) and (
            step == self._first_step
            or all(ready(TiedKey(i, step - 1, sa, stage)) for i, _, sa in self._followed(stage))
        )

    def before_update(self, stage: int, step: int) -> None:
        """After the stage's dp reduction, before its clipping."""
        held = self._weights[stage]
        for i, name, owner in self._followed(stage):
            if step == self._first_step:
                self._began[i] = held.value(name)
            grad = held.gradient(name)
            assert grad is not None, f"tied {name} on stage {stage} has no gradient"
            # a copy: the stage's clipping scales its gradients in place before the send is done
            self._transport.send(TiedKey(i, step, stage, owner), grad.clone())
            held.drop_gradient(name)
        for i, name, second in self._owned(stage):
            own = held.gradient(name)
            assert own is not None, f"tied {name} on stage {stage} has no gradient"
            held.set_gradient(name, own + self._transport.recv(TiedKey(i, step, second, stage)))

    def after_update(self, stage: int, step: int) -> None:
        held = self._weights[stage]
        for i, name, second in self._owned(stage):
            self._transport.send(TiedKey(i, step, stage, second), held.value(name))
        for i, name, owner in self._followed(stage):
            began = step == self._first_step
            value = self._began.pop(i) if began else self._owners_value(i, step - 1, owner, stage)
            held.set_value(name, value)
            self._last_step[stage] = step

    def finish(self) -> None:
        """After the program: each second copy takes its owner's last value."""
        for stage, step in self._last_step.items():
            for i, name, owner in self._followed(stage):
                self._weights[stage].set_value(name, self._owners_value(i, step, owner, stage))
        self._last_step.clear()

    def _owners_value(self, pair: int, step: int, owner: int, stage: int) -> torch.Tensor:
        return self._transport.recv(TiedKey(pair, step, owner, stage))
