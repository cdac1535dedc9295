"""A pipeline stage whose parameters live in chunks: :class:`ChunkStageParams`.

The stage-parameter protocol ([Note: the stage-parameter protocol] in
tidal/parallel/stage_params.py) over a :class:`~tidal.parallel.chunk_engine.ChunkEngine` built
on the stage's module: the engine's construction (layout, store, optimizer, hooks, parameter
uses) and its parts are used as they are, and this class drives the store and the optimizer
at the pipeline's moments instead of the engine's ``__call__``/``backward``/``step``. The
store's policy stays the only place where placement is decided.

[Note: chunk stages]
One chunk-store iteration is one pipeline step of the stage: it begins at the step's first
forward on the stage and ends once the step's last backward is done, in ``reduce_gradients``
(which the executor calls once per step, after the stage's last backward and before anything
reads the gradients), or at the latest in ``step``. Why not the engine's iteration (one forward
and its backward, [Note: chunk engine iterations]):

- a stage runs several forwards before their backwards (GPipe: every F, then every B; 1F1B:
  F0 F1 B0 F2 B1 ...), so per-microbatch iterations would overlap, and the store records one
  iteration at a time;
- the trace must describe a unit that repeats, for Belady's next-use figures and the prefetch
  to be right: a synchronous schedule runs the same actions on a stage at every step, so the
  step's whole sequence of moments, with the activations of every microbatch in flight at each
  of them, is the same from one step to the next (a single F or B is not: what is live around
  it depends on its place in the step);
- what happens between iterations must happen between steps: the optimizer's update evicts
  every unpinned chunk and rewrites the weights, and relayout and pinning, chosen from the
  trace, move chunks; none of that may come between a microbatch's forward and its backward.

Every microbatch's gradient is summed into the fp32 gradient chunks by the optimizer's
collector (the first backward of the step copies, the later ones add). Clipping is the
pipeline's: ``grad_squares`` and ``scale_grads`` read and scale the gradient chunks, and the
update runs with the optimizer's own clipping off.

[Note: gradients in parameter slots]
The chunk engine's ``chunk.grads_in_params`` ([Note: gradients in parameter chunks] in
tidal/memory/optim.py) writes each gradient into its parameter's bf16/fp16 slot, whose weights
the fp32 master keeps, and saves the fp32 gradient chunks: 4 bytes a parameter. A slot holds
one gradient, not a sum, so a stage takes it only with one backward a step, in one process, as
the whole model (``whole_model``: no matrix tied to another stage, whose gradient the tied sum
would read), under a synchronous schedule; elsewhere it stays off, and ``true`` is refused.
Then ``grad_squares`` reads the slots through the step's fp32 buffer, and ``scale_grads`` keeps
its factor for the update, which applies it to each chunk's fp32 copy (scaling the slots in
place would round the gradients to their precision first).

The chunks hold one weight version. Synchronous schedules (gpipe, 1f1b, interleaved) need no
other; of the asynchronous ones, PipeMare's (``pipemare``, ``pipemarew``) runs every forward and
backward on the current weights, which is what the chunks hold ([Note: PipeMare on chunk
stages]). PipeDream's and 2BW's stashed versions, and a forward asked for another version, are
refused (:func:`require_synchronous` refuses the schedule up front).

[Note: PipeMare on chunk stages]
Built with ``weights=AsyncConfig(...)``, a stage takes updates while microbatches are in flight.
Nothing needs redirecting: the forward's saved weights are views of the chunks' storages, which
keep their identity across evictions and refetches ([Note: chunk store] in
tidal/memory/store.py), and the backward's unpack brings the chunk back with whatever the
update wrote into it, the current weights, which is PipeMare's backward without correction. The
store's iteration then runs from one update to the next (the unit that repeats in the steady
state), not over a step with nothing in flight. Relayout runs only at an update with nothing in
flight (its moves would strand the saved views), so a stage whose optimizer is placed at an
update with microbatches in flight (stage 0 under PipeMare) keeps its first layout. Each
update's rate is PipeMare's rescheduled one for the delays the stage measured
(:func:`~tidal.pipeline.async_config.update_rate`, the same as plain stages'). Discrepancy
correction and weight prediction need a second weight-sized buffer beside the chunks, which
they do not have yet, so both are refused in one line, as is ``sharding.reduce_per_step``,
whose single reduction per step has no step to wait for.

Data parallelism of a stage is ZeRO-3 over its dp group (``parts=ShardedParts(...)``, every
dp rank running the same schedule on its slice of the batch): each backward reduce-scatters the
gradients of the chunks it completed into this rank's gradient shards, which sum the step's
microbatches ([Note: sharded gradients] in tidal/sharding/grads.py), so ``reduce_gradients``
has nothing left to reduce. A shard mixes parameters, so such a stage's ``grad_squares`` is
the shards' squares summed over the dp group (the same on every dp rank, as the pipeline's norm
expects of a stage), less a tied second copy's share. A parameter's gradient is spread over the
replicas' shards, each holding a disjoint range of it: ``gradient(name)`` sums the ranges into
the whole over the dp group (a tied matrix only, once a step) and ``set_gradient`` writes each
rank's range back, so a matrix tied across stages is summed on sharded stages as on plain ones.

The NVMe tier (``memory.nvme_dir``) is the sharded optimizer's, so a stage with one goes through
``zero3_parts`` even when its dp group is one rank. Gradient shards on disk are not read back to
be scaled: ``scale_grads`` keeps the factor and the update applies it as it streams each shard
in, as the optimizer applies its own clip coefficient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.config import ConfigError, require
from tidal.distributed.collectives import Collectives
from tidal.memory.config import ChunkConfig
from tidal.memory.hooks import OUTPUT_ONLY_HOOK_WARNING
from tidal.memory.materialize import ParameterValues
from tidal.memory.store import DeviceBudgetTooSmall
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig, OptimizerConfig, Precision, TrainingConfig
from tidal.parallel.parts import ChunkParts
from tidal.parallel.reference import autocast
from tidal.parallel.sharded_parts import ShardedParts
from tidal.pipeline.async_config import AsyncConfig, WeightMode, update_rate
from tidal.pipeline.ir import Schedule
from tidal.sharding.config import ShardingConfig

__all__ = [
    "ChunkStageConfig",
    "ChunkStageParams",
    "require_one_version",
    "require_synchronous",
    "zero3_parts",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class ChunkStageConfig:
    """How a stage's parameters are chunked and updated.

    Attributes:
        optimizer: the update rule and its settings (its lr schedule is not read: the pipeline
            passes each step's rate).
        memory: the stage's tier budgets (``device_budget``: this stage's chunks, gradients
            and state on the device, and its activations).
        chunk: chunk size and placement; ``grads_in_params`` applies to a stage that is the
            whole model with one backward a step ([Note: gradients in parameter slots]).
        precision: ``fp32``, ``bf16`` or ``fp16`` (fp32 masters, the forward under autocast;
            fp16's loss scale is the pipeline's).
        device: where the stage computes.
        sharding: how a stage sharded over its dp group (:func:`zero3_parts`) gathers and
            reduces (``reduce_per_step``: [Note: reducing once per step] in
            tidal/sharding/grads.py).
    """

    optimizer: OptimizerConfig
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    precision: Precision = "fp32"
    device: str = "cpu"
    sharding: ShardingConfig = field(default_factory=ShardingConfig)


def require_synchronous(schedule: Schedule) -> None:
    """Refuse a schedule chunk stages cannot run ([Note: chunk stages]): one line."""
    stashes = schedule.asynchronous and schedule.stashing != 1
    require_one_version(schedule.name, stashes=stashes)


def require_one_version(schedule: str, *, stashes: bool, correction: bool = False,
                        prediction: bool = False, reduce_per_step: bool = False) -> None:  # fmt: skip
    """Refuse, in one line each, what an asynchronous schedule on chunk stages cannot do
    ([Note: PipeMare on chunk stages]): the job's checks and the stage's call this alike."""
    require(not stashes, "pipeline.schedule",
            f"{schedule} keeps older weight versions for its backwards, but chunk stages hold "
            "one; use pipemare, gpipe, 1f1b or interleaved (or engine = 'reference')")  # fmt: skip
    for option, on in (("correction", correction), ("prediction", prediction)):
        require(not on, f"pipeline.{option}",
                f"{option} needs a weight-sized buffer beside the chunks, which chunk stages "
                f"do not keep yet; set pipeline.{option} = false or engine = 'reference'")  # fmt: skip
    require(not reduce_per_step, "sharding.reduce_per_step",
            f"{schedule} updates with microbatches in flight, so a step has no last backward "
            "to reduce after; set it to false")  # fmt: skip


def zero3_parts(
    config: ChunkStageConfig,
    dp_group: dist.ProcessGroup | None,
    *,
    sharding: ShardingConfig | None = None,
) -> ShardedParts:
    """A stage's chunks sharded over ``dp_group`` (its replicas: every rank of it holds the same
    stage and runs the same schedule on its slice of the batch; None: the default group, or a
    mesh of one without a process group); pass as ``parts``."""
    return ShardedParts(Collectives(dp_group), sharding=sharding or config.sharding,
                        memory=config.memory, optimizer=config.optimizer)  # fmt: skip


class ChunkStageParams:
    """One stage's parameters in chunks, driven at the pipeline's moments; see [Note: chunk
    stages]. ``parts``: where the chunks live (default: this process); ``microbatches_per_step``:
    the backwards a step runs on the stage, which ``sharding.reduce_per_step`` needs to know
    the last of; ``weights``: an asynchronous (PipeMare) schedule's settings, which lets
    updates come with microbatches in flight ([Note: PipeMare on chunk stages])."""

    def __init__(
        self,
        module: nn.Module,
        config: ChunkStageConfig,
        *,
        init: ParameterValues | None = None,
        parts: ChunkParts | None = None,
        microbatches_per_step: int | None = None,
        weights: AsyncConfig | None = None,
        whole_model: bool = False,
    ) -> None:
        training = TrainingConfig(device=config.device, precision=config.precision,
                                  grad_clip_norm=0.0)  # fmt: skip
        # [Note: gradients in parameter slots]
        slots = whole_model and parts is None and weights is None and microbatches_per_step == 1
        require(slots or config.chunk.grads_in_params is not True, "chunk.grads_in_params",
                "gradients in the parameters' slots need one backward a step on a model of one "
                "stage in one process; leave it unset or false")  # fmt: skip
        chunk = config.chunk if slots else dataclasses.replace(config.chunk, grads_in_params=False)
        self.engine = ChunkEngine(module, optimizer=config.optimizer, training=training,
                                  memory=config.memory, chunk=chunk, init=init, parts=parts)  # fmt: skip
        self.module = module
        self._version = 0
        self.skipped_updates = 0  # updates dropped for a non-finite gradient
        self._in_flight: dict[int, int] = {}  # forward done, backward not: its version
        self._weights = weights
        self.delays: dict[int, int] = {}  # microbatch -> tau ([Note: weight delay tau])
        self._pending: list[int] = []  # the taus of the backwards since the last update
        self.last_lr: float | None = None
        self.last_delay = 0.0  # the mean tau of the last update's microbatches
        self._open = False  # the store's iteration (this step's) is open
        self._backwards = 0  # this step's backwards begun on the stage
        self._reduce_per_step = config.sharding.reduce_per_step and self.sharded
        require(not self._reduce_per_step or microbatches_per_step is not None,
                "sharding.reduce_per_step", "needs the step's microbatches (microbatches_per_step)")  # fmt: skip
        self._microbatches_per_step = microbatches_per_step or 1
        if weights is not None:
            require_one_version("pipemare", stashes=weights.weights is not WeightMode.CURRENT,
                                correction=weights.correction, prediction=weights.prediction,
                                reduce_per_step=self._reduce_per_step)  # fmt: skip
        self._by_name = dict(module.named_parameters(remove_duplicate=False))
        # scale_grads' factor for the update to apply: gradient shards on disk, or in slots
        self._grad_factor: torch.Tensor | None = None

    @property
    def version(self) -> int:
        """Updates applied so far."""
        return self._version

    @property
    def store(self) -> Any:
        return self.engine.store

    @property
    def optimizer(self) -> Any:
        """The chunk optimizer (its ``state_dict`` is what a stage checkpoint saves)."""
        return self.engine.optimizer

    # -- forward and backward ----------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, microbatch: int, *, version: int | None = None) -> Iterator[None]:
        """The stage's forward of ``microbatch``, inside this step's store iteration."""
        if version is not None and version != self._version:
            raise ValueError(
                f"microbatch {microbatch} asks for weight version {version} but a chunk stage "
                f"holds only its current one ({self._version}): run a synchronous schedule"
            )
        if microbatch in self._in_flight:
            raise ValueError(f"microbatch {microbatch} is already in flight on this stage")
        engine = self.engine
        self._begin()
        engine.phases.forward()
        try:
            with self.store.meter.tracking(), autocast(engine.precision, engine.device):
                yield
        except BaseException:
            engine.phases.forward_ended()
            self._abandon()
            raise
        self._in_flight[microbatch] = self._version

    @contextlib.contextmanager
    def backward(self, microbatch: int, *, last: bool = True) -> Iterator[None]:
        """Around ``microbatch``'s backward: its gradients are summed into the gradient chunks
        by the optimizer's collector as each parameter's is complete."""
        if microbatch not in self._in_flight:
            raise ValueError(f"microbatch {microbatch} has no forward in flight on this stage")
        engine = self.engine
        self._begin()  # after an update with microbatches in flight, a backward may come first
        tau = self._version - self._in_flight[microbatch]
        self.delays[microbatch] = tau
        if self._reduce_per_step:  # [Note: reducing once per step] in tidal/sharding/grads.py
            final = self._backwards + 1 >= self._microbatches_per_step
            engine.optimizer.gradients.accumulating = not final
        if last:
            self._backwards += 1
        engine.parts.before_backward(engine)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=OUTPUT_ONLY_HOOK_WARNING, category=UserWarning
                )
                yield
        except BaseException:
            self._abandon()
            raise
        self.store.release_all()  # modules whose backward hook did not fire
        engine.parts.after_backward(engine)
        if last:
            del self._in_flight[microbatch]
            self._pending.append(tau)
        if not self._in_flight:
            engine.phases.backward(grads_in_params=bool(self.store.grads_in_slots))

    def _begin(self) -> None:
        if not self._open:
            self.store.begin_iteration()
            self._open = True

    def _abandon(self) -> None:
        """A forward or backward raised: this step's iteration is no trace, its gradients
        no update."""
        self.store.abandon_iteration()
        self._open = False
        self._backwards = 0
        self._in_flight.clear()
        self.engine.zero_grad()

    def _end_iteration(self) -> None:
        if self._in_flight and self._weights is None:
            raise RuntimeError(
                f"microbatches {sorted(self._in_flight)} are in flight at the step's end: chunk "
                "stages run synchronous schedules only (gpipe, 1f1b, interleaved)"
            )
        self._backwards = 0
        if not self._open:
            return
        self._open = False
        try:
            self.store.end_iteration()
        except DeviceBudgetTooSmall:
            self.engine.zero_grad()  # no update may use the gradients of a step that did not fit
            raise

    # -- gradients ---------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Whether the chunks are sharded over a dp group (ZeRO-3)."""
        return bool(self.engine.parts.gathers)

    def reduce_gradients(self) -> None:
        """Ends the step's store iteration ([Note: chunk stages]); the dp reduction, if any,
        ran in each backward already."""
        self._end_iteration()

    @property
    def _in_slots(self) -> bool:
        return bool(self.engine.optimizer.grads_in_params)

    def grad_squares(self, *, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        if self.sharded:
            return self._sharded_grad_squares(skip)
        if self._in_slots:  # the whole model: no tied copy to leave out
            assert not skip, f"a stage of the whole model has no tied copy elsewhere: {skip}"
            return self.engine.optimizer.squares_in_params()
        total = torch.zeros((), dtype=torch.float32)
        for name, grad in self.engine.optimizer.gradients():
            if name not in skip:
                total = total + torch.linalg.vector_norm(grad.float()).square().cpu()
        return total

    def _sharded_grad_squares(self, skip: frozenset[str]) -> torch.Tensor:
        optimizer = self.engine.optimizer
        norms = optimizer.gradients.norms()
        squares = torch.zeros((), dtype=torch.float64)
        if norms:
            squares = torch.stack([norms[i].double().cpu() ** 2 for i in sorted(norms)]).sum()
        for name in skip:  # a tied second copy's share of this rank's shards
            piece = optimizer.grad_piece(self._param(name))
            if piece is not None:
                squares = squares - piece[0].double().square().sum().cpu()
        optimizer.comm.all_reduce_sum(squares)
        return squares.float()

    def scale_grads(self, factor: torch.Tensor) -> None:
        optimizer = self.engine.optimizer
        if not self.sharded and not self._in_slots:
            optimizer.scale_gradients(factor)
            return
        # scaled as the update reads each gradient: a shard back from disk, or a chunk's slots
        # into the step's fp32 buffer, not rounded to their precision in place
        if self._in_slots or optimizer.gradients.on_disk:
            pending = self._grad_factor
            self._grad_factor = factor if pending is None else pending * factor
            return
        for grad in optimizer.gradients.in_memory():
            grad.mul_(factor.to(grad.device, grad.dtype))

    def gradient(self, name: str) -> torch.Tensor | None:
        """``name``'s whole gradient: a view into its gradient chunk, or, ZeRO-3, the dp group's
        shares summed into a new tensor (collective: every replica calls it)."""
        param = self._param(name)
        optimizer = self.engine.optimizer
        if not self.sharded:
            grad: torch.Tensor | None = optimizer.gradient_of(param)
            return grad
        if not optimizer.gradients.has_gradient(param):
            return None
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=self.engine.device)
        piece = optimizer.grad_piece(param)
        if piece is not None:
            share, start = piece
            whole[start : start + share.numel()] = share
        optimizer.comm.all_reduce_sum(whole)  # the shares are disjoint and cover it
        return whole.view(param.shape)

    def set_gradient(self, name: str, value: torch.Tensor) -> None:
        param = self._param(name)
        optimizer = self.engine.optimizer
        if not self.sharded:
            grad = optimizer.gradient_of(param)
            assert grad is not None, f"{name} has no gradient to replace"
            grad.copy_(value)
            return
        piece = optimizer.grad_piece(param)
        if piece is not None:
            share, start = piece
            share.copy_(value.reshape(-1)[start : start + share.numel()])

    def value(self, name: str) -> torch.Tensor:
        """``name``'s fp32 weights (its master), gathered on ZeRO-3 stages: collective."""
        return self.engine.read_parameter(self._param(name))

    def set_value(self, name: str, value: torch.Tensor) -> None:
        """Into ``name``'s slot and master (each replica its shard's range)."""
        self.engine.write_parameter(self._param(name), value)

    def drop_gradient(self, name: str) -> None:
        """Zeros: the chunk's update still moves the slot, by its optimizer state alone."""
        gradient = self.gradient(name)
        if gradient is not None:
            self.set_gradient(name, torch.zeros_like(gradient))

    def _param(self, name: str) -> nn.Parameter:
        param = self._by_name.get(name)
        if param is None:
            raise ConfigError("tied", f"this stage has no parameter {name!r}")
        return param

    # -- the update --------------------------------------------------------------------------

    def step(self, *, lr: float, step: int) -> float:
        """The chunk optimizer's update of the gradients held (clipped already); returns the
        rate it used: ``lr``, or under PipeMare its rescheduled rate for the delays measured
        ([Note: PipeMare on chunk stages]). A non-finite gradient drops the update (counted in
        ``skipped_updates``)."""
        self._end_iteration()
        if self._weights is not None:
            lr, self.last_delay = update_rate(self._weights, self._pending, lr, step)
        self._pending.clear()
        self.last_lr = lr
        engine = self.engine
        self.store.release_all()
        engine.parts.before_step(engine)  # relayout and pinning, once there is a trace
        factor, self._grad_factor = self._grad_factor, None
        if factor is None:
            norm = engine.optimizer.step(lr=lr, max_grad_norm=0.0)
        elif self._in_slots:  # an unscaling by 1 / factor is a multiply by factor
            norm = engine.optimizer.step(lr=lr, max_grad_norm=0.0, loss_scale=1.0 / float(factor))
        else:
            norm = engine.optimizer.step(lr=lr, max_grad_norm=0.0, grad_factor=factor)
        if norm is None:
            self.skipped_updates += 1
        engine.last_grad_norm = norm
        engine.phases.gradients_dropped()
        engine.counter.global_step = step + 1
        self._version += 1
        return lr

    def skip_step(self) -> None:
        """Drop the step's gradients without an update (the pipeline found them non-finite);
        the version advances as a step's would."""
        self._end_iteration()
        self._grad_factor = None
        self._pending.clear()
        self.store.release_all()
        self.engine.zero_grad()
        self.skipped_updates += 1
        self._version += 1

    # -- figures and state -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The chunk engine's figures: evictions, peak device bytes, the least budget, ..."""
        return self.engine.stats()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage module's state dict at full precision, read from the chunks."""
        return self.engine.model_state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._version = int(state["version"])
