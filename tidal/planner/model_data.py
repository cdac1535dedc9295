"""Which transform holds each stage's model data: FSDP2's units or tidal's chunks.

[Note: chunk stages in plans]
A plan prices each device's model data by the fractions of [Note: model data offload] in
strategies.py: ``f`` of the optimizer state updated on the host, ``g`` of a ZeRO-3 unit's
parameter shard kept there and copied up for every use, ``h`` of the offloaded state on NVMe.
Two transforms carry those bytes out:

- FSDP2 (``fully_shard`` with ``CPUOffloadPolicy``, the host's share of the optimizer stepped
  by ``HostStepped``): it moves whole groups (a block's repetition, the root), the ones whose
  parameters come nearest ``g``, so the bytes on the host are ``g`` of the stage's only to a
  group's size;
- tidal's chunks ([Note: chunk stages] in tidal/parallel/chunk_stage.py): the stage's model
  data in chunks under a device budget, the store placing chunk by chunk along the warm-up
  trace (Belady eviction, prefetch, the optimizer of what fits on the device updated there:
  PatrickStar's device-aware placement), ZeRO-3 over the stage's data axis.

A chunk stage's budget is the plan's figure, not a re-reading of it: the device's is the
stage's predicted peak (the store's budget covers its chunks, gradients, optimizer state and
the activations it meters, as the prediction does), of which the predicted activations are set
aside for the activations at most (``memory.non_model_budget``: the chunks always get the rest,
the plan's model data on the device and its transient gathers; activations the cost model
undercounted go over the budget, and show as ``non_model_over_budget_bytes``, rather than fail
a plan that FSDP2 would run). The host holds the rest, unbounded (the plan prices it against
the host's memory), except the share ``h`` of the optimizer's state the plan keeps on NVMe,
which the chunks' disk tier takes by that share (``nvme_fraction``: the last chunks' state, to
the nearest chunk, [Note: nvme placement] in tidal/sharding/swap.py), not as what a host
budget leaves, since the plan's host figure prices parameters and the chunks add their padding.
The disk's traffic streams through a few chunks of host memory the plan does not price; the
run reports it (``host_staging_bytes``). A moment of a chunk store holds whole chunks (at its
worst, a recomputed block's, those of the module whose backward began beside those of the
module running again), which the plan's transient, three copies of a unit, does not bound:
where a model's modules are small against the chunks the job's ``chunk.size`` or
``chunk.max_size`` must come down, as the store's error at the first iteration says. Bounding
the size from the budget was tried and left: at half the chunks' room the tiny GPT's store
peaked at 84% of its predicted peak, and at a third 26% of the demo GPT's chunks were padding.
A rank of an interleaved plan holds ``v`` model chunks, each a chunk store of its own, and each
store takes the rank's whole budget, so the rank's peak is bounded by its stores' sum, not by
the budget (measured on the demo GPT, v = 2: 35.6 and 35.0 MiB against the rank's 67.1). An even
split was not taken: it leaves each store half of one unit's transient, less than a moment's
chunks; one device tier shared by the rank's stores is the fix. The same bytes are priced
either way: the store keeps on the device what
the budget lets it, which is what the fractions leave there, at a chunk's granularity instead
of a group's. So the choice does not move the search's figures, and :func:`with_model_data`
makes it after the search, per kind of stage:

- ``fsdp2`` (the default): every stage FSDP2's;
- ``chunks``: every stage chunks can hold (:func:`chunk_refusal`), the search offering units
  with parameters ZeRO-3 alone on meshes of one tensor rank and several data ranks
  (``TrainingSpec.chunked_weights``), so that they can hold every such stage;
- ``auto``: chunks where they can hold the stage and it keeps model data off the device (where
  the placement is the budget's, which chunks follow byte for byte), FSDP2 elsewhere.

FSDP2 is the default because it was the faster where both were measured: the same pp2 x dp2
plan with all of its model data on the host, 1.05 s a step under FSDP2 and 1.64 s in chunks on
4 gloo ranks sharing 2 cores (``tidal bench plan-check --ranks 4`` at 24d7a82; the chunk
store's per-moment work and its per-chunk gathers, issue 52's ZeRO-3 step on gloo).

Chunks hold a stage only where their runtime does what the plan says: one tensor rank (chunks
take plain parameters, not DTensors), every unit with model data ZeRO-3 when the data axis has
several ranks (a chunk stage shards all of it), a synchronous schedule (chunks hold one weight
version), no block swapped to the host (the swap would copy the parameters' chunk views that
autograd saves), nothing lent to a peer (the lending packs what the blocks save, chunk views
included) and no optimizer state on NVMe unless all of the stage's model data is on the host
(chunks on a disk are sharded, and a sharded store with a device budget keeps every shard on
the host, which a plan keeping part of them on the device did not price). ``check_plan``
refuses a hand-made plan that asks for more, in one line.
"""

from __future__ import annotations

import dataclasses
import math

from tidal.planner.block_savers import HOST_MODES
from tidal.planner.plan import ChunkBudgets, Plan

__all__ = ["MODEL_DATA", "chunk_budgets", "chunk_refusal", "with_model_data"]

MODEL_DATA = ("auto", "fsdp2", "chunks")
SYNCHRONOUS = ("1f1b", "interleaved", "gpipe")


def chunk_refusal(plan: Plan, stage: Plan) -> str:
    """Why chunks cannot hold ``stage`` (a stage of ``plan`` as a run realises it,
    :meth:`Plan.stage_plan`), for a reader; ``""``: they can."""
    schedule = "" if plan.pipeline is None else plan.pipeline.schedule
    sharded = [u.name for u in stage.units if u.zero != 3
               and u.memory.resident + u.memory.host + u.memory.nvme > 0]  # fmt: skip
    reasons = {
        "it is tensor-parallel (chunks take plain parameters)": stage.tp > 1,
        f"it runs {schedule} (chunks hold one weight version)": bool(schedule)
        and schedule not in SYNCHRONOUS,
        f"{', '.join(sharded[:2])} are not ZeRO-3 (a chunk stage shards all of its model "
        "data over the data axis)": stage.dp > 1 and bool(sharded),
        "it swaps blocks to the host": bool(set(HOST_MODES) & set(stage.recompute.values())),
        "it lends activations to a peer": stage.memory.lent > 0,
        "it keeps optimizer state on NVMe with part of its model data on the device (chunks "
        "on a disk are sharded, and sharded chunks keep every shard on the host)": _on_disk(stage)
        and (stage.offload.optimizer < 1 or stage.offload.params < 1),
    }
    return "; ".join(why for why, yes in reasons.items() if yes)


def chunk_budgets(stage: Plan) -> ChunkBudgets:
    """The budgets that carry out ``stage``'s figures in chunks ([Note: chunk stages in
    plans])."""
    memory = stage.memory
    return ChunkBudgets(device_bytes=math.ceil(memory.total),
                        activation_bytes=math.floor(memory.activations),
                        nvme_fraction=stage.offload.nvme if _on_disk(stage) else 0.0)  # fmt: skip


def _on_disk(stage: Plan) -> bool:
    return stage.memory.nvme > 0 or stage.offload.nvme > 0


def with_model_data(plan: Plan, mode: str) -> Plan:
    """``plan`` with each kind of stage's model data held as ``mode`` says ([Note: chunk
    stages in plans]): ``fsdp2``, ``chunks`` or ``auto``."""
    assert mode in MODEL_DATA, mode

    def chosen(stage: Plan) -> ChunkBudgets | None:
        if mode == "fsdp2" or chunk_refusal(plan, stage):
            return None
        if mode == "auto" and not stage.offload:
            return None
        return chunk_budgets(stage)

    layout = plan.pipeline
    if layout is None:
        return dataclasses.replace(plan, chunks=chosen(plan))
    # a kind's choice is its first stage's (with the model's ends where it holds them, the
    # most units): every stage of a kind is realised alike
    first = {kind: layout.kinds.index(kind) for kind in layout.stages if kind in layout.kinds}
    stages = {kind: dataclasses.replace(c, chunks=None if kind not in first
                                        else chosen(plan.stage_plan(first[kind])))
              for kind, c in layout.stages.items()}  # fmt: skip
    pipelined = dataclasses.replace(plan, pipeline=dataclasses.replace(layout, stages=stages))
    return dataclasses.replace(pipelined, chunks=stages[layout.kinds[0]].chunks)
