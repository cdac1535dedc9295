"""MPress's savers on a schedule: what each stage saves, read off the simulator's timeline, and
the step with the savers' seconds put back into it.

[Note: savers on a schedule]
The planner (tidal/activations/plan.py) takes plain numbers; this is where a schedule gives them.
A stage holds, at its peak, ``peak_activations[s]`` microbatches' saved tensors (1F1B: p - s)
and ``weight_versions[s] - 1`` stashed versions of its weights (PipeDream: up to p - s; 2BW: 1).
A saved tensor is idle from the end of its microbatch's forward to the start of its backward on
that stage; the shortest such window over the step's microbatches is what a swap may hide in
(``idle_s``). A weight version is idle as long as the activations of the microbatch it serves.
Recomputing a class of a block's tensors costs that class's share (by bytes) of the block's
forward: all of them together cost one forward, a selective recompute less ([H]: the split of a
block's forward time between its classes is not measured).
The step with savers: each microbatch's backward on a stage takes the seconds the stage's savers
add per use, and the simulator runs the schedule again, so a transfer or a recompute that lands
on the critical path lengthens the step and one in a bubble does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tidal.activations.costs import Saved, SaverPlan, TensorClass
from tidal.activations.measure import measure_saves
from tidal.config import require
from tidal.pipeline.ir import Kind, parse_action
from tidal.pipeline.simulate import Simulation, simulate
from tidal.pipeline.split import PipelineStage
from tidal.pipeline.stage_init import stand_in

__all__ = [
    "BlockSaves",
    "UnitSaves",
    "idle_windows",
    "measure_units",
    "saved_tensors",
    "stage_units",
    "step_with_savers",
    "unit_class",
    "whole_blocks",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class UnitSaves:
    """What one submodule of a stage (``path``, in block ``block``; "" for what the stage
    saves outside every submodule, which no saver moves) saves for one microbatch, the
    seconds to recompute it (None: it cannot be) and what a recompute of it keeps."""

    stage: int
    block: int
    tensor_class: TensorClass
    num_bytes: int
    recompute_s: float | None
    path: str = ""
    keeps_bytes: int = 0
    fixed: bool = False


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockSaves:
    """What one block of a stage saves per microbatch, by class, and its forward seconds."""

    stage: int
    block: int
    bytes_by_class: Mapping[TensorClass, int]
    forward_s: float

    def __post_init__(self) -> None:
        require(TensorClass.WEIGHTS not in self.bytes_by_class, "bytes_by_class",
                "weight versions come from the schedule, not from a block")  # fmt: skip

    def units(self) -> list[UnitSaves]:
        """One unit per class; recomputing a class costs its share (by bytes) of the forward."""
        internal = sum(
            n for c, n in self.bytes_by_class.items() if c is not TensorClass.BLOCK_INPUT
        )
        return [
            UnitSaves(stage=self.stage, block=self.block, tensor_class=cls, num_bytes=num_bytes,
                      recompute_s=None if cls is TensorClass.BLOCK_INPUT
                      else (self.forward_s * num_bytes / internal if internal else 0.0))
            for cls, num_bytes in self.bytes_by_class.items()
        ]  # fmt: skip


def idle_windows(sim: Simulation) -> tuple[float, ...]:
    """Per stage, the shortest time from a microbatch's forward end to its backward start."""
    ends: dict[tuple[int, int], float] = {}
    shortest = [float("inf")] * sim.schedule.num_stages
    for event in sim.events:
        action = parse_action(event.action)
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            ends[key] = event.end_s
        elif action.kind is Kind.BACKWARD and key in ends:
            shortest[action.stage] = min(shortest[action.stage], event.start_s - ends.pop(key))
    return tuple(0.0 if s == float("inf") else s for s in shortest)


def saved_tensors(sim: Simulation, units: Sequence[UnitSaves | BlockSaves], *,
                  weight_bytes: Sequence[int]) -> list[Saved]:  # fmt: skip
    """The planner's input for ``sim``'s schedule: every unit (a block's, by class), plus each
    stage's stashed weight versions ([Note: savers on a schedule])."""
    schedule = sim.schedule
    idle = idle_windows(sim)
    uses = schedule.num_microbatches
    flat = [u for x in units for u in (x.units() if isinstance(x, BlockSaves) else [x])]
    out = [Saved(stage=u.stage, block=u.block, tensor_class=u.tensor_class, num_bytes=u.num_bytes,
                 copies=sim.peak_activations[u.stage], uses_per_step=uses,
                 recompute_s=u.recompute_s, idle_s=idle[u.stage], path=u.path,
                 recompute_keeps_bytes=u.keeps_bytes, fixed=u.fixed)
           for u in flat]  # fmt: skip
    for stage, num_bytes in enumerate(weight_bytes):
        extra = sim.weight_versions[stage] - 1
        if extra > 0 and num_bytes > 0:
            out.append(Saved(stage=stage, block=-1, tensor_class=TensorClass.WEIGHTS,
                             num_bytes=num_bytes, copies=extra, uses_per_step=uses,
                             recompute_s=None, idle_s=idle[stage],
                             copies_lent=sim.peak_activations[stage]))  # fmt: skip
    return out


def whole_blocks(saved: Sequence[Saved]) -> list[Saved]:
    """``saved`` with each block's parts (units ``layers.<k>.<part>``) made one unit at the
    block's path (a block that is one unit, ``layers.<k>``, stays as it is): a saver on the whole block keeps what its first part keeps (the block's
    input) and brings back all the block saved at once. Other items are left as they are."""
    groups: dict[tuple[int, int, str], list[Saved]] = {}
    out: list[Saved] = []
    for item in saved:
        parent = item.path.rpartition(".")[0]
        is_part = parent.rpartition(".")[2].isdigit()  # "layers.3.attn"; "layers.3" is a block
        if item.block < 0 or not is_part or item.tensor_class is TensorClass.WEIGHTS:
            out.append(item)
            continue
        key = (item.stage, item.block, parent)
        if key not in groups:
            groups[key] = []
            out.append(item)  # where the merged block goes; replaced below
        groups[key].append(item)
    merged = {(g[0].stage, g[0].block, g[0].path): _merge(path, g)
              for (_, _, path), g in groups.items()}  # fmt: skip
    return [merged.get((i.stage, i.block, i.path), i) for i in out]


def _merge(path: str, parts: Sequence[Saved]) -> Saved:
    first = parts[0]
    times = [p.recompute_s for p in parts]
    return dataclasses.replace(
        first, tensor_class=TensorClass.OTHER, path=path,
        num_bytes=sum(p.num_bytes for p in parts),
        recompute_s=None if None in times else sum(t for t in times if t is not None),
        recompute_keeps_bytes=first.recompute_keeps_bytes,
    )  # fmt: skip


def step_with_savers(sim: Simulation, plan: SaverPlan) -> Simulation:
    """``sim``'s schedule again, each backward lengthened by what its stage's savers add per
    microbatch."""
    schedule = sim.schedule
    added = [0.0] * schedule.num_stages
    for item, seconds in zip(plan.saved, plan.item_added_s, strict=True):
        added[item.stage] += seconds / max(item.uses_per_step, 1)
    backward = sim.costs.per_stage("backward_s", schedule.num_stages)
    costs = dataclasses.replace(
        sim.costs, backward_s=tuple(b + a for b, a in zip(backward, added, strict=True))
    )
    return simulate(schedule, costs)


# Norms first: Hugging Face's post_attention_layernorm is a norm.
_CLASS_WORDS = ((TensorClass.NORM, ("norm", "ln")),
                (TensorClass.ATTENTION, ("attn", "attention")),
                (TensorClass.MLP, ("mlp", "ffn", "feed_forward")))  # fmt: skip


def unit_class(path: str) -> TensorClass:
    """A saver unit's class, from its name (tidal's GPT and Hugging Face decoders name their
    blocks' parts ``attn`` / ``self_attn``, ``mlp``, ``ln_1`` / ``input_layernorm``)."""
    name = path.rsplit(".", 1)[-1].lower()
    for cls, words in _CLASS_WORDS:
        if any(word in name for word in words):
            return cls
    return TensorClass.OTHER


def stage_units(stage: PipelineStage) -> list[tuple[str, int]]:
    """The submodules of ``stage`` savers apply to, with the model's block each is in (-1 for
    the embedding and the head): each block's direct parts (the block itself if it has none)."""
    units = [("embed", -1)] if stage.embed is not None else []
    for k, layer in enumerate(stage.layers):
        parts = [name for name, _ in layer.named_children()]
        block = stage.first_block + k
        units += [(f"layers.{k}.{name}", block) for name in parts] or [(f"layers.{k}", block)]
    if stage.head is not None:
        units.append(("head", -1))
    return units


def measure_units(stages: Sequence[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor,
                  block_forward_s: Callable[[int, int], float]) -> list[UnitSaves]:  # fmt: skip
    """Every stage's units and what each saves for one microbatch (``inputs``, ``targets``),
    measured stage after stage; ``block_forward_s(stage, block)``: the forward seconds a block
    (-1: the stage's embedding and head) takes, shared by its units by bytes."""
    devices = [inputs.device] if inputs.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # a probe must not move training's dropout
        return _measure(stages, inputs, targets, block_forward_s)


def _measure(stages: Sequence[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor,
             block_forward_s: Callable[[int, int], float]) -> list[UnitSaves]:  # fmt: skip
    out: list[UnitSaves] = []
    x = inputs
    for s, given in enumerate(stages):
        stage = stand_in(given, inputs.device)  # another rank's stage is on the meta device
        units = stage_units(stage)

        def run(stage: PipelineStage = stage, x: torch.Tensor = x) -> torch.Tensor:
            return stage(x, targets) if stage.is_last else stage(x)

        saves = measure_saves(stage, [path for path, _ in units], run)
        held = saves.saved_bytes
        per_block: dict[int, int] = {}
        for path, block in units:
            per_block[block] = per_block.get(block, 0) + held[path]
        for path, block in units:
            share = held[path] / per_block[block] if per_block[block] else 0.0
            out.append(UnitSaves(stage=s, block=block, tensor_class=unit_class(path),
                                 num_bytes=held[path], path=path,
                                 recompute_s=block_forward_s(s, block) * share,
                                 keeps_bytes=min(saves.input_bytes[path], held[path])))  # fmt: skip
        if saves.outside_bytes:
            out.append(UnitSaves(stage=s, block=-1, tensor_class=TensorClass.OTHER,
                                 num_bytes=saves.outside_bytes, recompute_s=None, fixed=True))  # fmt: skip
        if not stage.is_last:  # the next stage's input, as a received activation is
            with torch.no_grad():
                x = stage(x)
            x = x.requires_grad_() if x.is_floating_point() else x
    return out
