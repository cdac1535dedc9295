"""Your own optimizer and learning-rate scheduler in the Trainer, where the engine can honour
them, and a one-line refusal where it cannot.

[Note: your optimizer]
``Trainer(..., optimizer=, optimizer_kwargs=, lr_scheduler=)`` replaces the ``[optimizer]``
section (which must then be left unset, so the optimizer is said once):

- ``optimizer``: a ``torch.optim.Optimizer`` class, built as ``cls(model.parameters(),
  **optimizer_kwargs)``, or a factory ``params -> optimizer`` (no ``optimizer_kwargs``).
- ``lr_scheduler``: a factory ``optimizer -> torch LR scheduler``, stepped once after every
  optimizer step (not every micro-batch) and checkpointed; without ``optimizer=``, over
  ``[optimizer]``'s, built at its peak ``lr``. Without a scheduler, your optimizer's learning
  rate is its own, constant: ``[optimizer]``'s warm-up + cosine does not apply.

Plain stages (``engine = "reference"``: the whole model on one, or a synchronous pipeline's
stages, replicated over ``mesh["dp"]``) train with your torch objects as they are, one
optimizer and one scheduler per stage, so a run of one stage equals the plain PyTorch loop
``loss.backward(); opt.step(); sched.step(); opt.zero_grad()`` on the same seed, once
``training.grad_clip_norm = 0`` turns off the clipping every run does before the step (to 1.0
by default); a checkpoint keeps the scheduler's state once, as the reference engine does.
The other ways of training run their own optimizer: the chunk engine and chunk stages over
chunk storage, a plan's layout per mesh, tensor-parallel and FSDP2 stages over their shards,
an asynchronous pipeline at its own rates, with ``[optimizer]``'s schedule. They take ``torch.optim.AdamW``, ``Adam`` or ``SGD`` with the
arguments they implement, mapped onto ``[optimizer]`` with torch's defaults for the rest, a
constant learning rate (``warmup_steps = 0``, ``min_lr_ratio = 1``) and weight decay on every
parameter (``weight_decay_on = "all"``), so the arithmetic is torch's; the section written to
config.json says so. A factory, another class, an argument they do not implement (``amsgrad``,
``maximize``, ...) or a scheduler is refused in one line naming the engine and what it takes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.parallel.config import OptimizerConfig
from tidal.parallel.reference import TorchOptimizer
from tidal.train.job import JobConfig

__all__ = [
    "OptimizerArg",
    "describe",
    "optimizer_config",
    "optimizer_notes",
    "own_optimizer",
    "runs_on",
]

OptimizerArg = (
    type[torch.optim.Optimizer] | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
)

_NAMES = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
# torch's argument -> [optimizer]'s key; betas is two keys
_KEYS = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay", "momentum": "momentum",
         "dampening": "dampening", "nesterov": "nesterov", "fused": "fused"}  # fmt: skip
# arguments that choose a kernel, not the arithmetic: any value is honoured
_KERNEL_CHOICES = ("foreach",)
_TAKES = (
    "torch.optim.AdamW, Adam or SGD (lr, betas, eps, weight_decay, momentum, dampening, nesterov)"
)


def describe(thing: Any, kwargs: Mapping[str, Any] | None = None) -> str:
    """``torch.optim.sgd.SGD(lr=0.1)``, or a factory's ``module.qualname``: what config.json
    records and a resume compares."""
    module = getattr(thing, "__module__", "?")
    name = f"{module}.{getattr(thing, '__qualname__', type(thing).__name__)}"
    if kwargs is None:
        return name
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def optimizer_notes(
    optimizer: OptimizerArg | None,
    optimizer_kwargs: Mapping[str, Any] | None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
) -> dict[str, str]:
    """What config.json (and so a checkpoint) records of yours beside the job."""
    notes = {}
    if optimizer is not None:
        notes["user_optimizer"] = describe(optimizer, optimizer_kwargs)
    if lr_scheduler is not None:
        notes["user_lr_scheduler"] = describe(lr_scheduler)
    return notes


def own_optimizer(
    job: JobConfig,
    *,
    optimizer: OptimizerArg | None,
    optimizer_kwargs: Mapping[str, Any] | None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    runs_on: str | None,
) -> tuple[JobConfig, TorchOptimizer | None]:
    """The job and the :class:`TorchOptimizer` of what you passed ([Note: your optimizer]).
    ``runs_on``: None for plain stages (and the reference engine), else what runs its own
    optimizer: a key of ``_OWN_OPTIMIZER``."""
    if optimizer is None:
        if optimizer_kwargs is not None:
            raise ConfigError("optimizer_kwargs", "go with optimizer= (a torch.optim class); "
                              "without it, set the [optimizer] section instead")  # fmt: skip
        if lr_scheduler is not None and runs_on is not None:
            raise _refusal(runs_on, "lr_scheduler=")
        return job, None if lr_scheduler is None else TorchOptimizer(schedule=lr_scheduler)
    if job.optimizer != OptimizerConfig():
        raise ConfigError("optimizer", "given twice: as optimizer= and in the config's [optimizer] "
                          "section; keep one (optimizer_kwargs= for its settings)")  # fmt: skip
    is_class = isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
    if not is_class and optimizer_kwargs is not None:
        raise ConfigError("optimizer_kwargs", f"go with an optimizer class; the factory "
                          f"{describe(optimizer)} sets its own arguments")  # fmt: skip
    kwargs = dict(optimizer_kwargs or {})
    if runs_on is not None:
        if lr_scheduler is not None:
            raise _refusal(runs_on, "lr_scheduler=")
        if not is_class:
            raise _refusal(runs_on, f"the factory {describe(optimizer)}")
        assert isinstance(optimizer, type)
        return replace(job, optimizer=optimizer_config(optimizer, kwargs, runs_on=runs_on)), None
    if is_class:
        assert isinstance(optimizer, type)
        cls = optimizer
        return job, TorchOptimizer(make=lambda params: cls(params, **kwargs), schedule=lr_scheduler)
    return job, TorchOptimizer(make=optimizer, schedule=lr_scheduler)


def optimizer_config(
    cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], *, runs_on: str
) -> OptimizerConfig:
    """``cls(params, **kwargs)`` as ``[optimizer]``: torch's arithmetic in an engine with its
    own optimizer, or a one-line refusal ([Note: your optimizer])."""
    name = _NAMES.get(cls)
    if name is None:
        raise _refusal(runs_on, describe(cls))
    signature = inspect.signature(cls).parameters
    unknown = [k for k in kwargs if k not in signature or k == "params"]
    if unknown:
        raise ConfigError("optimizer_kwargs", f"{describe(cls)} takes no {', '.join(unknown)}")
    settings = {k: p.default for k, p in signature.items() if p.default is not p.empty}
    settings.update(kwargs)
    if name == "adam" and settings.pop("decoupled_weight_decay", False):
        name = "adamw"  # torch's AdamW is exactly this
    mapped: dict[str, Any] = {"name": name, "warmup_steps": 0, "min_lr_ratio": 1.0,
                              "weight_decay_on": "all"}  # fmt: skip
    for key, value in settings.items():
        if key in _KEYS:
            mapped[_KEYS[key]] = float(value) if key == "lr" else value
        elif key == "betas":
            mapped["beta1"], mapped["beta2"] = (float(b) for b in value)
        elif key not in _KERNEL_CHOICES and value != signature[key].default:
            raise _refusal(runs_on, f"{describe(cls)} with {key}={value!r}")
    return OptimizerConfig(**mapped)


# how each way of training with its own optimizer is named in a refusal, and the way out
_PLAIN = "plain stages (engine = 'reference', parallel.tp = 1, parallel.fsdp2 = false"
_OWN_OPTIMIZER = {
    "chunk": ("the chunk engine steps its own optimizer over chunk storage",
              "engine = 'reference'"),
    "plan": ("a plan run builds its optimizer mesh by mesh", "the reference engine without --plan"),
    "sharded stages": ("tensor-parallel and FSDP2 stages step their own optimizer over "
                       "their DTensor shards", f"{_PLAIN})"),
    "asynchronous stages": ("an asynchronous pipeline sets each stage's rate itself",
                            f"{_PLAIN}, a synchronous schedule: gpipe, 1f1b or interleaved)"),
}  # fmt: skip


def _refusal(runs_on: str, what: str) -> ConfigError:
    why, fix = _OWN_OPTIMIZER[runs_on]
    return ConfigError(
        "optimizer",
        f"{why}, on [optimizer]'s warm-up + cosine: it takes {_TAKES}, not {what}; "
        f"train with {fix} for that",
    )


def runs_on(job: JobConfig, *, plan: bool) -> str | None:
    """What runs its own optimizer, for ``own_optimizer``; None: plain stages (or the
    reference engine), which take yours ([Note: your optimizer] in user_optim.py)."""
    if job.engine == "chunk":  # in chunks, on stages or not
        return "chunk"
    if plan:
        return "plan"
    if job.parallel.tp > 1 or job.parallel.fsdp2:
        return "sharded stages"
    return "asynchronous stages" if job.pipeline.asynchronous else None
