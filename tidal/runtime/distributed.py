"""The distributed pipeline: one process per rank, point-to-point over ``torch.distributed``.

:class:`PipelineRuntime` holds one rank's stages and runs the rank's program of a schedule with
:class:`~tidal.runtime.executor.RankExecutor` over a :class:`P2PTransport`. What a stage computes
is exactly what :func:`~tidal.runtime.local.run_local` computes for it ([Note: one executor,
bit-identical runs]); this module only adds the wire and the cross-rank steps of an update.

[Note: synchronous and asynchronous training]
Synchronous schedules (gpipe, 1f1b, interleaved) run one flushed step per :meth:`train_step`;
at the rank's first ``U`` of a step the tied copies' gradients are summed over point-to-point
and the squared gradient norms are all-reduced over the pipeline group for global clipping.
Asynchronous schedules (pipedream, 2bw, pipemare, pipemarew) have no flush, so :meth:`train`
runs one long program over all its steps; each stage clips by its own norm, and a tied matrix's
second copy follows its owner ([Note: tied matrices without a flush] in tied.py). A checkpoint taken between two :meth:`train` calls of an asynchronous schedule is a
flush point: the program ends with no microbatch in flight, so a resumed run equals an
uninterrupted run of two programs, not of one program over all the steps. Gradient
accumulation is the ``m`` microbatches of a step; to accumulate more, raise ``m`` (the trainer
turns ``training.grad_accum_steps = k`` into ``k * m`` microbatches of ``k`` batches).
bf16 and fp16: [Note: pipeline mixed precision] in precision.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tidal.config import ConfigError, require
from tidal.pipeline.ir import Schedule, with_communication
from tidal.pipeline.lending import Lending, with_lending
from tidal.pipeline.schedules import SCHEDULE_NAMES, make_schedule
from tidal.runtime.executor import (
    BatchFn,
    LrFn,
    Microbatches,
    RankExecutor,
    StageParams,
    StageRunner,
    TiedPair,
    UpdateRules,
)
from tidal.runtime.p2p import TIED_TAG, P2PTransport, isend
from tidal.runtime.precision import LossScaler
from tidal.runtime.update import prepare_update

__all__ = ["P2PTransport", "PipelineRuntime", "RuntimeConfig"]

_SYNCHRONOUS = ("gpipe", "1f1b", "interleaved")  # flushed: one step per program


@dataclass(kw_only=True, frozen=True, slots=True)
class RuntimeConfig:
    """How :class:`PipelineRuntime` runs; the number of ranks is the pipeline group's size.

    Attributes:
        schedule: one of ``gpipe``, ``1f1b``, ``interleaved`` (synchronous) or ``pipedream``,
            ``2bw``, ``pipemare``, ``pipemarew`` (asynchronous).
        microbatches: ``m`` per optimizer step; may be below the number of ranks.
        virtual_stages: chunks per rank (``interleaved`` only).
        sync_steps: ``pipemarew``'s flushed warm-up steps, counted from step 0 of the run.
        max_grad_norm: gradient clipping (see :class:`~tidal.runtime.executor.UpdateRules`).
        partition: the stages' block ranges, recorded in checkpoints and checked on load.
        precision: fp32, bf16 or fp16 ([Note: pipeline mixed precision] in precision.py):
            fp16's loss scale lives here; the stages' autocast is their weights' own. Other
            than fp32 for synchronous schedules only.
    """

    schedule: str = "1f1b"
    microbatches: int
    virtual_stages: int = 1
    sync_steps: int = 0
    max_grad_norm: float | None = None
    partition: tuple[tuple[int, int], ...] = ()
    precision: str = "fp32"

    def __post_init__(self) -> None:
        require(
            self.schedule in SCHEDULE_NAMES,
            "schedule",
            f"unknown {self.schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}",
        )
        require(self.microbatches >= 1, "microbatches", f"must be >= 1, got {self.microbatches}")
        require(self.sync_steps >= 0, "sync_steps", f"must be >= 0, got {self.sync_steps}")
        require(
            self.precision == "fp32" or self.schedule in _SYNCHRONOUS,
            "training.precision",
            f"{self.schedule} is asynchronous, which trains in fp32 only (autocast's copies of "
            "the weights escape the saved-tensor redirection); set training.precision = 'fp32' "
            f"or use {', '.join(_SYNCHRONOUS)}",
        )

    def make(self, num_ranks: int, steps: int, first_step: int = 0) -> Schedule:
        """The schedule for ``steps`` steps starting at global step ``first_step``."""
        return make_schedule(
            self.schedule,
            stages=num_ranks,
            microbatches=self.microbatches,
            virtual=self.virtual_stages,
            steps=steps,
            sync_steps=min(steps, max(0, self.sync_steps - first_step)),
        )


class PipelineRuntime:
    """One rank's stages of a pipeline, trained over ``torch.distributed``.

    ``stages`` / ``weights`` are this rank's, in stage order (rank ``r`` holds stages ``r,
    r + p, ...``); ``tied`` the pairs of :func:`tidal.pipeline.split.tied_parameters` (global
    stage indices); ``group`` the pipeline's process group (default: the world); ``dp_group``
    the replicas of this rank's stages, each training on its own rows of every batch (the
    weights average their gradients; the losses are averaged here).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        stages: Sequence[nn.Module],
        weights: Sequence[StageParams],
        tied: Sequence[TiedPair] = (),
        group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        lending: Lending | None = None,
    ) -> None:
        self.config = config
        self.lending = lending
        self.group = group
        self.dp_group = dp_group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        probe = config.make(self.num_ranks, steps=1)
        self.asynchronous = probe.asynchronous
        self.num_stages = probe.num_stages
        self.stage_ids = probe.stages_of(self.rank)
        require(
            len(stages) == len(weights) == len(self.stage_ids),
            "stages",
            f"rank {self.rank} of {config.schedule} holds stages {self.stage_ids}; got "
            f"{len(stages)} modules and {len(weights)} weights",
        )
        require(
            not config.partition or len(config.partition) == self.num_stages,
            "partition",
            f"{len(config.partition)} block ranges for {self.num_stages} stages",
        )
        self.modules = dict(zip(self.stage_ids, stages, strict=True))
        self.weights = dict(zip(self.stage_ids, weights, strict=True))
        self.rules = UpdateRules(max_grad_norm=config.max_grad_norm, tied=tuple(tied))
        self.scaler = LossScaler(config.precision)
        self.step = 0
        self.delays: dict[tuple[int, int], int] = {}  # (stage, global microbatch) -> tau
        self.lrs: dict[tuple[int, int], float] = {}  # (stage, step) -> learning rate used
        self._runners: dict[int, StageRunner] = {}
        # payload bytes this rank sent to other pipeline ranks, headers left out: activations,
        # their gradients, lent tensors and tied gradients ([Note: point-to-point protocol])
        self.bytes_sent = 0
        # the global gradient norm of the last synchronous step, before clipping (unscaled)
        self.last_grad_norm: float | None = None

    # -- training ---------------------------------------------------------------------------

    def train(self, num_steps: int, batch_fn: BatchFn, lr_fn: LrFn) -> list[float]:
        """``num_steps`` optimizer steps; every rank gets the per-step losses.

        ``batch_fn(step) -> (idx_BT, targets_BT)`` is called on the ranks holding the first or
        the last stage, once per step; ``lr_fn(step)`` at each update. Synchronous schedules run
        :meth:`train_step` per step, asynchronous ones one program over all the steps.
        """
        require(num_steps >= 1, "num_steps", f"must be >= 1, got {num_steps}")
        if not self.asynchronous:
            return [self.train_step(batch_fn, lr_fn) for _ in range(num_steps)]
        return self._run(num_steps, batch_fn, lr_fn)

    def train_step(self, batch_fn: BatchFn, lr_fn: LrFn) -> float:
        """One flushed step of a synchronous schedule; returns its loss."""
        require(
            not self.asynchronous,
            "schedule",
            f"{self.config.schedule} is asynchronous: use train(num_steps, ...), one program "
            "over every step",
        )
        return self._run(1, batch_fn, lr_fn)[0]

    def _run(self, num_steps: int, batch_fn: BatchFn, lr_fn: LrFn) -> list[float]:
        schedule = with_communication(self.config.make(self.num_ranks, num_steps, self.step))
        if self.lending is not None:  # [Note: lending] in tidal/pipeline/lending.py
            schedule = with_lending(schedule, self.lending.lenders)
        last = self.num_stages - 1
        uses = sum(s in (0, last) for s in self.stage_ids) + (last == 0)
        transport = P2PTransport(schedule, self.rank, group=self.group, device=self.device)
        executor = RankExecutor(
            schedule=schedule,
            rank=self.rank,
            modules=self.modules,
            weights=self.weights,
            transport=transport,
            data=Microbatches(batch_fn, self.config.microbatches, step_offset=self.step, uses=uses),
            lr_fn=lr_fn,
            rules=self.rules,
            prepare_step=self._prepare_step,
            step_offset=self.step,
            lending=self.lending,
            scaler=self.scaler,
        )
        self._runners = executor.runners
        executor.run()
        self.bytes_sent += transport.bytes_sent
        first_mb = self.step * self.config.microbatches
        for s, runner in executor.runners.items():
            self.delays.update({(s, first_mb + mb): tau for mb, tau in runner.delays.items()})
        self.lrs.update(executor.lrs)
        losses = torch.zeros(num_steps, dtype=torch.float64)
        if last in self.stage_ids:
            losses = torch.tensor(executor.step_losses(num_steps), dtype=torch.float64)
        losses = losses.to(self._collective_device())
        dist.broadcast(losses, src=self._global(schedule.rank_of(last)), group=self.group)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(losses, group=self.dp_group)  # each replica's rows: equal shares
            losses /= dist.get_world_size(self.dp_group)
        self.step += num_steps
        return [float(x) for x in losses.cpu()]

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # -- the synchronous update --------------------------------------------------------------

    def _prepare_step(self, step: int) -> None:
        """[Note: the update's order] in update.py, the squares summed over the pipeline group."""

        def over_pipeline(squares: torch.Tensor) -> torch.Tensor:
            squares = squares.to(self._collective_device())
            dist.all_reduce(squares, group=self.group)
            return squares

        held = {s: self.weights[s] for s in self.stage_ids}
        self.last_grad_norm = prepare_update(held, rules=self.rules, scaler=self.scaler,
                                             step=step, sum_over_pipeline=over_pipeline,
                                             sum_tied=self._sum_tied)  # fmt: skip

    def _sum_tied(self, pair: TiedPair) -> None:
        """Both copies' gradients become ``first + second`` (same order on both ranks)."""
        (sa, na), (sb, nb) = pair
        mine = [(s, n) for s, n in pair if s in self.modules]
        if not mine:
            return
        grads: dict[tuple[int, str], torch.Tensor] = {}
        for s, n in mine:
            grad = self.weights[s].gradient(n)
            assert grad is not None, f"tied parameter {(s, n)} has no gradient"
            grads[s, n] = grad
        if len(mine) == 2:
            total = grads[sa, na] + grads[sb, nb]
        else:
            (own,) = mine
            peer_stage = sb if own[0] == sa else sa
            peer = self._global(peer_stage % self.num_ranks)
            g = grads[own]
            other = torch.empty_like(g)
            work = isend(g.contiguous(), peer, self.group, tag=TIED_TAG)
            self.bytes_sent += g.numel() * g.element_size()
            dist.recv(other, src=peer, group=self.group, tag=TIED_TAG)
            work.wait()
            total = g + other if own[0] == sa else other + g
        for s, n in mine:
            self.weights[s].set_gradient(n, total)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters, whole and fp32, under the model's names (a weight the
        model ties under its first name); collective where a stage is sharded: every replica
        calls it."""
        from tidal.parallel.tensor_stage import model_order  # DTensor: loaded only for this

        out: dict[str, torch.Tensor] = {}
        for s, module in self.modules.items():
            source = cast(dict[str, str], module.source_names)  # a PipelineStage's
            values: dict[int, torch.Tensor] = {}
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) not in values:
                    value = self.weights[s].value(name)
                    values[id(param)] = model_order(module, name, value)
                out[source[name]] = values[id(param)]
        return out

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike[str], step: int | None = None) -> list[Path]:
        """Write ``stage-{s}.pt`` for each stage of this rank; returns the paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for s in self.stage_ids:
            path = folder / f"stage-{s}.pt"
            tmp = path.with_suffix(".pt.tmp")
            torch.save(self._stage_state(s, self.step if step is None else step), tmp)
            os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact
            paths.append(path)
        return paths

    def _stage_state(self, s: int, step: int) -> dict[str, Any]:
        weights = self.weights[s]
        optimizer = getattr(weights, "optimizer", None)
        return {
            "stage": s,
            "num_stages": self.num_stages,
            "schedule": self.config.schedule,
            "microbatches": self.config.microbatches,
            "partition": [list(r) for r in self.config.partition],
            "step": step,
            "module": self.modules[s].state_dict(),
            "weights": _state_dict(weights),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "loss_scale": self.scaler.state_dict(),
        }

    def load(self, folder: str | os.PathLike[str]) -> int:
        """Restore this rank's stages from :meth:`save`'s files; returns the step to resume at."""
        steps = set()
        for s in self.stage_ids:
            path = Path(folder) / f"stage-{s}.pt"
            require(path.exists(), "checkpoint", f"{path} is missing; save() writes it")
            state = torch.load(path, map_location=self.device, weights_only=True)
            self._check(state, path)
            self.modules[s].load_state_dict(state["module"])
            weights = self.weights[s]
            if state["optimizer"] is not None:
                weights.optimizer.load_state_dict(state["optimizer"])  # type: ignore[attr-defined]
            if state["weights"] is not None:
                weights.load_state_dict(state["weights"])  # type: ignore[attr-defined]
            self.scaler.load_state_dict(state.get("loss_scale"))
            steps.add(int(state["step"]))
        require(len(steps) == 1, "checkpoint", f"stages of {folder} are at steps {sorted(steps)}")
        (self.step,) = steps
        return self.step

    def _check(self, state: dict[str, Any], path: Path) -> None:
        expected = {
            "num_stages": self.num_stages,
            "schedule": self.config.schedule,
            "partition": [list(r) for r in self.config.partition],
        }
        for key, want in expected.items():
            if state[key] != want:
                raise ConfigError(
                    "checkpoint",
                    f"{path} was saved with {key}={state[key]!r}, this run has {want!r}; "
                    "resume with the same schedule and partition",
                )


def _state_dict(weights: StageParams) -> Any:
    fn: Callable[[], Any] | None = getattr(weights, "state_dict", None)
    return None if fn is None else fn()
