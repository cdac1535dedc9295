"""A plan's layout: what ``tidal train --plan PATH`` checks and lays out, and ``tidal.apply_plan``.

``tidal plan --json PATH`` writes a :class:`~tidal.planner.Plan`. ``tidal train --plan`` checks
it here (:func:`check_plan_fits`, :func:`plan_rows`) and trains the model ``plan_apply.apply``
lays out (DTensor on the ``tp`` mesh axis, FSDP2 on ``dp``) as the one stage of the train step
([Note: plan stages] in tidal/runtime/plan_weights.py), its optimizer split mesh by mesh
(:func:`build_plan_optimizer`). ``tidal.apply_plan`` gives the same layout to the reference
engine instead (:class:`PlanLayout`), whose calling convention, optimizer, schedule and clipping
rule it keeps, so a plan run and a one-device run of the same job take the same steps up to
rounding.

[Note: plan runs]
A plan fixes the mesh: it runs on exactly ``dp * tp`` ranks, rank ``r`` at data-parallel index
``r // tp`` (``make_mesh`` lays the mesh out row-major). The ranks of one tensor-parallel group
train on the same rows of the global batch, so ``training.batch_size`` splits over ``dp`` only
([Note: global batch] in trainer.py). Each data-parallel rank's loss is the mean over its rows;
FSDP and apply's hooks average the gradients over ``dp`` and finish the tensor axis's partial
sums, so what is optimised is the mean over the global batch, as on one device. ZeRO-1 units
accumulate unsynchronised until a step's last micro-batch (:func:`set_accumulating`).

The Trainer's checkpoints of a plan run are the one format of every stage, so they resume on
any mesh. :class:`PlanLayout`'s state (``tidal.apply_plan``'s engine) holds whole tensors,
gathered by every rank: the model in the single-device layout (``full_state_dict``), the
optimizer's state by parameter name in the plan's layout, so it loads under the same plan
only; it keeps the plan's choices and loading checks them.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tidal.config import ConfigError
from tidal.distributed import rank, world_size
from tidal.memory.materialize import ParameterValues, materialize
from tidal.memory.optim_rules import clip_factor
from tidal.parallel.accumulation import split_rows
from tidal.parallel.config import OptimizerConfig
from tidal.parallel.plan_apply import apply, full_state_dict, make_mesh, set_accumulating
from tidal.parallel.reference import build_optimizer
from tidal.planner import Plan
from tidal.planner.check import check_plan, not_run
from tidal.planner.measure import ModelGraph
from tidal.planner.wiring import meta_twin, structure_graph

__all__ = [
    "PlanLayout",
    "build_plan_optimizer",
    "check_plan_devices",
    "check_plan_fits",
    "load_plan",
    "plan_rows",
]

logger = logging.getLogger(__name__)

_MAKE_PLAN = "`tidal plan --model PRESET_OR_CONFIG --devices N --json PATH`"


def load_plan(path: str | Path) -> Plan:
    """The plan ``tidal plan --json`` wrote at ``path``; a missing or unreadable file is a
    ConfigError naming ``--plan``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--plan", f"no plan file at {str(path)!r}; make one with {_MAKE_PLAN}")
    try:
        return Plan.load(path)
    except (ValueError, KeyError, TypeError) as err:  # JSON errors are ValueErrors
        raise ConfigError(
            "--plan", f"{path} is not a plan {_MAKE_PLAN} wrote ({type(err).__name__}: {err})"
        ) from None


def check_plan_fits(
    plan: Plan,
    model: nn.Module,
    *,
    world_size: int,
    seq_len: int,
    graph: ModelGraph | None = None,
) -> None:
    """Raise a ConfigError naming ``--plan`` and the fix unless ``plan`` can train ``model`` (on
    the meta device or not) on ``world_size`` ranks with ``seq_len``-token sequences; ``graph``:
    the model's structure graph, traced here when not given."""
    check_plan_devices(plan, world_size)
    graph = graph or structure_graph(model, seq_len=seq_len)
    blocks = {u.count for u in plan.units if "*" in u.name}
    if plan.pipeline is not None:  # the stages' blocks together ([Note: plan pipelines])
        blocks = {plan.pipeline.block_ranges[-1][1]}
    ours = set(graph.blocks.values())
    planned = [(u.name, u.kind) for u in plan.units]
    if not graph.tokens and (plan.seq_len, planned) != (graph.seq_len, _units(graph)):
        raise ConfigError(
            "--plan",
            f"the plan was made for another model ({plan.model!r}: {len(planned)} units, dim 1 "
            f"of its input {plan.seq_len}); this run's {graph.name!r} has {len(graph.units)} "
            f"and {graph.seq_len}: make the plan for it with tidal.planner.plan_for(model, "
            f"inputs, devices={plan.dp * plan.tp})",
        )
    if graph.tokens and (plan.seq_len != seq_len or blocks != ours):
        raise ConfigError(
            "--plan",
            f"the plan was made for another model ({plan.model!r}: {_join(blocks)} blocks, "
            f"{plan.seq_len}-token sequences); this run's has {_join(ours)} blocks and "
            f"{seq_len}-token sequences: make the plan for it with {_MAKE_PLAN}",
        )
    try:
        if plan.pipeline is None:
            check_plan(model, plan, graph=graph)
        else:  # each stage on its part of the model ([Note: planned pipeline stages])
            from tidal.parallel.plan_apply import stage_layouts

            for gap in not_run(plan):  # the whole plan's, before its stages'
                raise ValueError(gap.why)
            for stage, (stage_plan, stage_graph, handed) in enumerate(stage_layouts(plan, graph)):
                try:
                    check_plan(model, stage_plan, graph=stage_graph, handed=handed)
                except ValueError as err:
                    raise ValueError(f"stage {stage}: {err}") from None
    except ValueError as err:
        raise ConfigError("--plan", str(err)) from None


def check_plan_devices(plan: Plan, world_size: int) -> None:
    """A ConfigError naming ``--plan`` unless ``world_size`` ranks are the plan's ``pp x dp x
    tp``."""
    devices = plan.pp * plan.dp * plan.tp
    mesh = f"dp {plan.dp} x tp {plan.tp}"
    if plan.pp > 1:
        mesh = f"pp {plan.pp} x {mesh}"
    if devices != world_size:
        ranks, other = "1 rank is", ""
        if world_size > 1:
            ranks, other = (
                f"{world_size} ranks are",
                f", or make the plan with --devices {world_size}",
            )
        raise ConfigError(
            "--plan",
            f"the plan is for {devices} devices ({mesh}) but {ranks} "
            f"running; run with --nproc {devices}{other}",
        )


def _units(graph: ModelGraph) -> list[tuple[str, str]]:
    return [(u.name, u.kind) for u in graph.units]


def _join(items: set[int]) -> str:
    return "/".join(str(n) for n in sorted(items)) or "no"


def plan_rows(batch_size: int, plan: Plan, *, rank: int) -> slice:
    """Rank ``rank``'s rows of a global batch under ``plan``; see [Note: plan runs]."""
    over = (f"the plan's {plan.dp} data-parallel ranks (dp {plan.dp} x tp {plan.tp}; the ranks "
            f"of a tensor-parallel group share their rows)")  # fmt: skip
    return split_rows(batch_size, index=rank // plan.tp, parts=plan.dp, over=over, fix="")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _by_mesh(tensors: list[Any]) -> list[list[Any]]:
    """``tensors`` by mesh, plain tensors together, in their order (so every rank's is the same).

    [Note: one mesh per list]
    torch's fused and foreach kernels, and ``torch.stack``, take a list of tensors that are all
    plain or all DTensors of one mesh, but a plan mixes FSDP's DTensors (``dp``, or ``dp x tp``),
    the tensor axis's (ZeRO-0 units under ``tp``) and plain tensors (ZeRO-0 units on ``dp``
    alone). So the optimizer's groups and the gradient norm go mesh by mesh.
    """
    found: dict[Any, list[Any]] = {}
    for t in tensors:
        found.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(found.values())


def build_plan_optimizer(
    model: nn.Module, config: OptimizerConfig, lr: float
) -> torch.optim.Optimizer:
    """The reference engine's optimizer, each group split by mesh ([Note: one mesh per list])."""
    optimizer = build_optimizer(model, config, lr)
    groups, optimizer.param_groups = optimizer.param_groups, []
    for group in groups:
        for params in _by_mesh(group["params"]):
            optimizer.add_param_group({**group, "params": params})
    return optimizer


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads``: each mesh's norm made whole, then theirs ([Note: one mesh
    per list])."""
    norms = []
    for group in _by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms))


def _plan_choices(plan: Plan) -> dict[str, Any]:
    """What a checkpoint must be resumed with: the mesh and every unit's choice."""
    return {
        "mesh": f"dp {plan.dp} x tp {plan.tp}",
        "units": {
            u.name: f"{u.strategy} {u.in_layout}->{u.out_layout} {u.zero}" for u in plan.units
        },
        "recompute": {k: str(v) for k, v in plan.recompute.items()},
    }


def _difference(saved: dict[str, Any], ours: dict[str, Any]) -> str:
    """The first way a checkpoint's plan choices differ from this plan's."""
    if saved["mesh"] != ours["mesh"]:
        return f"mesh {saved['mesh']}, not {ours['mesh']}"
    units = saved["units"].keys() | ours["units"].keys()
    for name in sorted(n for n in units if saved["units"].get(n) != ours["units"].get(n)):
        return f"unit {name}: {saved['units'].get(name)}, not {ours['units'].get(name)}"
    return f"recompute {saved['recompute']}, not {ours['recompute']}"


class PlanLayout:
    """The reference engine's layout under ``plan`` on its ``dp x tp`` ranks: backward without
    an all-reduce (FSDP and apply's hooks average), clipping mesh by mesh, this rank's shares
    in the byte counts, and whole tensors in the state ([Note: plan runs]). ``seq_len``: the
    run's (default: the plan's); ``batch_size``: the run's global micro-batch, checked against
    what the plan was priced for; ``inputs``: a sample of your own model's inputs, which it is
    traced on instead of token ids."""

    name = "plan"
    optimizer_by_name = True

    def __init__(self, plan: Plan, *, seq_len: int | None = None, batch_size: int | None = None,
                 inputs: tuple[torch.Tensor, ...] | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.seq_len = plan.seq_len if seq_len is None else seq_len
        self.batch_size = batch_size
        self.inputs = inputs  # your own model's: traced on them ([Note: models without tokens])

    def place(self, model: nn.Module, *, device: torch.device, precision: str,
              init: ParameterValues | None) -> nn.Module:  # fmt: skip
        # The model's structure, and a meta copy to lay checkpoints out with (_load_model).
        self._graph = structure_graph(model, seq_len=self.seq_len, inputs=self.inputs)
        self._blueprint = meta_twin(model, buffers=True)
        check_plan_fits(self.plan, model, world_size=world_size(), seq_len=self._graph.seq_len,
                        graph=self._graph)  # fmt: skip
        if precision == "fp16":
            raise ConfigError(
                "training.precision",
                "a plan run trains in 'fp32' or 'bf16' (fp16's loss scaling is not wired to "
                "sharded gradients); use 'bf16'",
            )
        if init is not None:  # a model on the meta device: all of it here, until apply shards it
            materialize(model, init, device)
        self.device = device
        self.mesh = make_mesh(self.plan, device.type)
        self._warn_on_micro_batch()
        return apply(model.to(device), self.plan, self.mesh, graph=self._graph)

    def _warn_on_micro_batch(self) -> None:
        if self.batch_size is None:
            return
        rows = self.batch_size // self.plan.dp
        if rank() == 0 and rows != self.plan.micro_batch:
            logger.warning(
                "the plan was priced for %d sequence(s) per data-parallel rank and micro-batch; "
                "this run has %d (training.batch_size %d / dp %d), so its memory differs from "
                "the plan's",
                self.plan.micro_batch, rows, self.batch_size, self.plan.dp,
            )  # fmt: skip

    def build_optimizer(self, model: nn.Module, config: OptimizerConfig,
                        lr: float) -> torch.optim.Optimizer:  # fmt: skip
        return build_plan_optimizer(model, config, lr)

    def before_backward(self, model: nn.Module, *, boundary: bool) -> None:
        set_accumulating(model, not boundary)

    def after_backward(self, model: nn.Module, *, boundary: bool) -> None:
        """Nothing: FSDP and apply's hooks averaged the gradients over ``dp``."""

    def clip(self, model: nn.Module, max_norm: float) -> float:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = _total_norm(grads)
        if max_norm > 0:
            # clip_grad_norm_'s rule, with a Python factor: its tensor one cannot multiply DTensors
            factor = float(clip_factor(norm, max_norm))
            for grad in grads:
                grad.mul_(factor)
        return float(norm)

    def nbytes(self, t: torch.Tensor) -> int:
        local = _local(t)
        return local.numel() * local.element_size()

    def stats(self) -> dict[str, Any]:
        return {"mesh": f"dp {self.plan.dp} x tp {self.plan.tp}"}

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model in the single-device layout; a collective (every rank calls it)."""
        return full_state_dict(model, self.plan)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Whole tensors ([Note: plan runs]); the optimizer's on rank 0 only, on the CPU. A
        collective: every rank must call it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": full_state_dict(model, self.plan),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
            "plan": _plan_choices(self.plan),
        }

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:  # fmt: skip
        """Load what :meth:`state_dict` gave, on every rank (a collective)."""
        saved = state.get("plan")
        if saved is None:
            raise ConfigError(
                "--plan", "the checkpoint was not trained with a plan; resume it without --plan"
            )
        ours = _plan_choices(self.plan)
        if saved != ours:
            raise ConfigError(
                "--plan",
                f"the checkpoint was trained with another plan ({_difference(saved, ours)}); "
                f"resume with the plan file it was trained with, or export it with `tidal "
                f"export RUN_DIR`",
            )
        self._load_model(model, state["model"])
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)

    def _load_model(self, model: nn.Module, values: dict[str, torch.Tensor]) -> None:
        """Whole single-device values into this rank's shares. They go through ``apply`` on a
        fresh model, so they land in the plan's layout (fused qkv rows reordered, shards cut)
        by the code that laid out the model being trained."""
        fresh = meta_twin(self._blueprint, buffers=True)
        materialize(fresh, lambda: values.items(), self.device)
        with warnings.catch_warnings():  # apply warned of any detour when the engine was built
            warnings.simplefilter("ignore")
            apply(fresh, self.plan, self.mesh, graph=self._graph)
        own = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in fresh.named_parameters():
                _local(own[name]).copy_(_local(value))
