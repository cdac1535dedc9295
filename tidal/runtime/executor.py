"""The per-rank interpreter of a :class:`~tidal.pipeline.ir.Schedule`.

Messages (:class:`Transport`, :class:`LocalTransport`, :class:`MessageKey`) live in
:mod:`tidal.runtime.p2p` and are re-exported here.

One :class:`RankExecutor` walks one rank's program and owns a :class:`StageRunner` per stage of
that rank. :func:`~tidal.runtime.local.run_local` drives every rank's executor in this process
over a :class:`LocalTransport`: the single-process simulator of a pipeline's weight delays.
:mod:`tidal.runtime.distributed` drives one executor per process over ``torch.distributed``.

[Note: one executor, bit-identical runs]
A stage's arithmetic depends only on its own inputs (activations, gradients, the batch) and its
own state (weights, optimizer, versions), and each rank performs its stages' actions in its
program's order whatever the other ranks do. So the interleaving that :func:`run_local` picks,
and the timing of a distributed run, cannot change any number: a distributed run of a schedule
equals :func:`run_local` of it bit for bit, as long as the stages run the same kernels (same
thread count) and no cross-stage reduction is involved. The one cross-stage reduction is the
global gradient norm of synchronous schedules (an all-reduce whose summation order may differ
from the local sum), so synchronous runs with clipping match to rounding, not bitwise.

[Note: loss and gradient scale]
A step's loss is the row-weighted mean of its microbatches' mean losses: microbatch ``i`` of a
batch of ``R`` rows holds ``r_i`` rows (``tensor_split`` along dim 0, so uneven splits are
allowed) and the last stage backpropagates ``loss_i * r_i / R``. With equal token counts per
row the accumulated gradients are the gradients of the whole batch's mean loss, whatever ``m``.

[Note: backward and weight-gradient actions]
``B`` is the whole backward of a microbatch unless the program also has a ``W`` for it. Then
``B`` computes only the input gradient (``autograd.grad`` keeping the graph) and ``W``
backpropagates again restricted to the parameters. That costs a second pass over the graph:
correct zero-bubble semantics, not zero-bubble speed. No generated schedule has ``W`` yet.

[Note: why one file]
The interpreter (RankExecutor) and the per-stage state it drives (StageRunner, Microbatches)
share the in-flight bookkeeping that makes local and distributed runs bit-identical; splitting
them would expose that bookkeeping across modules. The transports live in p2p.py, the
one-process runner and its barrier in local.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidal.config import ConfigError, require
from tidal.memory.optim_rules import clip_factor
from tidal.parallel.stage_params import StageParams
from tidal.pipeline.ir import Action, Kind, Schedule, with_communication
from tidal.pipeline.lending import Lending
from tidal.runtime.p2p import (
    Direction,
    LendKey,
    LocalTransport,
    MessageKey,
    PipelineDeadlock,
    Transport,
)
from tidal.runtime.precision import LossScaler
from tidal.runtime.tied import TiedExchange, TiedPair

__all__ = [
    "Direction",
    "LocalTransport",
    "MessageKey",
    "Microbatches",
    "PipelineDeadlock",
    "RankExecutor",
    "StageRunner",
    "StageParams",
    "TiedPair",
    "Transport",
    "UpdateRules",
]

BatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LrFn = Callable[[int], float]


# ---------------------------------------------------------------------------------------------
# data


class Microbatches:
    """Splits ``batch_fn(step)`` into ``m`` microbatches, on demand, for global microbatch ids.

    Microbatch ``mb`` is row slice ``mb % m`` of the batch of step ``step_offset + mb // m``
    (``torch.tensor_split`` along dim 0). ``batch_fn`` is called once per step, only by
    executors holding the first or last stage, and a step is dropped once its ``uses_per_row``
    reads (one for the first stage's inputs, one for the last stage's targets) are done.
    """

    def __init__(
        self, batch_fn: BatchFn, num_microbatches: int, *, step_offset: int = 0, uses: int = 2
    ) -> None:
        self._batch_fn = batch_fn
        self.num_microbatches = num_microbatches
        self.step_offset = step_offset
        self._uses = uses
        self._steps: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self._pending: dict[int, int] = {}
        self._rows: dict[int, tuple[int, int]] = {}

    def _split(self, mb: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        step = mb // self.num_microbatches
        if step not in self._steps:
            idx_BT, targets_BT = self._batch_fn(self.step_offset + step)
            rows = idx_BT.shape[0]
            m = self.num_microbatches
            if m > rows:
                raise ConfigError(
                    "microbatches",
                    f"{m} microbatches but the batch of step {self.step_offset + step} has "
                    f"{rows} rows; use at most {rows} microbatches or a larger batch",
                )
            assert targets_BT.shape[0] == rows, (idx_BT.shape, targets_BT.shape)
            self._steps[step] = (
                torch.tensor_split(idx_BT, m, dim=0),
                torch.tensor_split(targets_BT, m, dim=0),
            )
            self._pending[step] = m * self._uses
        return self._steps[step]

    def _used(self, mb: int) -> None:
        step = mb // self.num_microbatches
        self._pending[step] -= 1
        if self._pending[step] == 0:
            del self._steps[step], self._pending[step]

    def inputs(self, mb: int) -> torch.Tensor:
        out = self._split(mb)[0][mb % self.num_microbatches]
        self._used(mb)
        return out

    def targets(self, mb: int) -> tuple[torch.Tensor, float]:
        """The targets of ``mb`` and its share ``r_i / R`` of the step's rows."""
        splits = self._split(mb)[1]
        out = splits[mb % self.num_microbatches]
        total = sum(t.shape[0] for t in splits)
        self._used(mb)
        return out, out.shape[0] / total


# ---------------------------------------------------------------------------------------------
# one stage


@dataclass(slots=True)
class _InFlight:
    """A microbatch between its F and its B (or W)."""

    input: torch.Tensor  # token ids on the first stage, else a leaf activation
    output: torch.Tensor  # the scaled loss on the last stage, else the activation
    forward_version: int
    grad: torch.Tensor | None = None  # of the output, kept from B for a split W


class StageRunner:
    """One stage on this rank: its module, weights, microbatches in flight and records.

    ``delays[mb]`` is the measured tau of microbatch ``mb``: the stage's version when its
    ``B`` ran minus its version at ``F`` (the next update applies to the version current at
    ``B``). On the last stage ``losses[mb]`` holds ``(mean loss, row share)``.
    """

    def __init__(
        self,
        *,
        index: int,
        num_stages: int,
        module: nn.Module,
        weights: StageParams,
        split_weight_grad: frozenset[int] = frozenset(),
        scaler: LossScaler | None = None,
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.module = module
        self.weights = weights
        self.num_updates = 0
        self.delays: dict[int, int] = {}
        self.losses: dict[int, tuple[torch.Tensor, float]] = {}
        self._split_w = split_weight_grad
        self._scaler = scaler
        self._in_flight: dict[int, _InFlight] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    def forward(
        self,
        mb: int,
        x: torch.Tensor,
        targets: tuple[torch.Tensor, float] | None,
        *,
        version: int | None = None,
    ) -> torch.Tensor | None:
        """Run F on weight ``version`` (default: the current one); returns the activation to
        hand to the next stage (None on the last)."""
        assert mb not in self._in_flight, f"stage {self.index}: F{mb} twice"
        if not self.is_first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if version is None:
            version = self.weights.version
        with self.weights.forward(mb, version=version):
            if self.is_last:
                assert targets is not None
                targets_BT, share = targets
                loss = self.module(x, targets_BT)
                self.losses[mb] = (loss.detach(), share)
                scale = 1.0 if self._scaler is None else self._scaler.scale
                out = loss * (share * scale)  # [Note: pipeline mixed precision]
            else:
                out = self.module(x)
        self._in_flight[mb] = _InFlight(input=x, output=out, forward_version=version)
        return None if self.is_last else out.detach()

    def backward(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Run B; returns the gradient of this stage's input (None on the first stage)."""
        state = self._in_flight[mb]
        assert (grad is None) == self.is_last, f"stage {self.index}: B{mb} gradient mismatch"
        self.delays[mb] = self.weights.version - state.forward_version
        want_input = not self.is_first and state.input.requires_grad
        with self.weights.backward(mb, last=mb not in self._split_w):
            if mb in self._split_w:
                state.grad = grad
                if not want_input:
                    return None
                (dx,) = torch.autograd.grad(
                    state.output, state.input, grad, retain_graph=True, allow_unused=True
                )
                return torch.zeros_like(state.input) if dx is None else dx
            torch.autograd.backward(state.output, grad)
        del self._in_flight[mb]
        if not want_input:
            return None
        grad_in = state.input.grad
        return torch.zeros_like(state.input) if grad_in is None else grad_in

    def weight_grad(self, mb: int) -> None:
        """Run a split W: the parameter gradients of ``mb`` (see [Note: backward and ...])."""
        state = self._in_flight.pop(mb)
        params = [p for _, p in self.parameters()]
        with self.weights.backward(mb):
            torch.autograd.backward(state.output, state.grad, inputs=params)

    def in_flight(self) -> list[int]:
        return sorted(self._in_flight)


# ---------------------------------------------------------------------------------------------
# updates


@dataclass(kw_only=True, frozen=True, slots=True)
class UpdateRules:
    """What happens at ``U`` besides the optimizer step.

    Attributes:
        max_grad_norm: clip gradients to this norm; ``None`` disables clipping. Synchronous
            schedules clip by the global norm over every stage (the tied matrix counted once);
            asynchronous ones clip each stage by its own norm, because a global norm would need
            every stage's gradient of the same step at once, i.e. a flush.
        tied: matrices held by two stages whose gradients are summed before the update
            (asynchronous schedules: [Note: tied matrices without a flush] in tied.py).
    """

    max_grad_norm: float | None = None
    tied: tuple[TiedPair, ...] = ()

    def __post_init__(self) -> None:
        require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            f"must be > 0 (or None to disable clipping), got {self.max_grad_norm}",
        )

    def second_copies(self, stage: int) -> frozenset[str]:
        """The names on ``stage`` of tied second copies (their gradient equals the first's, so
        a norm counts it once)."""
        return frozenset(name for _, (s, name) in self.tied if s == stage)


def _clip_stage(runner: StageRunner, max_norm: float, skip: frozenset[str]) -> None:
    squares = runner.weights.grad_squares(skip=skip)
    runner.weights.scale_grads(clip_factor(squares.sqrt(), max_norm))


# ---------------------------------------------------------------------------------------------
# one rank


def _split_weight_grads(program: Sequence[Action]) -> dict[int, frozenset[int]]:
    found: dict[int, set[int]] = {}
    for a in program:
        if a.kind is Kind.WEIGHT_GRAD:
            found.setdefault(a.stage, set()).add(a.microbatch)
    return {s: frozenset(mbs) for s, mbs in found.items()}


class RankExecutor:
    """Walks one rank's program (with communication actions) over its stages.

    ``prepare_step(step)`` runs once per step at the rank's first ``U`` of a synchronous
    schedule (tied-gradient sum and global clipping, collective in a distributed run); for an
    asynchronous schedule each ``U`` clips its own stage instead. ``U`` of a stage's ``k``-th
    update in this program uses step ``step_offset + k`` for ``lr_fn`` and the optimizer.
    """

    def __init__(
        self,
        *,
        schedule: Schedule,
        rank: int,
        modules: Mapping[int, nn.Module],
        weights: Mapping[int, StageParams],
        transport: Transport,
        data: Microbatches,
        lr_fn: LrFn,
        rules: UpdateRules,
        prepare_step: Callable[[int], None] | None = None,
        step_offset: int = 0,
        lending: Lending | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        if not any(a.kind.is_comm for _, a in schedule.actions()) and schedule.num_ranks > 1:
            schedule = with_communication(schedule)
        self.schedule = schedule
        self.rank = rank
        self.program = schedule.programs[rank]
        require(
            sorted(modules) == schedule.stages_of(rank) == sorted(weights),
            "stages",
            f"rank {rank} of {schedule.name} holds stages {schedule.stages_of(rank)}; got "
            f"modules for {sorted(modules)} and weights for {sorted(weights)}",
        )
        split_w = _split_weight_grads(self.program)
        self.runners = {
            s: StageRunner(
                index=s,
                num_stages=schedule.num_stages,
                module=modules[s],
                weights=weights[s],
                split_weight_grad=split_w.get(s, frozenset()),
                scaler=scaler,
            )
            for s in schedule.stages_of(rank)
        }
        self.transport = transport
        self.data = data
        self.lr_fn = lr_fn
        self.rules = rules
        self.prepare_step = prepare_step
        self.scaler = scaler
        self.step_offset = step_offset
        self.prepared: set[int] = set()
        self.lrs: dict[tuple[int, int], float] = {}  # (stage, step) -> learning rate used
        # The programs number versions from 0; the weights count every update they ever did.
        self.version_offset = {s: w.version for s, w in weights.items()}
        self.pc = 0
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> activation
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output grad
        self._outgoing: dict[MessageKey, torch.Tensor] = {}
        self.lending = lending
        self._lent: dict[LendKey, object] = {}  # what each stage lent, until it is back
        self._held: dict[LendKey, torch.Tensor] = {}  # what this rank holds for others
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.tied = (TiedExchange(rules.tied, weights, transport, first_step=step_offset)
                     if rules.tied and schedule.asynchronous else None)  # fmt: skip

    @property
    def done(self) -> bool:
        return self.pc == len(self.program)

    @property
    def next_action(self) -> Action | None:
        return None if self.done else self.program[self.pc]

    def update_step(self, action: Action) -> int:
        return self.step_offset + self.runners[action.stage].num_updates

    def ready(self, action: Action) -> bool:
        """Whether ``action`` can run now without waiting on another rank (for run_local)."""
        s, mb = action.stage, action.microbatch
        if action.kind is Kind.RECV_FORWARD:
            return self.transport.ready(MessageKey(s - 1, s, mb))
        if action.kind is Kind.RECV_BACKWARD:
            return self.transport.ready(MessageKey(s + 1, s, mb))
        if action.kind is Kind.FORWARD:
            return s == 0 or (s, mb) in self._inputs
        if action.kind is Kind.BACKWARD:
            return s == self.schedule.num_stages - 1 or (s, mb) in self._grads
        if action.kind is Kind.UPDATE and self.synchronous:
            return self.update_step(action) in self.prepared
        if action.kind is Kind.UPDATE and self.tied is not None:
            return self.tied.ready(s, self.update_step(action))
        if action.kind is Kind.HOLD:
            return self.transport.ready(self._lend_key(action, home=False))
        if action.kind is Kind.RECLAIM:
            return self.transport.ready(self._lend_key(action, home=True))
        return True

    def _lend_key(self, a: Action, *, home: bool) -> LendKey:
        assert a.peer is not None
        lender = self.rank if a.kind in (Kind.HOLD, Kind.GIVE_BACK) else a.peer
        return LendKey(a.stage, a.microbatch, lender, home=home)

    @property
    def synchronous(self) -> bool:
        return not self.schedule.asynchronous

    def step(self) -> None:
        """Run the next action."""
        action = self.program[self.pc]
        try:
            self._execute(action)
        except KeyError as exc:
            raise PipelineDeadlock(
                f"rank {self.rank}: {action} needs {exc} which no earlier action produced"
            ) from exc
        self.pc += 1

    def run(self) -> None:
        """Run the whole program in order (a distributed rank: receives block)."""
        while not self.done:
            self.step()
        self.finish()
        self.transport.flush()

    def finish(self) -> None:
        """After the program: what the last updates leave to receive (a tied copy's value)."""
        if self.tied is not None:
            self.tied.finish()

    def _execute(self, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        if a.kind is Kind.RECV_FORWARD:
            self._inputs[s, mb] = self.transport.recv(MessageKey(s - 1, s, mb))
        elif a.kind is Kind.RECV_BACKWARD:
            self._grads[s, mb] = self.transport.recv(MessageKey(s + 1, s, mb))
        elif a.kind is Kind.SEND_FORWARD:
            key = MessageKey(s, s + 1, mb)
            self.transport.send(key, self._outgoing.pop(key))
        elif a.kind is Kind.SEND_BACKWARD:
            key = MessageKey(s, s - 1, mb)
            self.transport.send(key, self._outgoing.pop(key))
        elif a.kind is Kind.FORWARD:
            version = None if a.version is None else a.version + self.version_offset[s]
            self._forward(s, mb, version)
        elif a.kind is Kind.BACKWARD:
            self._backward(s, mb)
        elif a.kind is Kind.WEIGHT_GRAD:
            self.runners[s].weight_grad(mb)
        elif a.kind.is_lending:
            self._lend(a)
        else:
            self._update(a)

    def _lend(self, a: Action) -> None:
        """[Note: lending] in tidal/pipeline/lending.py."""
        assert self.lending is not None, f"rank {self.rank}: {a} without lending"
        if a.kind is Kind.LEND:
            assert a.peer is not None
            flat, bundle = self.lending.swaps[a.stage].close(a.peer)
            key = self._lend_key(a, home=False)
            self._lent[key] = bundle
            self.transport.send(key, flat)
        elif a.kind is Kind.RECLAIM:
            start = time.perf_counter()
            flat = self.transport.recv(self._lend_key(a, home=True))
            if self.lending.on_reclaim is not None:
                self.lending.on_reclaim(time.perf_counter() - start)
            bundle = self._lent.pop(self._lend_key(a, home=False))
            self.lending.swaps[a.stage].restore(bundle, flat)
        elif a.kind is Kind.HOLD:
            held = self.transport.recv(self._lend_key(a, home=False))
            self._held[self._lend_key(a, home=True)] = held
            self._holding(held.numel())
        else:
            held = self._held.pop(self._lend_key(a, home=True))
            self.transport.send(self._lend_key(a, home=True), held)
            self._holding(-held.numel())

    def _holding(self, num_bytes: int) -> None:
        self.held_bytes += num_bytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        if self.lending is not None and self.lending.on_hold is not None:
            self.lending.on_hold(self.held_bytes)

    def _forward(self, s: int, mb: int, version: int | None) -> None:
        runner = self.runners[s]
        x = self.data.inputs(mb) if runner.is_first else self._inputs.pop((s, mb))
        targets = self.data.targets(mb) if runner.is_last else None
        out = runner.forward(mb, x, targets, version=version)
        if out is None:
            return
        if s + 1 in self.runners:  # the next stage is on this rank: no message
            self._inputs[s + 1, mb] = out
        else:
            self._outgoing[MessageKey(s, s + 1, mb)] = out

    def _backward(self, s: int, mb: int) -> None:
        runner = self.runners[s]
        grad = None if runner.is_last else self._grads.pop((s, mb))
        dx = runner.backward(mb, grad)
        if dx is None:
            return
        if s - 1 in self.runners:
            self._grads[s - 1, mb] = dx
        else:
            self._outgoing[MessageKey(s, s - 1, mb)] = dx

    def _update(self, a: Action) -> None:
        runner = self.runners[a.stage]
        step = self.update_step(a)
        if self.synchronous:
            if step not in self.prepared:
                assert self.prepare_step is not None, "synchronous update without prepare_step"
                self.prepare_step(step)
                self.prepared.add(step)
        else:  # no flush: each stage reduces and clips its own gradients at its update
            runner.weights.reduce_gradients()
            if self.tied is not None:
                self.tied.before_update(a.stage, step)
            if self.rules.max_grad_norm is not None:
                _clip_stage(runner, self.rules.max_grad_norm, self.rules.second_copies(a.stage))
        if self.scaler is not None and self.scaler.skips(step):
            runner.weights.skip_step()
        else:
            self.lrs[a.stage, step] = runner.weights.step(lr=self.lr_fn(step), step=step)
        if self.tied is not None:
            self.tied.after_update(a.stage, step)
        runner.num_updates += 1
        expected = None if a.version is None else a.version + self.version_offset[a.stage]
        if expected is not None and runner.weights.version != expected:
            raise RuntimeError(
                f"rank {self.rank}: {a} should produce version {expected}, the stage's "
                f"weights are at {runner.weights.version}"
            )

    def step_losses(self, num_steps: int) -> list[float]:
        """Row-weighted mean loss per step of this program (the last stage's rank only)."""
        last = self.runners[self.schedule.num_stages - 1]
        m = self.schedule.num_microbatches
        out = []
        for step in range(num_steps):
            total = torch.zeros((), dtype=torch.float32)
            for mb in range(step * m, (step + 1) * m):
                loss, share = last.losses[mb]
                total = total + loss.float() * share
            out.append(float(total))
        return out


# ---------------------------------------------------------------------------------------------
# every rank in one process
