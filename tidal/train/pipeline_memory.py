"""``pipeline.memory`` and ``memory.device_budget`` for a pipeline run: measure what every stage
saves, plan MPress's savers, carry them out, and hold each rank to its budget.

[Note: pipeline memory]
With ``memory.device_budget`` set, a pipeline run checks before its first step that each rank
fits: its stages' model data (weights, gradients and optimizer state: 4 x the weights with
AdamW or Adam, 3 x otherwise) plus, for every unit of its stages (each block's parts, the
embedding, the head: :func:`~tidal.pipeline.savers.stage_units`), one microbatch's saved bytes
times the microbatches the schedule keeps in flight there. The bytes are measured on one
microbatch before training (a :class:`MemoryProbe`: zeros for tidal's models, the first batch of
your data for your own ``nn.Sequential``), by every rank for every stage (another rank's stage
on an empty stand-in, one at a time: [Note: stages from the meta device] in
tidal/pipeline/stage_init.py), and every rank carries out rank 0's plan (the exact planner stops at a time limit, so
ranks planning alone could choose differently). ``pipeline.memory``:

- ``none`` refuses a run that does not fit, in one line that names ``auto``;
- ``recompute`` / ``host`` put that saver on every block of every stage;
- ``selective`` recomputes each block's attention part only (``attn`` / ``self_attn``: Megatron's
  selective recompute, the part whose saved bytes grow with the sequence) and keeps the rest;
- ``auto`` runs the saver planner over the units ([Note: the saver planners] in
  tidal/activations/plan.py) with every saver (recompute only where the schedule allows it;
  peer swap to other ranks, [Note: lending] in tidal/pipeline/lending.py) and the links
  measured on the ranks ([Note: measured links] in tidal/train/links.py), and carries out its
  choices on this rank's stages; ``peer`` the same with peer swap only; no plan fits: one line
  naming the least budget. PipeDream's stashed weight versions may go to the host tier or a
  peer too ([Note: stashes on the host], [Note: stashes on a peer] in
  tidal/runtime/weights.py).

While a synchronous schedule trains, a saved-tensor meter around each of this rank's stage
forwards counts what they save (a host-swapped, lent or recomputed tensor is not there, and is
not counted), what the rank holds for others is added, and the guard raises the moment model
data plus those would pass the budget, so a run can never silently hold more than it was
given. Asynchronous schedules (which keep their own saved-tensor
hooks) get the check before the first step, not the meter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tidal.activations import (
    Links,
    Saved,
    Saver,
    SaverPlan,
    Stripe,
    TensorClass,
    evaluate,
    keep_all,
    plan_savers,
)
from tidal.activations.apply import SaverHandles, apply_savers, check_schedule
from tidal.activations.costs import Choice
from tidal.activations.runtime import PeerSwap, around_forward
from tidal.config import ConfigError, format_bytes
from tidal.distributed import decided_on_main
from tidal.memory.activations import SavedTensorMeter
from tidal.memory.tiers import Tier, TierKind, make_tiers, resolve_budget
from tidal.parallel.reference import check_model_data_fits
from tidal.pipeline.lending import Lending, lender_ranks
from tidal.pipeline.savers import (
    measure_units,
    saved_tensors,
    stage_units,
    unit_class,
    whole_blocks,
)
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import simulate
from tidal.pipeline.split import PipelineStage
from tidal.runtime.weights import Lend
from tidal.train.job import JobConfig
from tidal.train.links import measure_links
from tidal.train.plan_lending import plan_lending

if TYPE_CHECKING:
    from tidal.planner import Plan

__all__ = ["MemoryProbe", "PipelineMemory", "model_data_per_weight_byte", "plan_pipeline_memory"]


@dataclass(slots=True)
class PipelineMemory:
    """What ``pipeline.memory`` did on this rank: the plan (None without a budget), the
    savers' handles, and the budget guard (None: no meter)."""

    mode: str
    plan: SaverPlan | None
    handles: list[SaverHandles]
    guard: _Guard | None
    budget_bytes: int | None
    lending: Lending | None = None
    forward_weights: dict[int, _ForwardWeights] = dataclasses.field(default_factory=dict)
    reclaims: _Reclaims | None = None
    # this rank's stages whose stashed weight versions wait in the host tier or on a peer
    # ([Note: stashes on the host], [Note: stashes on a peer] in tidal/runtime/weights.py)
    stashes_on_host: tuple[int, ...] = ()
    stashes_lent: dict[int, Lend] = dataclasses.field(default_factory=dict)
    host: Tier | None = None

    def bind(self, weights: Mapping[int, Any]) -> None:
        """The stages' weights, once built: a stashing schedule's recomputes run on them, and
        the stashes the plan puts on the host or a peer go there."""
        for s, holder in self.forward_weights.items():
            holder.weights = weights[s]
        for s in self.stashes_on_host:
            assert self.host is not None, "stashes on the host need the host tier"
            weights[s].stash_to(self.host)
        for s, lend in self.stashes_lent.items():
            weights[s].lend_with(lend)

    def counters(self) -> dict[str, int]:
        """This rank's running figures, each a whole number (ranks gather them every step):
        the bytes its stages' savers sent to the host and lent to peers so far and, with a
        budget, the budget, its model data and the most it held (model data, saved
        activations, what it holds for others)."""
        out = {
            "to_host_bytes": sum(h.host.bytes_out for h in self.handles if h.host is not None),
            "lent_bytes": 0 if self.lending is None
            else sum(p.bytes_lent for p in self.lending.swaps.values()),
        }  # fmt: skip
        if self.guard is not None:
            out["budget_bytes"] = self.guard.budget
            out["model_data_bytes"] = self.guard.base
            out["peak_bytes"] = self.guard.peak_bytes
        return out

    def figures(self, rank: int) -> dict[str, Any]:
        hosts = [h.host for h in self.handles if h.host is not None]
        out: dict[str, Any] = {
            "mode": self.mode,
            "blocks_recomputed": sum(len(h.recomputed) for h in self.handles),
            "blocks_swapped": sum(len(h.swapped) for h in self.handles),
            "tensors_to_host": sum(h.tensors_out for h in hosts),
            "peak_host_bytes": max((h.tier.peak_bytes for h in hosts), default=0),
            "blocks_lent": sum(len(h.lent) for h in self.handles),
            "stashes_on_host": list(self.stashes_on_host),
            "stashes_lent": sorted(self.stashes_lent),
        }
        if self.lending is not None:
            out["lends_to"] = sorted({r for s in self.lending.swaps
                                      for r in self.lending.lenders[s]})  # fmt: skip
            out["bytes_lent"] = sum(p.bytes_lent for p in self.lending.swaps.values())
        if self.reclaims is not None:
            out["reclaims"] = self.reclaims.count
            out["reclaim_wait_s"] = self.reclaims.seconds
        if self.plan is not None:
            out["budget_bytes"] = self.budget_bytes
            out["predicted_peak_bytes"] = self.plan.peak_bytes[rank]
        if self.guard is not None:
            out["model_data_bytes"] = self.guard.base
            out["measured_peak_bytes"] = self.guard.peak_bytes
            out["peak_held_bytes"] = self.guard.peak_held_bytes
        return out


def model_data_per_weight_byte(job: JobConfig) -> int:
    """A stage's model data per byte of its weights: the weights, their gradients and the
    optimizer's state (AdamW and Adam keep two moments, SGD one buffer at most)."""
    return 2 + job.optimizer.state_tensors_per_param


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    """One microbatch to measure the stages' saves on (``inputs`` for the first stage,
    ``targets`` for the last), and the forward seconds of block ``b`` of stage ``s`` that price
    its recompute (``block_forward_s(s, b)``; -1: the embedding and the head)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    block_forward_s: Callable[[int, int], float]


def plan_pipeline_memory(job: JobConfig, stages: Sequence[PipelineStage], *, mine: Sequence[int],
                         rank: int, world_size: int, device: torch.device,
                         probe: MemoryProbe | None, planned: Plan | None = None) -> PipelineMemory:  # fmt: skip
    """[Note: pipeline memory] for this rank's stages ``mine`` of ``stages`` (all of them);
    ``probe``: what to measure them on (needed with a device budget). ``planned``: the stages'
    plan, which chose their recomputation itself and was priced against its device: no savers
    and no budget of the job's, its own lending ([Note: lending in plan runs])."""
    pipe, mode = job.pipeline, job.pipeline.memory
    if planned is not None:
        lent = plan_lending(planned, stages, mine=mine)
        return PipelineMemory(mode=mode, plan=None, handles=lent.handles, guard=None,
                              budget_bytes=None, lending=lent.lending)  # fmt: skip
    budget = resolve_budget(job.memory.device_budget, kind=TierKind.DEVICE, device=device,
                            key="memory.device_budget")  # fmt: skip
    if job.engine == "chunk":  # chunk stages' stores hold the budget ([Note: chunk stages])
        budget = None
    if budget is None and mode in ("auto", "peer"):
        raise ConfigError("pipeline.memory", f"{mode!r} plans against memory.device_budget; set "
                          "it (each rank's bytes, e.g. 2GiB)")  # fmt: skip
    fixed = {"recompute": Saver.RECOMPUTE, "selective": Saver.RECOMPUTE,
             "host": Saver.HOST}.get(mode)  # fmt: skip
    if mode == "selective":
        _check_attention(stages)
    plan, base = None, [0] * world_size
    if budget is not None:
        assert probe is not None, "a device budget needs a probe to measure the stages on"
        plan, base = _plan(job, stages, probe, budget=budget, world_size=world_size,
                           device=device, fixed=fixed, peer_only=mode == "peer",
                           attention_only=mode == "selective")  # fmt: skip
    _, host = make_tiers(device=device, device_budget=None, host_budget=job.memory.host_budget)
    handles, swaps = [], {}
    forward_weights: dict[int, _ForwardWeights] = {}
    stashes_lent = {item.stage: stripe for item, stripe in _weights(plan, Saver.PEER)
                    if item.stage in mine and stripe is not None}  # fmt: skip
    for s in mine:
        savers: dict[str, Saver] = {}
        lent_to: dict[str, Stripe] = {}
        if plan is not None:
            chosen = [(item.path, saver, plan.stripe(k))
                      for k, (item, (saver, _)) in enumerate(zip(plan.saved, plan.choices, strict=True))
                      if item.stage == s and item.path and saver is not Saver.KEEP]  # fmt: skip
            savers = {path: saver for path, saver, _ in chosen}
            lent_to = {path: stripe for path, _, stripe in chosen if stripe is not None}
        elif mode == "selective":
            savers = {path: Saver.RECOMPUTE for path in _attention_units(stages[s])}
        elif fixed is not None:
            savers = {f"layers.{k}": fixed for k in range(len(stages[s].layers))}
        if lent_to or s in stashes_lent:
            swaps[s] = PeerSwap()
        check_schedule(savers, asynchronous=pipe.asynchronous, stashes=pipe.stashes,
                       schedule=pipe.schedule)  # fmt: skip
        context = None
        if pipe.stashes and Saver.RECOMPUTE in savers.values():
            context = forward_weights.setdefault(s, _ForwardWeights()).context
        if savers:
            handles.append(apply_savers(stages[s], savers, host=host, peer=swaps.get(s),
                                        lenders=lent_to, recompute_context=context))  # fmt: skip
    guard = None
    if budget is not None and not pipe.asynchronous:
        guard = _budget_guard([stages[s] for s in mine], budget=budget, base=base[rank], rank=rank)
    lending, reclaims = None, None
    lenders = _lenders(plan)
    if lenders:
        reclaims = _Reclaims()
        lending = Lending(lenders=lenders, swaps=swaps, on_reclaim=reclaims.add,
                          on_hold=None if guard is None else guard.hold)  # fmt: skip
    on_host = {item.stage for item, _ in _weights(plan, Saver.HOST)}
    return PipelineMemory(mode=mode, plan=plan, handles=handles, guard=guard, budget_bytes=budget,
                          lending=lending, forward_weights=forward_weights, reclaims=reclaims,
                          stashes_on_host=tuple(sorted(on_host & set(mine))),
                          stashes_lent={s: functools.partial(swaps[s].lend, stripe=stripe)
                                        for s, stripe in stashes_lent.items()},
                          host=host)  # fmt: skip


def _weights(plan: SaverPlan | None, saver: Saver) -> list[tuple[Saved, Stripe | None]]:
    """The stashed weight versions ``plan`` gives ``saver``, with their stripes."""
    if plan is None:
        return []
    return [(item, plan.stripe(k)) for k, (item, (chosen, _)) in
            enumerate(zip(plan.saved, plan.choices, strict=True))
            if item.tensor_class is TensorClass.WEIGHTS and chosen is saver]  # fmt: skip


@dataclass(slots=True)
class _Reclaims:
    """This rank's reclaims of lent bytes, and the seconds they waited for them."""

    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds


@dataclass(slots=True)
class _ForwardWeights:
    """A stage's weights, bound once the pipeline is built (:meth:`PipelineMemory.bind`): a
    recompute under a stashing schedule runs on the version its forward used."""

    weights: Any = None

    def context(self) -> contextlib.AbstractContextManager[None]:
        assert self.weights is not None, "a recompute before the stage's weights were bound"
        context: contextlib.AbstractContextManager[None] = self.weights.forward_weights()
        return context


def _lenders(plan: SaverPlan | None) -> dict[int, tuple[int, ...]]:
    """Per stage that lends, the ranks it lends to (the same on every rank)."""
    out: dict[int, set[int]] = {}
    for item, (saver, lender) in zip(plan.saved if plan else (), plan.choices if plan else (),
                                     strict=True):  # fmt: skip
        if saver is Saver.PEER and lender is not None:
            out.setdefault(item.stage, set()).update(lender)
    return {s: tuple(sorted(ranks)) for s, ranks in out.items()}


def _attention_units(stage: PipelineStage) -> list[str]:
    """The attention parts of ``stage``'s blocks, what ``selective`` recomputes."""
    return [path for path, block in stage_units(stage)
            if block >= 0 and unit_class(path) is TensorClass.ATTENTION]  # fmt: skip


def _check_attention(stages: Sequence[PipelineStage]) -> None:
    for s, stage in enumerate(stages):
        if len(stage.layers) and not _attention_units(stage):
            raise ConfigError(
                "pipeline.memory",
                f"'selective' recomputes each block's attention part (a child named attn, "
                f"self_attn or attention), and stage {s}'s blocks have none; use 'recompute' "
                f"(whole blocks) or 'auto'",
            )


def _plan(job: JobConfig, stages: Sequence[PipelineStage], probe: MemoryProbe, *, budget: int,
          world_size: int, device: torch.device, fixed: Saver | None, peer_only: bool,
          attention_only: bool = False) -> tuple[SaverPlan, list[int]]:  # fmt: skip
    pipe = job.pipeline
    pp = job.parallel.pp
    m = job.num_microbatches * job.training.grad_accum_steps  # what the runtime runs a step
    # an asynchronous schedule's steady state: at least 2 x stages microbatches (with an update
    # after every microbatch, stage 0 keeps one per stage in flight)
    steps = max(3, -(-2 * pp // m)) if pipe.asynchronous else 1
    schedule = make_schedule(pipe.schedule, stages=pp, microbatches=m,
                             virtual=pipe.virtual_stages, steps=steps,
                             sync_steps=min(pipe.sync_steps, steps))  # fmt: skip
    sim = simulate(schedule)
    units = measure_units(stages, probe.inputs, probe.targets, probe.block_forward_s)
    weight_bytes = [sum(p.numel() * p.element_size() for p in s.parameters()) for s in stages]
    base = _model_data(job, weight_bytes, schedule.rank_of, world_size=world_size, budget=budget)
    host_budget = resolve_budget(job.memory.host_budget, kind=TierKind.HOST, device=device,
                                 key="memory.host_budget")  # fmt: skip
    # [Note: lending]: one stage per rank, a stage lends to any other rank; with virtual stages,
    # to the ranks with a stage after it
    lends = pipe.memory in ("auto", "peer")
    rates = measure_links(device)  # [Note: measured links] in tidal/train/links.py
    peer = tuple(tuple(rates.peer_bytes_per_s if lends and lender != r else 0.0
                       for lender in range(world_size)) for r in range(world_size))  # fmt: skip
    stage_lenders = tuple(lender_ranks(schedule, s) for s in range(schedule.num_stages))
    links = Links(stage_rank=tuple(schedule.rank_of(s) for s in range(schedule.num_stages)),
                  budget_bytes=(budget,) * world_size, base_bytes=tuple(base),
                  host_link=(0,) * world_size, host_bandwidth=(rates.host_bytes_per_s,),
                  host_budget_bytes=(0 if peer_only else host_budget,),
                  peer_bandwidth=peer, host_prefetch=device.type == "cuda",
                  # one pair's rate measured, not several at once: a rank sends no faster by
                  # striping ([Note: stripes] in tidal/activations/costs.py), only spreads bytes
                  peer_egress=(max(rates.peer_bytes_per_s, 1.0),) * world_size,
                  stage_lenders=stage_lenders)  # fmt: skip
    saved = saved_tensors(sim, units, weight_bytes=weight_bytes)
    if peer_only or (pipe.asynchronous and not pipe.stashes):  # [Note: savers in place]
        saved = [dataclasses.replace(i, recompute_s=None) for i in saved]
    # A stashed weight version is no submodule's save: PipeDream's may wait in the host tier or
    # on a peer ([Note: stashes on the host], [Note: stashes on a peer] in
    # tidal/runtime/weights.py), the others stay where they are.
    saved = [dataclasses.replace(i, fixed=pipe.schedule != "pipedream")
             if i.tensor_class is TensorClass.WEIGHTS else i for i in saved]  # fmt: skip
    if fixed is not None:  # every block (or its attention part) gets the one saver
        if attention_only:
            label = "selective recompute"
            chosen = [i.block >= 0 and not i.fixed and i.tensor_class is TensorClass.ATTENTION
                      for i in saved]  # fmt: skip
        else:
            label, saved = fixed.value, whole_blocks(saved)  # each block as one unit
            chosen = [i.block >= 0 and not i.fixed for i in saved]
        choices: list[Choice] = [(fixed if c else Saver.KEEP, None) for c in chosen]
        plan = evaluate(saved, choices, links, f"every block: {label}")
        if not plan.fits:
            worst = max(range(world_size), key=lambda r: plan.peak_bytes[r] - budget)
            raise ConfigError(
                "memory.device_budget",
                f"with {label} on every block rank {worst} still needs "
                f"{format_bytes(plan.peak_bytes[worst])} over its budget of {format_bytes(budget)};"
                f" set pipeline.memory = 'auto', or raise the budget",
            )
        return plan, base
    kept = keep_all(saved, links)
    if pipe.memory == "none":
        worst = max(range(world_size), key=lambda r: kept.peak_bytes[r] - budget)
        if kept.peak_bytes[worst] > budget:
            raise ConfigError(
                "memory.device_budget",
                f"rank {worst} needs {format_bytes(kept.peak_bytes[worst])} (model data "
                f"{format_bytes(base[worst])} and the activations of its in-flight "
                f"microbatches) over its budget of {format_bytes(budget)}; set "
                f"pipeline.memory = 'auto' to recompute or swap to the host what does not fit, "
                f"or raise the budget",
            )
        return kept, base
    # the exact planner stops at a time limit, so ranks planning alone could pick differently
    agreed = decided_on_main(lambda: plan_savers(saved, links).choices)
    return _runnable(evaluate(saved, list(agreed), links, "auto")), base


def _runnable(plan: SaverPlan) -> SaverPlan:
    """``plan``, whose moved tensors must be what a stage's submodules save, or PipeDream's
    weight versions (a stage's loss has no submodule to move it from)."""
    for item, (saver, _) in zip(plan.saved, plan.choices, strict=True):
        movable = item.path or (
            item.tensor_class is TensorClass.WEIGHTS and saver in (Saver.HOST, Saver.PEER)
        )
        assert saver is Saver.KEEP or movable, f"a saver on {item}, which training cannot move"
    return plan


def _model_data(job: JobConfig, weight_bytes: Sequence[int], rank_of: Callable[[int], int], *,
                world_size: int, budget: int) -> list[int]:  # fmt: skip
    """Each rank's model data: its stages' weights, gradients and optimizer state, which no
    saver moves (checked against the budget for one stage, :func:`_check_model_data`)."""
    per_weight_byte = model_data_per_weight_byte(job)
    base = [0] * world_size
    for s, num_bytes in enumerate(weight_bytes):
        base[rank_of(s)] += per_weight_byte * num_bytes
    _check_model_data(job, base, budget)
    return base


def _check_model_data(job: JobConfig, base: Sequence[int], budget: int) -> None:
    """A model of one plain stage whose model data (weights, gradients, optimizer state) no
    saver can move is over the budget: the chunk engine's case, refused as the reference engine
    refuses it. (A pipeline's refusal names its least budget with every saver: PipeDream's
    stashes can leave the device.)"""
    if len(base) == 1:
        weight_bytes = base[0] // model_data_per_weight_byte(job)
        check_model_data_fits(weight_bytes, budget, optimizer=job.optimizer)


@dataclass(slots=True)
class _Guard:
    """Raises the moment this rank's model data and saved activations would pass its budget;
    records the most they held."""

    budget: int
    base: int
    rank: int
    peak_bytes: int = 0
    live_bytes: int = 0
    held_bytes: int = 0  # what this rank holds for others ([Note: lending])
    peak_held_bytes: int = 0

    def check(self, live_bytes: int) -> None:
        total = self.base + live_bytes + self.held_bytes
        if total > self.budget:
            raise ConfigError(
                "memory.device_budget",
                f"rank {self.rank} would hold {format_bytes(total)} (model data "
                f"{format_bytes(self.base)}, saved activations and what it holds for other ranks"
                f"), over its budget of {format_bytes(self.budget)}; set pipeline.memory = "
                f"'auto' or raise the budget",
            )
        self.live_bytes = live_bytes
        self.peak_bytes = max(self.peak_bytes, total)

    def hold(self, held_bytes: int) -> None:
        self.held_bytes = held_bytes
        self.peak_held_bytes = max(self.peak_held_bytes, held_bytes)
        self.check(self.live_bytes)


def _budget_guard(stages: Sequence[PipelineStage], *, budget: int, base: int, rank: int) -> _Guard:
    """A saved-tensor meter around each of ``stages``' forwards, reporting to a :class:`_Guard`."""
    guard = _Guard(budget=budget, base=base, rank=rank, peak_bytes=base)
    params = {p.untyped_storage()._cdata for s in stages for p in s.parameters()}
    meter = SavedTensorMeter(is_model_storage=params.__contains__, on_change=guard.check)
    for stage in stages:
        around_forward(stage, meter.tracking)
    return guard
