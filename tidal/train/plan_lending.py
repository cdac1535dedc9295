"""MPress's peer swap in a plan run: the stages a pipelined plan lends from, and what they lend.

[Note: lending in plan runs]
A pipelined plan made with ``--peer`` keeps part of a lending stage's saved activations on its
mirror stage's devices ([Note: activations on a peer] in tidal/planner/pipelines.py): stage
``s`` on pipeline rank ``r`` lends to rank ``p - 1 - r`` (its mirror, on the same data and
tensor coordinates: the pipeline's messages go over the pipeline axis of the mesh), ``lent``
bytes of its kind's choices (``StageChoices.memory.lent``, for its micro-batches in flight).
The planner lends a continuous amount of any of the stage's tensors; the runtime lends whole
blocks, the ones the pipeline's lending carries out for non-plan runs ([Note: lending] in
tidal/pipeline/lending.py, ``PeerSwap``): the stage's first ``k`` blocks, ``k`` the lent bytes
over one block's saved bytes as the plan counts them (each block unit's activations), rounded,
at least one and at most all of them. The first blocks' activations wait longest between
their forward and their backward, the most time to hide the round trip in. What a block saves
goes with the stage's ``LO`` after its forward, FSDP2's gathered weights and the parameters
excepted (they are model data), a tensor-parallel activation as its local share, and comes
back before its backward. Plans that lend under interleaving, or from blocks that are
recomputed whole or swapped to the host (whose own saved-tensor hooks would nest with it), are
refused before training (``check.not_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.activations.apply import SaverHandles, apply_savers
from tidal.activations.costs import Saver, Stripe
from tidal.activations.runtime import PeerSwap
from tidal.pipeline.lending import Lending
from tidal.pipeline.split import PipelineStage

if TYPE_CHECKING:
    from tidal.planner import Plan

__all__ = ["PlanLending", "blocks_lent", "plan_lending"]


def blocks_lent(plan: Plan, stage: int) -> int:
    """How many of stage ``stage``'s blocks it lends (0: none); see [Note: lending in plan
    runs]."""
    layout = plan.pipeline
    assert layout is not None, "only pipelined plans lend"
    rank = stage % layout.pp
    flat = plan.stage_plan(stage)
    if not flat.memory.lent or layout.pp - 1 - rank == rank:
        return 0
    blocks = [u for u in flat.units if "*" in u.module]
    num_blocks = blocks[0].count if blocks else 0
    per_block = sum(u.memory.activations for u in blocks)
    if not num_blocks or per_block <= 0:
        return 0
    return min(num_blocks, max(1, round(flat.memory.lent / per_block)))


@dataclass(frozen=True, slots=True)
class PlanLending:
    """What :func:`plan_lending` set up on this rank: the lending (None: the plan lends
    nothing) and the savers' handles of this rank's lending stages."""

    lending: Lending | None
    handles: list[SaverHandles]


def plan_lending(
    plan: Plan, stages: Sequence[PipelineStage], *, mine: Sequence[int]
) -> PlanLending:
    """[Note: lending in plan runs] for this rank's stages ``mine`` of ``stages`` (every
    stage, this rank's laid out)."""
    layout = plan.pipeline
    if layout is None:
        return PlanLending(None, [])
    counts = {s: blocks_lent(plan, s) for s in range(layout.num_stages)}
    lenders = {s: (layout.pp - 1 - s % layout.pp,) for s, k in counts.items() if k}
    if not lenders:
        return PlanLending(None, [])
    swaps: dict[int, PeerSwap] = {}
    handles = []
    for s in (s for s in mine if s in lenders):
        swaps[s] = PeerSwap()
        stripe = Stripe(lenders=lenders[s], weights=(1.0,))
        savers = {f"layers.{k}": Saver.PEER for k in range(counts[s])}
        handles.append(apply_savers(stages[s], savers, peer=swaps[s],
                                    lenders=dict.fromkeys(savers, stripe)))  # fmt: skip
    return PlanLending(Lending(lenders=lenders, swaps=swaps), handles)
