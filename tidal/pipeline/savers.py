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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidal.activations.plan import Saved, SaverPlan, TensorClass
from tidal.config import require
from tidal.pipeline.ir import Kind, parse_action
from tidal.pipeline.simulate import Simulation, simulate

__all__ = ["BlockSaves", "idle_windows", "saved_tensors", "step_with_savers"]


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockSaves:
    """What one block of a stage saves for one microbatch, by class, and its forward seconds."""

    stage: int
    block: int
    bytes_by_class: Mapping[TensorClass, int]
    forward_s: float

    def __post_init__(self) -> None:
        require(TensorClass.WEIGHTS not in self.bytes_by_class, "bytes_by_class",
                "weight versions come from the schedule, not from a block")  # fmt: skip


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


def saved_tensors(sim: Simulation, blocks: Sequence[BlockSaves], *,
                  weight_bytes: Sequence[int]) -> list[Saved]:  # fmt: skip
    """The planner's input for ``sim``'s schedule: every class of every block, plus each
    stage's stashed weight versions ([Note: savers on a schedule])."""
    schedule = sim.schedule
    idle = idle_windows(sim)
    uses = schedule.num_microbatches
    out = []
    for block in blocks:
        internal = sum(
            n for c, n in block.bytes_by_class.items() if c is not TensorClass.BLOCK_INPUT
        )
        for cls, num_bytes in block.bytes_by_class.items():
            recompute = None
            if cls is not TensorClass.BLOCK_INPUT:
                recompute = block.forward_s * num_bytes / internal if internal else 0.0
            out.append(Saved(stage=block.stage, block=block.block, tensor_class=cls,
                             num_bytes=num_bytes, copies=sim.peak_activations[block.stage],
                             uses_per_step=uses, recompute_s=recompute,
                             idle_s=idle[block.stage]))  # fmt: skip
    for stage, num_bytes in enumerate(weight_bytes):
        extra = sim.weight_versions[stage] - 1
        if extra > 0 and num_bytes > 0:
            out.append(Saved(stage=stage, block=-1, tensor_class=TensorClass.WEIGHTS,
                             num_bytes=num_bytes, copies=extra, uses_per_step=uses,
                             recompute_s=None, idle_s=idle[stage]))  # fmt: skip
    return out


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
