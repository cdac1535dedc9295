"""Every engine's state in the one checkpoint format ([Note: checkpoint keys] in checkpoint.py).

The chunk engines give their own :class:`~tidal.parallel.protocol.CheckpointTensors`. The
reference engine (one process, or data-parallel replicas) and the plan engine hold whole tensors
(the plan engine gathers them): :class:`WholeTensors` turns their ``state_dict()`` into the same
keys, written by rank 0. A pipeline's stages: :class:`PipelineStages`, each rank its stages'
tensors under the model's own names (see [Note: pipeline checkpoints]).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.distributed import rank as current_rank
from tidal.parallel.protocol import CheckpointTensors, LoadTensors
from tidal.parallel.reference import ReferenceEngine

if TYPE_CHECKING:
    from tidal.parallel.plan_engine import PlanEngine

__all__ = ["Checkpointable", "PipelineStages", "WholeTensors", "checkpointable", "model_layout"]


class Checkpointable(Protocol):
    """What the trainer checkpoints and restores: an engine's state in [Note: checkpoint keys]."""

    def checkpoint_state(self) -> CheckpointTensors: ...
    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None: ...


def checkpointable(engine: Any, *, planned: bool = False) -> Checkpointable:
    """The engine's checkpoint state: its own for the chunk engines, :class:`WholeTensors` for
    the reference and plan engines (``planned``: the plan engine)."""
    if planned or isinstance(engine, ReferenceEngine):
        return WholeTensors(engine, planned=planned)
    return engine


def model_layout(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, Any]:
    """``meta.json``'s ``model_keys`` (tied names share their first name's key) and
    ``model_shapes`` of every state-dict name in ``shapes``."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    params = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    keys = {n: f"model/{params[n]}" if n in params else f"buffer/{n}" for n in shapes}
    return {"model_keys": keys, "model_shapes": {n: list(s) for n, s in shapes.items()}}


def _flat_optimizer_state(
    state: dict[Any, dict[str, Any]], names: dict[Any, str]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A torch optimizer's per-parameter state as ``optim/<name>/<state>`` tensors and step counts."""
    tensors, steps = {}, {}
    for key, saved in state.items():
        for state_name, value in saved.items():
            if value is None:  # SGD without momentum
                continue
            if state_name == "step":
                steps[names[key]] = float(value)
            else:
                tensors[f"optim/{names[key]}/{state_name}"] = value.reshape(-1)
    return tensors, steps


def _optimizer_state(
    targets: dict[str, torch.Tensor], steps: dict[str, float], shapes: dict[str, list[int]]
) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of :func:`_flat_optimizer_state`, by name."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in targets.items():
        if key.startswith("optim/"):
            name, state_name = key[len("optim/") :].rsplit("/", 1)
            state.setdefault(name, {})[state_name] = value.view(shapes[name])
    for name, step in steps.items():
        state.setdefault(name, {})["step"] = torch.tensor(step)
    return state


def _index_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """A torch optimizer's state-dict index of each parameter -> the parameter's first name."""
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index: names[id(p)] for index, p in enumerate(params)}


def _model_tensors(model_state: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    """Each key of ``meta["model_keys"]`` once, flat (tied names share one key)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, key in meta["model_keys"].items():
        tensors.setdefault(key, model_state[name].detach().reshape(-1))
    return tensors


def _read_model(load: LoadTensors, meta: dict[str, Any], extra_keys: Iterable[str] = ()) -> dict:
    """Read the model keys (and ``extra_keys``) whole; returns every target by key."""
    keys = {*meta["model_keys"].values(), *extra_keys}
    targets = {key: torch.empty(meta["numels"][key]) for key in keys}
    load(targets)
    return targets


class WholeTensors:
    """The reference and plan engines' state: every tensor whole; rank 0 writes them (the
    other ranks hold replicas, or helped gather). A plan run's optimizer state is in the plan's
    layout ([Note: plan runs] in plan_engine.py), so its checkpoint resumes only with the plan
    it records."""

    def __init__(self, engine: ReferenceEngine | PlanEngine, *, planned: bool) -> None:
        self.engine = engine
        self.planned = planned

    def checkpoint_state(self) -> CheckpointTensors:
        state = self.engine.state_dict()  # the plan engine's is a collective: every rank calls
        model_state, optimizer = state.pop("model"), state.pop("optimizer")
        meta = model_layout(self.engine.model, {n: t.shape for n, t in model_state.items()})
        if current_rank() != 0:
            return CheckpointTensors(tensors={}, extras={}, meta=meta)
        saved = optimizer["state"]
        if self.planned:  # by name already
            names: dict[Any, str] = {name: name for name in saved}
        else:
            names = _index_names(self.engine.model, self.engine.optimizer)
        tensors, steps = _flat_optimizer_state(saved, names)
        extras = {**state, "optimizer_steps": steps}
        if self.planned:  # by name: the plan engine's loading needs them
            extras["param_groups"] = optimizer["param_groups"]
        return CheckpointTensors(
            tensors={**_model_tensors(model_state, meta), **tensors}, extras=extras, meta=meta
        )

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        engine = self.engine
        optim_keys = [k for k in meta["numels"] if k.startswith("optim/")]
        targets = _read_model(load, meta, optim_keys)
        shapes = meta["model_shapes"]
        model = {n: targets[k].view(shapes[n]) for n, k in meta["model_keys"].items()}
        by_name = _optimizer_state(targets, extras["optimizer_steps"], shapes)
        if self.planned:
            groups = extras["param_groups"]
        else:  # the torch optimizer's own state dict: by index; the groups are this engine's
            groups = engine.optimizer.state_dict()["param_groups"]
            index_of = {n: i for i, n in _index_names(engine.model, engine.optimizer).items()}
            by_name = {index_of[n]: v for n, v in by_name.items()}  # type: ignore[misc]
        rest = {k: v for k, v in extras.items() if k not in ("optimizer_steps", "param_groups")}
        optimizer = {"state": by_name, "param_groups": groups}
        engine.load_state_dict({"model": model, "optimizer": optimizer, **rest})


# [Note: pipeline checkpoints]
# A pipeline's checkpoint is the whole model, whatever the split: each rank writes its stages'
# parameters and optimizer state under the model's names (a stage's ``source_names``), so
# ``tidal export`` and every engine read it as any other. A weight two stages hold (a tied
# embedding) is written by both, equal, and DCP keeps one. What only a stage has, its weight
# versions and measured delays (PipeMare), is one opaque tensor per stage,
# ``pipeline/stage-<s>``. Resuming needs the same schedule and split (the engine's extras
# record them).


class PipelineStages:
    """A :class:`~tidal.pipeline.runtime.PipelineRuntime`'s stages in the one format; see
    [Note: pipeline checkpoints]. ``layout``: :func:`model_layout` of the whole model."""

    def __init__(self, runtime: Any, layout: dict[str, Any], split: dict[str, Any]) -> None:
        self.runtime = runtime
        self.layout = layout
        self.split = split  # schedule, stages and block ranges: resuming needs the same

    def _stages(self) -> Iterable[tuple[int, nn.Module, Any, dict[str, str]]]:
        for s, module in self.runtime.modules.items():
            weights = self.runtime.weights[s]
            yield s, module, weights, module.source_names

    def checkpoint_state(self) -> CheckpointTensors:
        tensors: dict[str, Any] = {}
        for s, module, weights, source in self._stages():
            for name, param in module.named_parameters():
                tensors[f"model/{source[name]}"] = param.detach().reshape(-1)
            names = {i: source[n] for i, n in _index_names(module, weights.optimizer).items()}
            optim, steps = _flat_optimizer_state(weights.optimizer.state_dict()["state"], names)
            tensors.update(optim)
            tensors[f"pipeline/stage-{s}"] = _to_bytes({"weights": weights.state_dict(),
                                                        "optimizer_steps": steps})  # fmt: skip
        extras = {"global_step": self.runtime.step, "split": self.split}
        return CheckpointTensors(tensors=tensors, extras=extras, meta=dict(self.layout))

    def _targets(self, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        """This rank's stages' keys: parameters, their optimizer state, each stage's own."""
        numels = meta["numels"]
        names = {source for _, _, _, sources in self._stages() for source in sources.values()}
        keys = [k for k in numels if k.startswith("optim/")
                and k[len("optim/") :].rsplit("/", 1)[0] in names]  # fmt: skip
        keys += [f"model/{name}" for name in names]
        targets = {key: torch.empty(numels[key]) for key in keys}
        for s in self.runtime.modules:
            key = f"pipeline/stage-{s}"
            targets[key] = torch.empty(numels[key], dtype=torch.uint8)
        return targets

    def restore_checkpoint(
        self, load: LoadTensors, extras: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        if extras.get("split") != self.split:
            raise ConfigError(
                "pipeline",
                f"the checkpoint was trained as the pipeline {extras.get('split')}, this run is "
                f"{self.split}; resume with the same [pipeline] settings (or export it with "
                f"`tidal export RUN_DIR`)",
            )
        targets = self._targets(meta)
        load(targets)  # one collective read for all this rank's stages
        for s, module, weights, source in self._stages():
            own = _from_bytes(targets[f"pipeline/stage-{s}"])
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.copy_(targets[f"model/{source[name]}"].view(param.shape))
            by_name = _optimizer_state(targets, own["optimizer_steps"], meta["model_shapes"])
            index_of = _index_names(module, weights.optimizer)
            state = {i: by_name[source[n]] for i, n in index_of.items() if source[n] in by_name}
            groups = weights.optimizer.state_dict()["param_groups"]
            weights.optimizer.load_state_dict({"state": state, "param_groups": groups})
            weights.load_state_dict(own["weights"])
        self.runtime.step = int(extras["global_step"])


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(tensor: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)
