"""An engine (reference, chunk, sharded, plan) behind the Trainer's loop.

The Trainer runs one loop for every way of training; what differs is a *part*: how a step is
taken, how validation runs, what a record and the summary add. :class:`EnginePart` is the part
of the engines with the calling convention ``loss = engine(x, y); engine.backward(loss);
engine.step()``; :class:`~tidal.train.pipeline_part.PipelinePart` that of a pipeline.

[Note: your own model]
``Trainer(model, config, train_data=, val_data=, loss_fn=)`` trains a module tidal did not
write on your batches, ``(inputs, targets)`` pairs of ``training.batch_size`` rows, through
the same loop: one stage held as the config says (plain replicas, or chunks sharded over the
ranks under torchrun, each replica its rows of every batch; or, for an ``nn.Sequential``, a
pipeline: [Note: sequential pipelines] in tidal/pipeline/sequential.py), the progress line and metrics,
validation on ``val_data``, checkpoints and exact resume ([Note: data positions] in
tidal/data/batches.py). "Tokens" are the positions of a row where the targets are token ids,
``(batch, seq)`` integers, and the model's FLOPs are then taken as ``6 x parameters`` per
token, as for a factory model; for other targets "tokens" count rows and FLOPs are not known,
so TFLOP/s and MFU are left out. The loss is ``loss_fn(model(inputs), targets)``; when not
given, cross-entropy of the model's logits as language models and classifiers return them
([Note: default loss] in losses.py). A recipe reaches a model of its own through ``[model]
factory`` instead ([Note: factory models]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ConfigError
from tidal.data import Batch, Batches
from tidal.distributed import all_reduce_mean
from tidal.models.factory import load_factory
from tidal.parallel.protocol import Checkpointable, Engine
from tidal.train.engine_state import ReadsPipelines
from tidal.train.job import JobConfig, load_job
from tidal.train.losses import default_loss
from tidal.train.tiers import CHUNK_FIGURES, StepTiers

__all__ = ["LOSSES", "EnginePart", "TrainingPart", "custom_run", "user_model_and_job"]

# the losses a recipe's ``[custom] loss`` names
LOSSES: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "cross_entropy": default_loss,
    "mse": F.mse_loss,
}


def custom_run(factory: str, *, seed: int) -> tuple[nn.Module, Iterable[Any], Iterable[Any] | None]:
    """A recipe's ``[custom] factory``: your model and batches, built after seeding with
    ``seed`` ([Note: your own model])."""
    torch.manual_seed(seed)
    made = load_factory(factory, key="custom.factory")()
    if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module)):
        raise ConfigError(
            "custom.factory",
            f"{factory} must return (model, train_batches, val_batches), got {type(made).__name__}",
        )
    return made


class TrainingPart(Protocol):
    """What the Trainer's loop needs from the thing that trains."""

    engine: Any
    device: torch.device
    nan_advice: str  # what to change when the loss is not finite

    @property
    def checkpointable(self) -> Checkpointable: ...
    @property
    def global_step(self) -> int: ...
    def next_steps(self, step: int) -> int: ...
    def train(self, num_steps: int, sampler: Batches) -> list[float]: ...
    def evaluate(self, batches: list[Batch]) -> float: ...
    def step_figures(self, step: int) -> dict[str, Any]: ...
    def summary_figures(self) -> dict[str, Any]: ...


class EnginePart:
    """Each rank trains its ``rows`` of every global batch ([Note: global batch] in
    trainer.py), ``grad_accum_steps`` micro-batches a step; losses are means over the ranks."""

    nan_advice = (
        "Lower optimizer.lr, raise optimizer.warmup_steps or use training.precision='bf16' "
        "instead of fp16"
    )

    def __init__(
        self,
        engine: Engine,
        *,
        rows: slice,
        world_size: int,
        grad_accum_steps: int,
        computes_loss: bool,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> None:
        self.engine = engine
        self.device = engine.device
        self.checkpointable: Checkpointable = ReadsPipelines(
            engine, grad_accum_steps=grad_accum_steps
        )
        self._rows, self._world_size = rows, world_size
        self._grad_accum_steps = grad_accum_steps
        self._computes_loss = computes_loss
        self._loss_fn = loss_fn  # [Note: your own model]
        self._tiers = StepTiers()

    @property
    def global_step(self) -> int:
        return self.engine.global_step

    def next_steps(self, step: int) -> int:
        return 1

    def train(self, num_steps: int, sampler: Batches) -> list[float]:
        return [self._train_step(sampler) for _ in range(num_steps)]

    def _train_step(self, sampler: Batches) -> float:
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self._grad_accum_steps):
            inputs, targets = self._local(sampler.next_batch())
            loss = self._loss(inputs.to(self.device), targets.to(self.device))
            self.engine.backward(loss)
            loss_sum += loss.detach().float()
            self.engine.step()
        return all_reduce_mean(float(loss_sum) / self._grad_accum_steps)  # syncs the device

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy: tidal's GPT takes it itself; a Hugging Face or a
        factory model gives logits, and it is taken here the same way (fp32, over every token:
        [Note: default loss] in losses.py)."""
        if self._computes_loss:
            return self.engine(inputs, targets)
        return (self._loss_fn or default_loss)(self.engine(inputs), targets)

    def _local(self, batch: Batch) -> Batch:
        """This rank's rows of a global batch."""
        if self._world_size == 1:
            return batch
        inputs, targets = batch
        return inputs[self._rows], targets[self._rows]

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        """Mean loss over ``batches`` (each rank its rows, then the mean over ranks)."""
        model = self.engine.model
        was_training = model.training
        model.eval()
        total = 0.0
        for batch in batches:
            inputs, targets = self._local(batch)
            total += float(self._loss(inputs.to(self.device), targets.to(self.device)))
        model.train(was_training)
        return all_reduce_mean(total / len(batches))

    def step_figures(self, step: int) -> dict[str, Any]:
        figures: dict[str, Any] = {"grad_norm": self.engine.last_grad_norm, "lr": self.engine.lr}
        tiers = self._tiers([self.engine.stats()])  # [Note: tier figures] in tiers.py
        if tiers:
            figures["tiers"] = tiers
        return figures

    def summary_figures(self) -> dict[str, Any]:
        """The engine's name, a plan run's mesh, model-data bytes and, for the chunk engines,
        their traffic and residency figures."""
        stats = self.engine.stats()
        keys = ("mesh", *CHUNK_FIGURES)
        return {
            "model_data_bytes": self.engine.model_data_bytes(),
            "engine": stats["engine"],
            **{k: stats[k] for k in keys if k in stats},
        }


def user_model_and_job(
    job: JobConfig | str | dict[str, Any] | nn.Module,
    overrides: Sequence[str] | JobConfig | dict[str, Any],
    train_data: Iterable[Any] | None,
) -> tuple[nn.Module | None, JobConfig]:
    """``Trainer(model, config, train_data=)``: your own model, whose config comes second
    ([Note: your own model] in engine_part.py); else a job whose [model] says what to train."""
    user_model = job if isinstance(job, nn.Module) else None
    if user_model is not None:
        job, overrides = (
            (overrides, ()) if isinstance(overrides, JobConfig | dict) else ({}, overrides)
        )
        if train_data is None:
            raise ConfigError("train_data", "your own model trains on your data: pass "
                              "train_data= (and loss_fn=, else cross-entropy of its logits)")  # fmt: skip
    if isinstance(overrides, JobConfig):
        raise ConfigError("overrides", "a JobConfig is a whole job: pass it first, "
                          "Trainer(job), or give overrides as a dict or 'key=value' strings")  # fmt: skip
    assert not isinstance(job, nn.Module)
    return user_model, load_job(job, overrides)
