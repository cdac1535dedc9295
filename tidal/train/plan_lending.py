"""MPress's peer swap in a plan run: the stages a pipelined plan lends from, and what they lend.

[Note: lending in plan runs]
A pipelined plan made with ``--peer`` keeps part of a lending stage's saved activations on its
mirror stage's devices ([Note: activations on a peer] in tidal/planner/pipelines.py): stage
``s`` on pipeline rank ``r`` lends to rank ``p - 1 - r`` (its mirror, on the same data and
tensor coordinates: the pipeline's messages go over the pipeline axis of the mesh), ``lent``
bytes of its kind's choices (``StageChoices.memory.lent``, for its micro-batches in flight).
The planner lends a continuous amount of any of the stage's tensors; the runtime lends what
the savers per class of tensor ([Note: savers per tensor class] in
tidal/planner/block_savers.py) can: the stage's first ``k`` blocks whole and, of the next
one, the child module of one class (its attention or its MLP), the ``k`` and the class whose
bytes as the plan counts them (each block unit's activations) come nearest the lent bytes
(:func:`lent_parts`; at least a class, at most every block), through the lending the pipeline
carries out for non-plan runs ([Note: lending] in tidal/pipeline/lending.py, ``PeerSwap``).
An attention whose core is recomputed (``selective``) is not lent: checkpoint's saved-tensor
hooks would nest inside the lending's. The first blocks' activations wait longest between
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
from tidal.planner.plan import Recompute

if TYPE_CHECKING:
    from tidal.planner import Plan

__all__ = ["LentParts", "PlanLending", "lent_parts", "plan_lending"]


@dataclass(frozen=True, slots=True)
class LentParts:
    """What a lending stage lends ([Note: lending in plan runs]): its first ``blocks`` blocks
    whole and, with ``child``, that class's child module of the next block (``attn``);
    ``priced_bytes``, what the plan's figures give them, against its ``lent``."""

    blocks: int = 0
    child: str | None = None
    priced_bytes: float = 0.0

    def modules(self) -> list[str]:
        """The stage's submodules that lend, as the stage names them."""
        whole = [f"layers.{k}" for k in range(self.blocks)]
        return whole + ([] if self.child is None else [f"layers.{self.blocks}.{self.child}"])


def lent_parts(plan: Plan, stage: int) -> LentParts:
    """What stage ``stage`` lends (nothing: ``LentParts()``); see [Note: lending in plan
    runs]."""
    from tidal.planner.block_savers import classes_of

    layout = plan.pipeline
    assert layout is not None, "only pipelined plans lend"
    rank = stage % layout.pp
    flat = plan.stage_plan(stage)
    if not flat.memory.lent or layout.pp - 1 - rank == rank:
        return LentParts()
    blocks = [u for u in flat.units if "*" in u.module]
    num_blocks = blocks[0].count if blocks else 0
    per_block = sum(u.memory.activations for u in blocks)
    if not num_blocks or per_block <= 0:
        return LentParts()
    prefix = blocks[0].module[: blocks[0].module.index("*") + 1]
    children = classes_of(((u.module, u.kind) for u in blocks), prefix)
    recomputed = flat.recompute.get(prefix, Recompute.NONE)
    per_child = {child: sum(u.memory.activations for u in blocks
                            if f"{u.module}.".startswith(f"{prefix}.{child}."))
                 for child, cls in children.items()
                 # a class whose core recomputes keeps checkpoint's saved-tensor hooks inside
                 if not (cls == "attention" and recomputed is Recompute.SELECTIVE)}  # fmt: skip
    options = [LentParts(k, None, k * per_block) for k in range(1, num_blocks + 1)]
    options += [LentParts(k, child, k * per_block + b) for k in range(num_blocks)
                for child, b in per_child.items() if b > 0]  # fmt: skip
    return min(options, key=lambda o: (abs(o.priced_bytes - flat.memory.lent), o.priced_bytes))


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
    parts = {s: lent_parts(plan, s) for s in range(layout.num_stages)}
    lenders = {s: (layout.pp - 1 - s % layout.pp,) for s, p in parts.items() if p.modules()}
    if not lenders:
        return PlanLending(None, [])
    swaps: dict[int, PeerSwap] = {}
    handles = []
    for s in (s for s in mine if s in lenders):
        swaps[s] = PeerSwap()
        stripe = Stripe(lenders=lenders[s], weights=(1.0,))
        savers = dict.fromkeys(parts[s].modules(), Saver.PEER)
        handles.append(apply_savers(stages[s], savers, peer=swaps[s],
                                    lenders=dict.fromkeys(savers, stripe)))  # fmt: skip
    return PlanLending(Lending(lenders=lenders, swaps=swaps), handles)
