"""Whole-tensor state in the one checkpoint format's keys ([Note: checkpoint keys] in
tidal/train/checkpoint.py): the flattening every holder of whole tensors shares (the reference
engine, replicated or in a plan's layout; the chunk engine on one process; a pipeline's
stages). The sharded engine writes its pieces under the same keys itself
(tidal/sharding/state.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidal.parallel.protocol import LoadTensors
from tidal.sharding.state import model_key, optim_key

__all__ = [
    "OptimizerByName", "flat_optimizer_state", "index_names", "model_layout", "model_tensors",
    "read_whole", "unflatten_optimizer_state",
]  # fmt: skip

OptimizerByName = dict[str, dict[str, torch.Tensor]]  # parameter name -> its state by kind


def model_layout(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, Any]:
    """``meta.json``'s ``model_keys`` (tied names share their first name's key) and
    ``model_shapes`` of every state-dict name in ``shapes``."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    params = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    keys = {n: model_key(params[n]) if n in params else f"buffer/{n}" for n in shapes}
    return {"model_keys": keys, "model_shapes": {n: list(s) for n, s in shapes.items()}}


def model_tensors(model_state: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    """Each key of ``meta["model_keys"]`` once, flat (tied names share one key)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, key in meta["model_keys"].items():
        tensors.setdefault(key, model_state[name].detach().reshape(-1))
    return tensors


def flat_optimizer_state(
    state: dict[Any, dict[str, Any]], names: dict[Any, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-parameter optimizer state (keyed by ``names``' keys, or by name when ``names`` is
    None) as ``optim/<name>/<state>`` tensors, and the step counts by name."""
    tensors, steps = {}, {}
    for key, saved in state.items():
        name = key if names is None else names[key]
        for state_name, value in saved.items():
            if value is None:  # SGD without momentum
                continue
            if state_name == "step":
                steps[name] = float(value)
            else:
                tensors[optim_key(name, state_name)] = value.reshape(-1)
    return tensors, steps


def unflatten_optimizer_state(
    targets: dict[str, torch.Tensor], steps: dict[str, float], shapes: dict[str, list[int]]
) -> OptimizerByName:
    """The inverse of :func:`flat_optimizer_state`, by name."""
    state: OptimizerByName = {}
    for key, value in targets.items():
        if key.startswith("optim/"):
            name, state_name = key[len("optim/") :].rsplit("/", 1)
            state.setdefault(name, {})[state_name] = value.view(shapes[name])
    for name, step in steps.items():
        state.setdefault(name, {})["step"] = torch.tensor(step)
    return state


def index_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """A torch optimizer's state-dict index of each parameter -> the parameter's first name."""
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index: names[id(p)] for index, p in enumerate(params)}


def read_whole(
    load: LoadTensors, meta: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read every model and optimizer key whole: the model's state dict (by state-dict name)
    and the optimizer keys' flat tensors."""
    keys = [*dict.fromkeys(meta["model_keys"].values())]
    keys += [k for k in meta["numels"] if k.startswith("optim/")]
    targets = {key: torch.empty(meta["numels"][key]) for key in keys}
    load(targets)
    shapes = meta["model_shapes"]
    model = {name: targets[key].view(shapes[name]) for name, key in meta["model_keys"].items()}
    return model, {k: v for k, v in targets.items() if k.startswith("optim/")}
