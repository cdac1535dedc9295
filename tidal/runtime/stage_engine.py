"""``tidal.initialize``'s engine for a model held on one stage: :class:`StageEngine`.

[Note: one model on stages]
``tidal.initialize(model, config)`` trains the model as one stage: plain replicas averaged
over the ranks (``engine = "reference"``, the model data checked against
``memory.device_budget`` as the reference engine checks it), sharded by FSDP2
(``parallel.fsdp2 = true``, [Note: FSDP2 stages] in fsdp_stage.py) or in tidal's chunks
(``engine = "chunk"``, ZeRO-3 over the ranks, a meta model's values streamed in: [Note: chunk
stages] in tidal/parallel/chunk_stage.py; the store's figures in ``stats()``): the same
transform a pipeline stage gets, the same parameter holder chosen by the same function
(:func:`~tidal.runtime.build.stage_params`) and the same update
(:func:`~tidal.runtime.update.prepare_update`: reduction, norm, loss scaler, clip), driven by
DeepSpeed's calling convention instead of a schedule: each ``engine(...)`` is a microbatch's
forward, each ``backward(loss)`` its backward, and every ``grad_accum_steps``-th ``step()``
the update ([Note: accumulation boundary] in tidal/parallel/accumulation.py). Each rank passes
its own rows; the gradient is the mean over the ranks. One process makes no process group
(nothing to reduce; a chunk store with a disk shards over a mesh of one); the plain-PyTorch
:class:`~tidal.parallel.reference.ReferenceEngine` stays the baseline every test compares with.

The forward of a microbatch stays open until its backward, one at a time or several (their
backwards in the order the forwards ran). A forward without gradients (evaluation, or
``torch.no_grad()``) runs outside the holder's bookkeeping, under autocast alone. A model built
on the meta device is materialised whole on each rank before it is sharded (no deferred
sharding yet), and tensor parallelism or a pipeline is refused in one line: they need the
block structure and the schedule the Trainer builds (``tidal train``, ``tidal.Trainer``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.distributed import rank
from tidal.distributed.device import resolve_device
from tidal.memory.materialize import ParameterValues, materialize
from tidal.parallel.accumulation import StepCounter
from tidal.parallel.chunk_stage import ChunkStageConfig, ChunkStageParams
from tidal.parallel.config import OptimizerConfig, TrainingConfig
from tidal.parallel.dims import ParallelDims
from tidal.parallel.flat_state import (
    flat_optimizer_state,
    model_layout,
    model_tensors,
    read_whole,
    unflatten_optimizer_state,
)
from tidal.parallel.lr import lr_schedule
from tidal.parallel.protocol import CheckpointTensors, LoadTensors, Phase, Phases
from tidal.parallel.reference import autocast, check_model_data_fits, model_data_bytes
from tidal.parallel.stage_params import like, local_nbytes, reshard_stage, whole
from tidal.pipeline.async_config import AsyncConfig
from tidal.pipeline.schedules import make_schedule
from tidal.runtime.build import stage_params
from tidal.runtime.executor import UpdateRules
from tidal.runtime.precision import LossScaler
from tidal.runtime.update import prepare_update
from tidal.runtime.weights import StageWeights

if TYPE_CHECKING:
    from tidal.parallel.chunk_engine import ChunkEngine

__all__ = ["StageEngine", "stage_engine"]

_LOSS_SCALE = "stage_loss_scale"  # a checkpoint's extras: the stage's loss scaler


def stage_engine(
    model: nn.Module,
    *,
    optimizer: OptimizerConfig,
    training: TrainingConfig,
    dims: ParallelDims,
    fsdp2: bool = False,
    fsdp2_offload: bool = False,
    chunks: ChunkStageConfig | None = None,
    init: ParameterValues | None = None,
    device_budget: int | None = None,
) -> StageEngine:
    """``model`` as one stage on ``dims``' mesh, held as a pipeline's stage would be
    (:func:`~tidal.runtime.build.stage_params`, the one choice of holder), behind the engine
    calling convention ([Note: one model on stages]). ``chunks``: its parameters in tidal's
    chunks ([Note: chunk stages] in tidal/parallel/chunk_stage.py), which stream ``init``'s
    values in; else the model is given them whole. ``device_budget``: the bytes plain
    replicas' model data may take on the device (refused in one line over it)."""
    device = resolve_device(training.device)
    if chunks is None:
        if not (fsdp2 and (dims.dp > 1 or fsdp2_offload)):  # every replica holds all of it
            num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            check_model_data_fits(4 * num_params, device_budget, optimizer=optimizer)  # fp32
        if init is not None:
            materialize(model, init, device)
        model = model.to(device)
    # one process needs no process group (a chunk store of one shards over a mesh of one)
    alone = dims.world_size == 1 and not fsdp2_offload
    mesh = None if alone else dims.build_mesh(device.type)
    accum = training.grad_accum_steps
    (params,) = stage_params([model], mesh, make_schedule("gpipe", stages=1, microbatches=accum),
                             optimizer=optimizer, weights=AsyncConfig(),
                             precision=training.precision,
                             lr=lr_schedule(optimizer, training).lr_at(0), microbatches=accum,
                             chunks=chunks, fsdp2=fsdp2, fsdp2_offload=fsdp2_offload,
                             init=init if chunks is not None else None)  # fmt: skip
    assert isinstance(params, StageWeights | ChunkStageParams), "no tensor parallelism here"
    return StageEngine(model, params, optimizer=optimizer, training=training, dims=dims)


class StageEngine:
    """One model on one stage, its parameters held by ``params`` (plain replicas or FSDP2
    shards over a torch optimizer, or tidal's chunks); see [Note: one model on stages]."""

    def __init__(
        self,
        model: nn.Module,
        params: StageWeights | ChunkStageParams,
        *,
        optimizer: OptimizerConfig,
        training: TrainingConfig,
        dims: ParallelDims,
    ) -> None:
        self.device = resolve_device(training.device)
        self.precision = training.precision
        self.model = model
        self.params = params
        self.schedule = lr_schedule(optimizer, training)
        self.counter = StepCounter(grad_accum_steps=training.grad_accum_steps)
        self.rules = UpdateRules(max_grad_norm=training.grad_clip_norm or None)
        self.scaler = LossScaler(training.precision)
        self.phases = Phases()
        self.last_grad_norm: float | None = None
        self.dims = dims
        self._next_microbatch = 0
        self._open: collections.deque[int] = collections.deque()  # forward done, backward not

    @property
    def phase(self) -> Phase:
        return self.phases.now

    @property
    def global_step(self) -> int:
        return self.counter.global_step

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.global_step)

    # -- the training calls --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            with autocast(self.precision, self.device):
                output = self.model(*args, **kwargs)
            reshard_stage(self.model)  # [Note: FSDP2 stages]: no backward will reshard it
            return output
        microbatch, self._next_microbatch = self._next_microbatch, self._next_microbatch + 1
        with self.params.forward(microbatch):
            output = self.phases.track(lambda: self.model(*args, **kwargs))
        self._open.append(microbatch)
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of the oldest open forward, its loss divided by ``grad_accum_steps``
        (and scaled for fp16: [Note: pipeline mixed precision] in precision.py)."""
        if not self._open:
            raise RuntimeError(
                "backward(loss) needs a forward of this engine first: loss = engine(x)"
            )
        microbatch = self._open.popleft()
        accum = self.counter.grad_accum_steps
        scaled = (loss / accum if accum > 1 else loss) * self.scaler.scale
        with self.params.backward(microbatch):
            scaled.backward()
        self.phases.backward()

    def step(self) -> bool:
        """Count a micro-batch; on the boundary, [Note: the update's order] in update.py and the
        update (skipped on an fp16 overflow). Returns whether it stepped."""
        if not self.counter.count_micro_batch():
            return False
        step = self.counter.global_step
        self.last_grad_norm = prepare_update({0: self.params}, rules=self.rules,
                                             scaler=self.scaler, step=step,
                                             sum_over_pipeline=lambda squares: squares,
                                             sum_tied=lambda pair: None)  # fmt: skip
        if self.scaler.skips(step):
            self.params.skip_step()
        else:
            self.params.step(lr=self.schedule.lr_at(step), step=step)
        self.counter.global_step += 1
        self.phases.gradients_dropped()
        return True

    def zero_grad(self) -> None:
        """Drop the gradients of the open accumulation window without an update."""
        self.params.skip_step()
        self.counter.drop_window()
        self.phases.gradients_dropped()

    # -- figures and state ---------------------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        """The stage's optimizer: torch's over plain replicas or FSDP2 shards, else the chunk
        optimizer."""
        return self.params.optimizer

    @property
    def chunks(self) -> ChunkEngine | None:
        """The chunk transform's engine, whose store and parts hold the chunks (None: the
        parameters are torch's)."""
        return self.params.engine if isinstance(self.params, ChunkStageParams) else None

    def stats(self) -> dict[str, Any]:
        figures = self.chunks.stats() if self.chunks is not None else {}  # the store's figures
        # plain replicas are what engine = "reference" names
        fsdp2 = isinstance(self.params, StageWeights) and self.params.sharded_by_fsdp2
        name = "fsdp2 stage" if fsdp2 else "reference"
        return {
            "engine": name,
            **figures,
            "world_size": self.dims.world_size,
            "device": str(self.device),
            "precision": self.precision,
            "global_step": self.global_step,
            "lr": self.lr,
            "grad_norm": self.last_grad_norm,
            "model_data_bytes": self.model_data_bytes(),
        }

    def model_data_bytes(self) -> dict[str, int]:
        """This rank's shares of the weights, their gradients and the optimizer's state."""
        if self.chunks is not None:
            return self.chunks.model_data_bytes()
        return model_data_bytes(self.model, self.params.optimizer, nbytes=local_nbytes)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole state dict, tied names and buffers included (gathered from the
        shards: every rank calls it)."""
        if self.chunks is not None:
            return self.chunks.model_state_dict()
        return {name: whole(t.detach()).clone() for name, t in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Whole weights and optimizer state (by parameter name), the step counters and the
        loss scale (a collective: every rank calls it)."""
        counters = {"counter": self.counter.state(), "scaler": self.scaler.state_dict()}
        if self.chunks is not None:  # the chunk engine's own state dict, read from the chunks
            return {**self.chunks.state_dict(), **counters}
        from torch.distributed.checkpoint import state_dict as dcp  # DTensor: only when asked

        options = dcp.StateDictOptions(full_state_dict=True)
        optimizer = dcp.get_optimizer_state_dict(self.model, self.params.optimizer, options=options)
        return {"model": self.model_state_dict(), "optimizer": optimizer, **counters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What :meth:`state_dict` wrote, on this engine's shards (any number of ranks)."""
        if isinstance(self.params, ChunkStageParams):
            self.params.engine.load_state_dict(state)  # into the chunks, wherever they are
        else:
            self._load(state["model"], state["optimizer"]["state"])
        self.counter.restore(state["counter"])
        self.scaler.load_state_dict(state["scaler"])

    def _load(self, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        """Whole values by state-dict name, and the optimizer's state by parameter name, into
        this rank's shares (buffers too: BatchNorm's statistics)."""
        from torch.distributed.checkpoint import state_dict as dcp

        own = {**dict(self.model.named_buffers()), **dict(self.model.named_parameters())}
        with torch.no_grad():
            for name, value in model.items():
                if name in own:
                    own[name].copy_(like(own[name], value.to(own[name].dtype)))
        names = {id(p): n for n, p in self.model.named_parameters()}
        torch_optimizer = self.params.optimizer
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [names[id(p)] for p in group["params"]]}
                  for group in torch_optimizer.param_groups]  # fmt: skip
        options = dcp.StateDictOptions(full_state_dict=True)
        dcp.set_optimizer_state_dict(self.model, torch_optimizer,
                                     {"state": optimizer, "param_groups": groups},
                                     options=options)  # fmt: skip

    # -- the one checkpoint format -------------------------------------------------------------

    def checkpoint_state(self) -> CheckpointTensors:
        """The one checkpoint format ([Note: checkpoint keys] in tidal/train/checkpoint.py),
        which every engine and the Trainer read: the chunks' shards as the chunk engine writes
        them, else every tensor whole, written by rank 0, the optimizer's state by parameter
        name; the counters are this engine's (a collective: every rank calls it)."""
        counters = {**self.counter.state(), _LOSS_SCALE: self.scaler.state_dict()}
        if self.chunks is not None:
            saved = self.chunks.checkpoint_state()
            return dataclasses.replace(saved, extras={**saved.extras, **counters})
        state = self.state_dict()
        meta = model_layout(self.model, {n: t.shape for n, t in state["model"].items()})
        if rank() != 0:
            return CheckpointTensors(tensors={}, extras={}, meta=meta)
        tensors, steps = flat_optimizer_state(state["optimizer"]["state"])  # by name already
        tensors.update(model_tensors(state["model"], meta))
        return CheckpointTensors(tensors=tensors, extras={**counters, "optimizer_steps": steps},
                                 meta=meta)  # fmt: skip

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        """Load what any engine's checkpoint holds (at any world size) through ``load``."""
        if self.chunks is not None:
            self.chunks.restore_checkpoint(load, extras, meta)
        else:
            model, flat = read_whole(load, meta)
            by_name = unflatten_optimizer_state(flat, extras["optimizer_steps"],
                                                meta["model_shapes"])  # fmt: skip
            self._load(model, by_name)
        self.counter.restore(extras)
        if _LOSS_SCALE in extras:  # this engine's own (the engines keep theirs under others)
            self.scaler.load_state_dict(extras[_LOSS_SCALE])
