"""Stages that hold only their own blocks: a model split on the meta device, then this rank's
stages given storage and their initial values.

[Note: stages from the meta device]
A pipeline rank trains a few stages of a model that may not fit one host. So the model is built
on the meta device (shapes only) and split there (a deep copy of a meta module costs nothing),
and only the stages this rank holds get storage, on the training device: each parameter an
empty tensor, then its value from the model's init source ([Note: deferred construction] in
tidal/memory/materialize.py), matched by the name of the model parameter it was copied from
(``PipelineStage.source_names``). A weight two held stages share (a tied embedding in the first
and the last stage) gets the same value in both. The stages a rank does not hold stay on the meta
device: their names and shapes still serve the memory plan and the list of ties.

The init source draws every value from one generator in the model's parameter order, and a CPU
generator cannot skip ahead, so the values of the parameters before and between the held ones
are drawn and dropped, one at a time; the source is read no further than the last held
parameter. A rank's peak is then its stages plus the largest single value (the embedding), not
the model. Buffers are not streamed: a held stage's buffers (LLaMA's rotary tables, computed on
the CPU when the model is built) move to the device as they are.

Measuring what stages save for backward ([Note: pipeline memory] in
tidal/train/pipeline_memory.py) runs every stage, the other ranks' too, on the device: what
sdpa saves depends on the kernel the device picks, which the meta device does not mirror. A
stage on the meta device is measured on a :func:`stand_in`, a copy with empty storage, made
and dropped one stage at a time; values do not change what is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy

import torch
from torch import nn

from tidal.memory.materialize import ParameterValues, repoint
from tidal.pipeline.split import PipelineStage

__all__ = ["materialize_stages", "stand_in"]


def materialize_stages(
    stages: Sequence[PipelineStage],
    mine: Sequence[int],
    values: ParameterValues,
    device: torch.device,
) -> None:
    """Give stages ``mine`` of ``stages`` (split from a model on the meta device) storage on
    ``device`` and the values ``values`` streams for the model's parameters; the other stages
    stay as they are ([Note: stages from the meta device])."""
    held = [stages[s] for s in mine]
    targets = _params_by_source(held)
    for stage in held:
        _allocate(stage, device)
    unset = set(targets)
    with torch.no_grad():
        for name, value in values():
            for param in targets.get(name, ()):
                param.copy_(value)
            unset.discard(name)
            if not unset:  # the rest of the source only draws values no held stage keeps
                break
    if unset:
        names = sorted(unset)
        raise ValueError(f"the init source gave no value for {', '.join(names[:3])}")


def stand_in(stage: PipelineStage, device: torch.device) -> PipelineStage:
    """``stage`` itself, or for a stage with parameters on the meta device a copy of it with
    empty storage on ``device`` (values undefined: for measuring, not for training)."""
    if not any(param.is_meta for param in stage.parameters()):
        return stage
    copy = deepcopy(stage)
    _allocate(copy, device)
    return copy


def _params_by_source(stages: Sequence[PipelineStage]) -> dict[str, list[nn.Parameter]]:
    """Each model parameter name the stages copied, and the stages' parameters copied from it
    (a tie inside one stage is one parameter, counted once)."""
    out: dict[str, list[nn.Parameter]] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            out.setdefault(stage.source_names[name], []).append(param)
    return out


def _allocate(stage: nn.Module, device: torch.device) -> None:
    """Empty storage on ``device`` for every parameter (the Parameter objects stay, so a tie
    inside the stage stays one), and the buffers moved there."""
    for param in stage.parameters():
        repoint(param, torch.empty(param.shape, dtype=param.dtype, device=device))
    for module_name, module in stage.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                where = f"{module_name}.{name}" if module_name else name
                raise ValueError(
                    f"buffer {where} is on the meta device: a stage's buffers are not streamed; "
                    f"compute them when the model is built (as its parameters' shapes are)"
                )
            setattr(module, name, buffer.to(device))
