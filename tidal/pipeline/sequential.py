"""Your own model as a pipeline: an ``nn.Sequential`` cut between its children.

[Note: sequential pipelines]
- A stage is a run of the model's children; what crosses a boundary is what one child hands the
  next, one tensor of any shape and dtype (the wire sends its header first: [Note: the wire] in
  docs/pipeline.md). The first stage takes your inputs, the last returns ``loss_fn(output,
  targets)``, which must be the mean over the microbatch's rows: the runtime weighs microbatch
  ``i`` by its share of the rows, so the step's gradient is the whole batch's.
- Only ``nn.Sequential``: its forward is its children in order, so the cut computes what the
  model computes. Another module's forward may do anything between its children.
- A balanced split uses measured costs (:func:`profile_sequential`): each child's forward and
  backward seconds on one microbatch, its parameter bytes and the bytes autograd saves for it.
  Ranks measure different times, so the caller takes the largest of each over the ranks before
  partitioning: every rank must cut alike.
- Buffers are refused (BatchNorm's running statistics): a pipeline normalises each microbatch
  on its own, not the batch, so it would train another model; and a pipeline checkpoints
  parameters and optimizer state only.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.split import StageParts

__all__ = ["check_sequential", "profile_sequential", "sequential_parts"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_sequential(model: nn.Module, *, num_stages: int) -> None:
    """One-line errors for a model a pipeline cannot cut ([Note: sequential pipelines])."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            "pipeline.stages",
            f"a pipeline of your own model cuts an nn.Sequential between its children; "
            f"{type(model).__name__} is not one: put its layers in an nn.Sequential, or train "
            f"it on the reference or chunk engine",
        )
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ConfigError(
            "pipeline.stages",
            f"your model has buffers ({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}"
            f"): a pipeline would compute BatchNorm-like statistics per microbatch and does not "
            f"checkpoint them; use GroupNorm or LayerNorm, or the reference or chunk engine",
        )
    if num_stages > len(model):
        raise ConfigError(
            "pipeline.stages",
            f"{num_stages} stages for an nn.Sequential of {len(model)} children: use at most "
            f"{len(model)}",
        )


def sequential_parts(model: nn.Sequential, loss_fn: LossFn) -> StageParts:
    """The stage parts of ``model``: its children are the blocks; no embedding, no head."""
    return StageParts(embed=None, blocks=nn.ModuleList(list(model)), head=None, container="",
                      loss_fn=loss_fn)  # fmt: skip


def profile_sequential(
    model: nn.Sequential, sample: torch.Tensor, *, repeats: int = 3
) -> list[LayerProfile]:
    """Each child's costs on ``sample`` (one microbatch, on the model's device): median forward
    and backward seconds of ``repeats`` runs after a warm-up, parameter and saved bytes. Runs a
    copy of the model under a forked RNG, so training starts as it would without it."""
    work = copy.deepcopy(model)
    profiles = []
    x = sample
    with torch.random.fork_rng(devices=[sample.device] if sample.is_cuda else []):
        for i, child in enumerate(work):
            times, saved_bytes, x = _time_child(child, x, repeats)
            param_bytes = sum(p.numel() * p.element_size() for p in child.parameters())
            profiles.append(
                LayerProfile(
                    name=f"blocks.{i}",
                    forward_s=statistics.median(t for t, _ in times),
                    backward_s=statistics.median(t for _, t in times),
                    param_bytes=param_bytes,
                    activation_bytes=saved_bytes,
                )
            )
    return profiles


def _time_child(
    child: nn.Module, x: torch.Tensor, repeats: int
) -> tuple[list[tuple[float, float]], int, torch.Tensor]:
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    times = []
    out = x
    for run in range(repeats + 1):
        x_in = x.detach().requires_grad_(x.is_floating_point())
        saved[0] = 0
        _sync(x)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = child(x_in)
        _sync(x)
        forward_end = time.perf_counter()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _sync(x)
        if run:  # the first run warms up
            times.append((forward_end - start, time.perf_counter() - forward_end))
    return times, saved[0], out.detach()


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
