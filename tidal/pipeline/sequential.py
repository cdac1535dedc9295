"""Your own model as a pipeline: an ``nn.Sequential`` cut between its children.

[Note: sequential pipelines]
- A stage is a run of the model's children; what crosses a boundary is what one child hands the
  next, one tensor of any shape and dtype (the wire sends its header first: [Note: the wire] in
  docs/pipeline.md). The first stage takes your inputs, the last returns ``loss_fn(output,
  targets)``, which must be the mean over the microbatch's rows: the runtime weighs microbatch
  ``i`` by its share of the rows, so the step's gradient is the whole batch's.
- Only ``nn.Sequential``: its forward is its children in order, so the cut computes what the
  model computes. Another module's forward may do anything between its children, so it is
  not cut: it is one block, and one stage (``pp = 1``) holds it whole, as a model of one stage
  whose parameters a transform holds (chunks, FSDP2) or that trains on one process.
- A balanced split uses counted costs (:func:`profile_sequential`): each child's FLOPs on one
  microbatch, its parameter bytes and the bytes autograd saves for it. Counted, not timed:
  every rank, and a resumed run, must cut the model alike (a checkpoint records its split and
  is refused by another), and times differ from run to run. Children without matmuls or
  convolutions (activations, pooling) count as free.
- A model on the meta device (built under ``torch.device("meta")``; a ``[custom] factory`` may
  return one) is never materialised whole: each rank gives storage only to its stages' children
  ([Note: stages from the meta device] in tidal/pipeline/stage_init.py), with the values of
  :func:`sequential_values`: every module that owns parameters runs its ``reset_parameters()``
  on the CPU, child after child in the model's order, drawing from one generator seeded with
  ``training.seed``. That is what ``torch.manual_seed(seed)`` and then building the model for
  real gives when its modules draw only in ``reset_parameters`` and are built in that order
  (nn.Linear, nn.Conv2d, nn.Embedding, the norms), and what torchtitan and
  torch.distributed.pipelining users do by hand (split on meta, ``to_empty``, re-initialise).
  A module with parameters but no ``reset_parameters`` cannot be re-initialised: refused.
- Buffers (BatchNorm's running statistics) are refused across stages: a pipeline normalises
  each microbatch on its own, not the batch, so it would train another model. One stage takes
  them: its microbatches are the accumulated micro-batches an engine would normalise one by
  one, and a checkpoint keeps each stage's persistent buffers under the model's names
  (``buffer/<name>``, as an engine's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.materialize import ParameterValues
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.split import StageParts

__all__ = [
    "check_sequential",
    "is_meta",
    "profile_sequential",
    "sequential_parts",
    "sequential_values",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_sequential(model: nn.Module, *, num_stages: int) -> None:
    """One-line errors for a model a pipeline cannot cut ([Note: sequential pipelines])."""
    if not isinstance(model, nn.Sequential) and num_stages > 1:
        raise ConfigError(
            "parallel.pp",
            f"a pipeline of your own model cuts an nn.Sequential between its children; "
            f"{type(model).__name__} is not one: put its layers in an nn.Sequential, or train "
            f"it as one stage (parallel.pp = 1)",
        )
    buffers = [name for name, _ in model.named_buffers()]
    if buffers and num_stages > 1:
        raise ConfigError(
            "parallel.pp",
            f"your model has buffers ({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}"
            f"): stages would compute BatchNorm-like statistics per microbatch, not per batch; "
            f"use GroupNorm or LayerNorm, or train it as one stage (parallel.pp = 1)",
        )
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    if meta and len(meta) < len(list(model.parameters())):
        raise ConfigError(
            "pipeline.stages",
            f"your model has parameters on the meta device ({', '.join(meta[:3])}) and others "
            f"not: build it wholly on the meta device (each rank then materialises its own "
            f"stages) or wholly for real",
        )
    for name, module in model.named_modules():
        owns = any(p.is_meta for p in module.parameters(recurse=False))
        if owns and not callable(getattr(module, "reset_parameters", None)):
            raise ConfigError(
                "pipeline.stages",
                f"your model is on the meta device and {name} ({type(module).__name__}) has no "
                f"reset_parameters() to give its parameters values; add one, or build the model "
                f"for real",
            )
    if isinstance(model, nn.Sequential) and num_stages > len(model):
        raise ConfigError(
            "parallel.pp",
            f"{num_stages} stages for an nn.Sequential of {len(model)} children: use at most "
            f"{len(model)}",
        )


def sequential_parts(model: nn.Module, loss_fn: LossFn) -> StageParts:
    """The stage parts of ``model``: an ``nn.Sequential``'s children are the blocks; any other
    module is one block, which one stage holds whole. No embedding, no head."""
    blocks = list(model) if isinstance(model, nn.Sequential) else [model]
    return StageParts(embed=None, blocks=nn.ModuleList(blocks), head=None, container="",
                      loss_fn=loss_fn)  # fmt: skip


def is_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (:func:`check_sequential` refuses
    a model with some there and some not)."""
    return any(param.is_meta for param in model.parameters())


def sequential_values(model: nn.Module, seed: int) -> ParameterValues:
    """The init source of ``model`` on the meta device ([Note: sequential pipelines]): each
    child of an ``nn.Sequential`` copied to the CPU and re-initialised in turn, one child
    resident at a time (another module: the whole of it at once)."""
    children = ([(f"{index}.", child) for index, child in enumerate(model)]
                if isinstance(model, nn.Sequential) else [("", model)])  # fmt: skip

    def values() -> Iterator[tuple[str, torch.Tensor]]:
        state = torch.Generator().manual_seed(seed).get_state()
        for prefix, child in children:
            with torch.random.fork_rng(devices=[]):  # the global generator, as reset_parameters
                torch.set_rng_state(state)
                made = _reset_on_cpu(child)
                state = torch.get_rng_state()
            for name, param in made.named_parameters():
                yield f"{prefix}{name}", param.detach()

    return values


def _reset_on_cpu(child: nn.Module) -> nn.Module:
    made = copy.deepcopy(child).to_empty(device="cpu")
    with torch.no_grad():
        for module in made.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.reset_parameters()  # type: ignore[operator]
    return made


def profile_sequential(model: nn.Sequential, sample: torch.Tensor) -> list[LayerProfile]:
    """Each child's costs on ``sample`` (one microbatch): its forward FLOPs (backward: twice
    those) as seconds of a notional 1 TFLOP/s device (only their ratios matter), its parameter
    bytes and the bytes autograd saves for it. Counted, not timed: the same on every rank and
    in every run, so a resumed run cuts the model where the saved one did. Runs a copy of the
    model under a forked RNG, so training starts as it would without it."""
    work = copy.deepcopy(model)
    if is_meta(model):  # counted on shapes alone, as on any device
        sample = sample.to("meta")
    profiles = []
    x = sample
    with torch.random.fork_rng(devices=[sample.device] if sample.is_cuda else []):
        for i, child in enumerate(work):
            flops, saved_bytes, x = _count_child(child, x)
            param_bytes = sum(p.numel() * p.element_size() for p in child.parameters())
            profiles.append(
                LayerProfile(
                    name=f"blocks.{i}",
                    forward_s=flops / _NOTIONAL_FLOPS_PER_S,
                    backward_s=2 * flops / _NOTIONAL_FLOPS_PER_S,
                    param_bytes=param_bytes,
                    activation_bytes=saved_bytes,
                )
            )
    return profiles


_NOTIONAL_FLOPS_PER_S = 1e12


def _count_child(child: nn.Module, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Forward FLOPs of ``child`` on ``x``, the bytes autograd saves, and its output."""
    from torch.utils.flop_counter import FlopCounterMode

    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    x_in = x.detach().requires_grad_(x.is_floating_point())
    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = child(x_in)
    return counter.get_total_flops(), saved[0], out.detach()
