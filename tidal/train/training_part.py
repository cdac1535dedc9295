"""What trains behind the Trainer's loop, and your own model's way into it.

The Trainer runs one loop for every run; what it drives is a *part* (:class:`TrainingPart`): how
a step is taken, how validation runs, what a record and the summary add. Every run's part is
:class:`~tidal.train.pipeline_part.PipelinePart`, the one train step over a schedule of stages
([Note: one train step] in job.py); the protocol keeps the loop from importing it.

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
from tidal.models.factory import load_factory
from tidal.parallel.protocol import Checkpointable
from tidal.train.job import JobConfig, load_job
from tidal.train.losses import default_loss

__all__ = ["LOSSES", "TrainingPart", "custom_run", "user_model_and_job"]

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
    num_params: int
    flops_per_token: float | None  # None: not known (TFLOP/s and MFU are left out)

    @property
    def checkpointable(self) -> Checkpointable: ...
    @property
    def global_step(self) -> int: ...
    def next_steps(self, step: int) -> int: ...
    def train(self, num_steps: int, sampler: Batches) -> list[float]: ...
    def evaluate(self, batches: list[Batch]) -> float: ...
    def step_figures(self, step: int) -> dict[str, Any]: ...
    def summary_figures(self) -> dict[str, Any]: ...


def user_model_and_job(
    job: JobConfig | str | dict[str, Any] | nn.Module,
    overrides: Sequence[str] | JobConfig | dict[str, Any],
    train_data: Iterable[Any] | None,
) -> tuple[nn.Module | None, JobConfig]:
    """``Trainer(model, config, train_data=)``: your own model, whose config comes second
    ([Note: your own model] in training_part.py); else a job whose [model] says what to train."""
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
