"""Model, part one: the candidate strategies of each unit on a mesh, and what each costs.

A :class:`Candidate` is one (strategy, ZeRO level) choice for one occurrence of a unit, with its
layouts ([Note: plan layouts] in plan.py) and its cost coefficients: bytes per device by kind,
seconds of compute and of communication per micro-batch, and seconds of gradient
synchronisation per step. Everything here is linear in the choice, which is what lets the ILP
add it up; what couples neighbouring units (resharding) is in cost_model.py.

[Note: sharded fractions]
What a device holds of a unit's data under a strategy, on a tensor axis of ``t`` ranks and a
data axis of ``d`` ranks:

- parameters: ``1/t`` of a tensor-split weight (uneven splits of a vocabulary round up), then
  ZeRO on the data axis divides optimizer state (level >= 1), gradients (>= 2) and parameters
  (3) by ``d``;
- saved activations: a saved input is split as the unit's input layout (``1/t`` unless ``R``); its
  own outputs and internal tensors are split as its work (``1/t`` unless it replicates the work,
  or produces partial sums, which are full-size);
- compute: ``1/t`` of the FLOPs and bytes unless the work is replicated.

[Note: ZeRO as executed]
ZeRO levels are priced as tidal carries them out (parallel/plan_apply.py), which is FSDP2 on the data
axis: level 3 keeps ``1/d`` of the weights and gathers each unit's in turn; levels 1 and 2 keep
``1/d`` too but gather them all in the first forward and hold them until the step's last backward
(``fully_shard`` without resharding after forward), so ``1 + 1/d`` copies are alive at the peak
where DeepSpeed would hold one. Level 2 reduce-scatters gradients after every micro-batch and
keeps ``1/d`` of them; level 1 accumulates whole gradients and reduce-scatters once per step
(``apply.set_accumulating`` between micro-batches). Optimizer state is ``1/d`` from level 1 on.

[Note: model data offload]
A plan may keep part of each device's model data off the device (``TrainingSpec.offload``, an
:class:`~tidal.planner.plan.Offload` of three fractions), as ZeRO-Offload / ZeRO-Infinity and
FSDP2's ``CPUOffloadPolicy`` do (PatrickStar places the same data by chunk). Per unit, with
``s`` the parameters whose update this device owns (``1/t`` of a split weight, ``1/d`` of that
from ZeRO level 1 on), ``m`` micro-batches a step and ``n`` devices on the node:

- ``optimizer = f``: ``f s`` of the fp32 masters and optimizer state live on the host and are
  updated there by the node's CPUs. Device ``(1 - f) s * optimizer_bytes``, host ``f s *
  optimizer_bytes``. Where gradients are sharded (ZeRO >= 2) the gradients of those ``f s``
  parameters go to the host as each micro-batch reduces them and stay there (host ``f s *
  grad_bytes``, device the rest); below ZeRO 2 whole gradients stay on the device until the step
  reduces them, and then ``f s`` of them go down once;
- ``params = g`` (``g <= f``: such parameters are updated on the host), ZeRO-3 units only: ``g``
  of the device's parameter shard lives on the host (host ``g s * param_bytes``), copied up for
  the gathers of every forward and backward, ``2 m g s * param_bytes`` a step; its update
  stays on the host, so the weights that go back up after the step are ``(f - g) s``;
- ``nvme = h``: ``h`` of the offloaded optimizer state is on the node's NVMe instead of in host
  memory (``h f s * optimizer_bytes``), read and written once a step by the node's drives, which
  all ``n`` devices share: ``2 n h f s * optimizer_bytes / nvme_bandwidth``.

Host and NVMe bytes count against each device's share of its node's (an ILP row each). Added
to the step, with no overlap (DeepSpeed overlaps part of the copies with the backward, so this
is the slower side): the copies over the device's own host link, ``(grads down + weights up +
parameters up) / host_link_bandwidth``, the node's CPU Adam, ``f s * n /
host_adam_params_per_s``, and the disk's time. The fractions are one figure each for the whole
plan, searched over ``PlannerConfig.offloads()``.

What runs (``check_plan``'s ``offload_runs``): ``tidal train --plan`` updates ``f`` of each
device's optimizer on the host and keeps ``h`` of that on NVMe at any fractions, on one device
or many ([Note: the optimizer on the host] in tidal/runtime/host_optimizer.py), and carries out
``params = g`` as FSDP2's ``CPUOffloadPolicy`` on the groups (a block's repetition, the root's)
whose parameters come nearest ``g`` of them, which holds ZeRO-3 units only; so with parameters
offloaded every unit with parameters is offered ZeRO-3 alone, and the search prices what runs.
On one device too: ZeRO-3 over a data axis of one rank is FSDP2 on a mesh of one, which gathers
nothing but copies its host-held parameters up for every use, as the pricing says. The runtime
moves whole groups where the pricing moves ``g`` of each unit: the same bytes within a group's,
placed per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tidal.config.configurable import require
from tidal.planner.cluster import Axis, ClusterSpec, Collective, Mesh, collective_s
from tidal.planner.measure import ModelGraph, Unit
from tidal.planner.plan import NO_OFFLOAD, Layout, MemoryBreakdown, Offload, StrategyName
from tidal.planner.wiring import input_layouts

PLANNED_ZERO_LEVELS = (0, 1, 2, 3)

__all__ = [
    "PLANNED_ZERO_LEVELS",
    "Candidate",
    "TrainingSpec",
    "candidates",
    "indivisible",
    "unit_options",
    "valid_tensor_sizes",
]

S = StrategyName


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainingSpec:
    """Bytes per parameter of each kind of model data, and the step's size in micro-batches.

    The defaults are mixed-precision Adam as in the ZeRO paper: 2-byte weights and gradients,
    12 bytes of fp32 master weights and two moments (``16 * params`` in all)."""

    num_microbatches: int = 1
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    # A pipeline stage ([Note: pipeline stages] in pipelines.py) holds the activations of
    # ``in_flight`` micro-batches at once, and its per-micro-batch work lies ``time_slots``
    # times on the step's critical path (None: ``num_microbatches``, no pipeline).
    in_flight: float = 1.0
    time_slots: float | None = None
    # weight-sized copies held besides the live weights (PipeMare's delta, 1), and one more
    # built for a unit's backward (its corrected weights) while it runs
    weight_copies: float = 0.0
    # the schedule versions the weights in place (PipeMare): every unit's parameters whole on
    # each data rank (ZeRO-0) and nothing recomputed ([Note: PipeMare plans] in pipelines.py)
    versioned_weights: bool = False
    # every stage's model data in tidal's chunks where they can hold it (``--model-data
    # chunks``): a unit with parameters on a data axis of one tensor rank is ZeRO-3, as a chunk
    # stage shards it ([Note: chunk stages in plans] in model_data.py)
    chunked_weights: bool = False
    # the model data kept off the device ([Note: model data offload])
    offload: Offload = NO_OFFLOAD
    # the first of ``peer_stages`` pipeline stages may keep activations on its mirror (the
    # last) stage's device, which holds ``mirror_in_flight`` micro-batches, over a link of
    # ``peer_bandwidth`` bytes/s each way ([Note: activations on a peer] in pipelines.py); 0: none
    peer_stages: int = 0
    mirror_in_flight: float = 0.0
    peer_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        require(
            self.num_microbatches >= 1,
            "num_microbatches",
            f"must be >= 1, got {self.num_microbatches}",
        )
        require(self.in_flight >= 1, "in_flight", f"must be >= 1, got {self.in_flight}")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(self.weight_copies >= 0, "weight_copies", f"must be >= 0, got {self.weight_copies}")
        require(self.peer_stages == 0 or (self.peer_stages >= 2 and self.peer_bandwidth > 0),
                "peer_stages", f"a peer needs 2 or more stages and a link, got "
                f"{self.peer_stages} stages at {self.peer_bandwidth} B/s")  # fmt: skip
        require(self.peer_stages == 0 or 0 < self.mirror_in_flight <= self.in_flight,
                "mirror_in_flight", f"the mirror holds fewer micro-batches than the stage that "
                f"lends to it ({self.in_flight}), and some: got {self.mirror_in_flight}")  # fmt: skip

    @property
    def in_flight_step(self) -> float:
        """How many fewer micro-batches each next stage holds, when this one lends ([Note:
        activations on a peer] in pipelines.py): in-flight counts fall linearly to the
        mirror's."""
        return (self.in_flight - self.mirror_in_flight) / (self.peer_stages - 1)

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def slots(self) -> float:
        """How many times a micro-batch's work counts in the step time."""
        return self.num_microbatches if self.time_slots is None else self.time_slots


@dataclass(kw_only=True, frozen=True, slots=True)
class Candidate:
    """One choice for a unit: layouts, ZeRO level and costs per occurrence."""

    strategy: StrategyName
    in_layout: Layout
    out_layout: Layout
    in_grad: Layout  # layout of the gradient it returns for its input
    zero: int
    placements: tuple[str, ...]  # per own parameter: "R", "S0" or "S1" on the tensor axis
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    selective_activations: float = 0.0  # activations when its attention core is recomputed
    compute_s: float = 0.0  # forward + backward, per micro-batch
    comm_s: float = 0.0  # its own collectives, per micro-batch
    sync_s: float = 0.0  # gradient and parameter collectives per step
    forward_s: float = 0.0  # what recomputing it costs, per micro-batch


@dataclass(frozen=True, slots=True)
class _Shape:
    strategy: StrategyName
    in_layout: Layout
    out_layout: Layout
    in_grad: Layout
    weight_split: str  # "R", "S0" (output rows / vocabulary) or "S1" (input columns)
    work_split: bool  # its own tensors and FLOPs are split by t
    gather_input: bool = False  # colwise on a sequence-split input: all-gathers it itself


_LINEAR = (
    _Shape(S.REPLICATE, Layout.R, Layout.R, Layout.R, "R", False),
    _Shape(S.SEQUENCE, Layout.SEQ, Layout.SEQ, Layout.SEQ, "R", True),
    _Shape(S.COLWISE, Layout.R, Layout.HID, Layout.P, "S0", True),
    _Shape(S.COLWISE, Layout.SEQ, Layout.HID, Layout.SEQ, "S0", True, gather_input=True),
    _Shape(S.ROWWISE, Layout.HID, Layout.P, Layout.HID, "S1", True),
)
_EMBEDDING = (
    _Shape(S.REPLICATE, Layout.R, Layout.R, Layout.R, "R", False),
    _Shape(S.SEQUENCE, Layout.SEQ, Layout.SEQ, Layout.SEQ, "R", True),
    _Shape(S.VOCAB, Layout.R, Layout.P, Layout.R, "S0", False),
)
_NORM = (
    _Shape(S.REPLICATE, Layout.R, Layout.R, Layout.R, "R", False),
    _Shape(S.SEQUENCE, Layout.SEQ, Layout.SEQ, Layout.SEQ, "R", True),
)
_ELEMENTWISE = (*_NORM, _Shape(S.HIDDEN, Layout.HID, Layout.HID, Layout.HID, "R", True))
_ATTENTION = (
    _Shape(S.REPLICATE, Layout.R, Layout.R, Layout.R, "R", False),
    _Shape(S.HEADS, Layout.HID, Layout.HID, Layout.HID, "R", True),
)
_LOSS = _ELEMENTWISE  # S(hid) is the vocabulary-parallel loss
_SHAPES = {
    "linear": _LINEAR,
    "embedding": _EMBEDDING,
    "norm": _NORM,
    "elementwise": _ELEMENTWISE,
    "attention": _ATTENTION,
    "loss": _LOSS,
}


def valid_tensor_sizes(units: list[Unit], devices: int, devices_per_node: int) -> list[int]:
    """Tensor-axis sizes that divide every attention unit's heads and every non-vocabulary
    feature dimension, and fit in a node."""
    sizes = []
    for t in range(1, min(devices, devices_per_node) + 1):
        if devices % t:
            continue
        if all(_divides(u, t) for u in units):
            sizes.append(t)
    return sizes


def indivisible(units: list[Unit], t: int) -> str | None:
    """What keeps a tensor axis of ``t`` from splitting ``units``, in words; None if nothing."""
    for unit in units:
        if _divides(unit, t):
            continue
        if unit.kind == "attention":
            return f"{unit.name!r} has {unit.heads} heads and {unit.kv_heads} key/value heads"
        return f"{unit.name!r} has {unit.in_features} inputs and {unit.out_features} outputs"
    return None


def _divides(unit: Unit, t: int) -> bool:
    if unit.kind == "attention":
        return all(h % t == 0 for h in (unit.heads or 1, unit.kv_heads or 1))
    if unit.kind == "linear" and any(p.tied_to for p in unit.params):
        return True  # a tied LM head splits a vocabulary, which may split unevenly
    if unit.kind == "linear":
        return (unit.in_features or 1) % t == 0 and (unit.out_features or 1) % t == 0
    return True


def _split_fraction(unit: Unit, split: str, t: int) -> float:
    if split == "R" or t == 1:
        return 1.0
    if unit.kind == "embedding" or (unit.kind == "linear" and split == "S0"):
        n = unit.out_features or t  # rows may be a vocabulary: round the split up
        return math.ceil(n / t) / n
    return 1.0 / t


def candidates(
    unit: Unit,
    mesh: Mesh,
    cluster: ClusterSpec,
    spec: TrainingSpec,
    *,
    zero_levels: tuple[int, ...] = PLANNED_ZERO_LEVELS,
) -> list[Candidate]:
    """Every choice for ``unit`` on ``mesh`` with its costs; see [Note: sharded fractions]."""
    t = mesh.tp
    shapes = _SHAPES[unit.kind] if t > 1 else _SHAPES[unit.kind][:1]
    if unit.kind == "attention" and not _divides(unit, t):
        shapes = shapes[:1]
    if unit.kind == "linear" and any(p.tied_to for p in unit.params):
        shapes = tuple(s for s in shapes if s.weight_split != "S1")
    own_params = any(p.tied_to is None for p in unit.params)
    # one device's ZeRO-3 is its parameters on the host ([Note: model data offload])
    sharded = mesh.dp > 1 or spec.offload.params > 0
    zeros = zero_levels if own_params and sharded else (0,)
    return [_cost(unit, shape, z, mesh, cluster, spec) for shape in shapes for z in zeros]


def unit_options(
    graph: ModelGraph, mesh: Mesh, cluster: ClusterSpec, spec: TrainingSpec
) -> dict[str, list[Candidate]]:
    """Every unit's candidates, less the input layouts its model cannot give it: units that
    must keep the sequence whole ([Note: code counts whole sequences] in wiring.py); under the
    offload that runs, ZeRO-3 alone ([Note: model data offload]), and so in chunks on a data
    axis ([Note: chunk stages in plans] in model_data.py); under PipeMare, ZeRO-0 alone
    ([Note: PipeMare plans] in pipelines.py)."""
    allowed = input_layouts(graph)
    chunked = spec.chunked_weights and mesh.tp == 1 and mesh.dp > 1 and not spec.versioned_weights
    zero3_only = spec.offload.params > 0 or chunked
    options = {}
    for unit in graph.units:
        found = candidates(unit, mesh, cluster, spec)
        if unit.name in allowed:
            found = [c for c in found if c.in_layout in allowed[unit.name]]
        if zero3_only and any(p.tied_to is None for p in unit.params):
            found = [c for c in found if c.zero == 3]
        if spec.versioned_weights:  # [Note: PipeMare plans] in pipelines.py
            found = [c for c in found if c.zero == 0]
        options[unit.name] = found
    return options


def _cost(
    unit: Unit, shape: _Shape, zero: int, mesh: Mesh, cluster: ClusterSpec, spec: TrainingSpec
) -> Candidate:
    t, d = mesh.tp, mesh.dp
    weight_fraction = _split_fraction(unit, shape.weight_split, t)
    n_params = unit.num_params * weight_fraction  # elements this device is responsible for
    params = n_params * spec.param_bytes * _param_copies(zero, d)
    weight_copies = params * spec.weight_copies  # copies of what this device holds
    grads = n_params * spec.grad_bytes / (d if zero >= 2 else 1)
    owned = n_params / (d if zero >= 1 else 1)  # parameters whose update this device runs
    # [Note: model data offload]: parameters updated on the host, and those whose weights stay
    updated, on_host = _offloaded(spec.offload, owned, zero)
    host_params = on_host * spec.param_bytes
    host_grads = updated * spec.grad_bytes if zero >= 2 else 0.0
    host_state = updated * spec.optimizer_bytes
    params += weight_copies - host_params
    grads -= host_grads
    optimizer = owned * spec.optimizer_bytes - host_state
    work = 1.0 / t if shape.work_split else 1.0
    in_fraction = 1.0 if shape.in_layout is Layout.R else 1.0 / t
    own_fraction = 1.0 if shape.out_layout is Layout.P else work
    activations = (
        unit.saved_input_bytes * in_fraction
        + (unit.saved_output_bytes + unit.saved_internal_bytes) * own_fraction
    )
    selective = activations - unit.saved_internal_bytes * own_fraction
    transient = weight_copies  # the corrected weights a backward builds
    if zero >= 3:  # the gathered weights in use plus the next ones prefetched
        transient += 2 * n_params * spec.param_bytes
    if zero >= 2:  # a whole gradient before it is reduce-scattered
        transient += n_params * spec.grad_bytes
    if shape.out_layout is Layout.P:  # the full-size partial output before its reduction
        transient += unit.out_bytes
    in_bytes = unit.out_bytes if unit.kind != "linear" else _input_bytes(unit)
    if shape.gather_input:
        transient += in_bytes
    memory = MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        transient=transient,
        host=host_params + host_grads + host_state * (1 - spec.offload.nvme),
        nvme=host_state * spec.offload.nvme,
    )
    ideal = unit.num_params * spec.state_bytes / mesh.devices + unit.saved_bytes / t
    memory.redundant = max(0.0, memory.resident + memory.activations - ideal)
    forward_s = _compute_s(unit, work, cluster)
    comm_s = _own_comm_s(unit, shape, in_bytes, mesh, cluster)
    sync_s = _sync_s(unit, shape, n_params, zero, mesh, cluster, spec)
    sync_s += _offload_s(updated, on_host, zero, cluster, spec)
    return Candidate(
        strategy=shape.strategy,
        in_layout=shape.in_layout,
        out_layout=shape.out_layout,
        in_grad=shape.in_grad,
        zero=zero,
        placements=tuple(shape.weight_split for p in unit.params),
        memory=memory,
        selective_activations=selective if unit.kind == "attention" else activations,
        compute_s=3 * forward_s,
        comm_s=comm_s,
        sync_s=sync_s,
        forward_s=forward_s + (comm_s / 3 if shape.gather_input else 0.0),
    )


def _offloaded(offload: Offload, owned: float, zero: int) -> tuple[float, float]:
    """Of ``owned`` parameters, those updated on the host and those whose weights stay there
    (ZeRO-3 units only); see [Note: model data offload]."""
    return owned * offload.optimizer, (owned * offload.params if zero >= 3 else 0.0)


def _offload_s(
    updated: float, on_host: float, zero: int, cluster: ClusterSpec, spec: TrainingSpec
) -> float:
    """The step's added seconds for ``updated`` parameters updated on the host, ``on_host`` of
    them kept there ([Note: model data offload]): copies over the host link, the node's CPU
    Adam, the disk."""
    if not updated:
        return 0.0
    m, n = spec.num_microbatches, cluster.devices_on_node
    copied = (
        updated * spec.grad_bytes * (m if zero >= 2 else 1)  # gradients down
        + (updated - on_host) * spec.param_bytes  # updated weights up
        + 2 * m * on_host * spec.param_bytes  # the shard up for every gather
    )
    disk = 2 * n * updated * spec.offload.nvme * spec.optimizer_bytes / cluster.nvme_bandwidth
    return (
        copied / cluster.host_link_bandwidth + updated * n / cluster.host_adam_params_per_s + disk
    )


def _param_copies(zero: int, d: int) -> float:
    """Parameter bytes held per weight byte under a ZeRO level; see [Note: ZeRO as executed]."""
    if zero >= 3:
        return 1.0 / d
    if zero in (1, 2) and d > 1:
        return 1.0 + 1.0 / d
    return 1.0


def _input_bytes(unit: Unit) -> float:
    """A linear's input activation, from its output and its feature sizes."""
    if unit.in_features and unit.out_features:
        return unit.out_bytes * unit.in_features / unit.out_features
    return unit.out_bytes


def _compute_s(unit: Unit, work: float, cluster: ClusterSpec) -> float:
    flops_s = unit.flops * work / (cluster.peak_flops * cluster.flops_efficiency)
    bytes_s = unit.io_bytes * work / (cluster.memory_bandwidth * cluster.bandwidth_efficiency)
    return max(flops_s, bytes_s)


def _own_comm_s(
    unit: Unit, shape: _Shape, in_bytes: float, mesh: Mesh, cluster: ClusterSpec
) -> float:
    def tp(kind: Collective, nbytes: float) -> float:
        return collective_s(kind, nbytes, mesh, Axis.TENSOR, cluster)

    if shape.gather_input:  # forward all-gather, backward reduce-scatter and re-gather
        return 2 * tp(Collective.ALL_GATHER, in_bytes) + tp(Collective.REDUCE_SCATTER, in_bytes)
    if unit.kind == "loss" and shape.in_layout is Layout.HID:
        # the vocabulary-parallel softmax: max, sum of exponentials and the target's logit, fp32
        rows = unit.out_bytes / 4 if unit.out_bytes else 0.0
        return 3 * tp(Collective.ALL_REDUCE, 4 * max(rows, 1.0))
    return 0.0


def _sync_s(
    unit: Unit,
    shape: _Shape,
    n_params: float,
    zero: int,
    mesh: Mesh,
    cluster: ClusterSpec,
    spec: TrainingSpec,
) -> float:
    """Gradient reduction and parameter gathers over the data axis, per step."""
    if n_params == 0:
        return 0.0
    m = spec.num_microbatches
    grad_b, param_b = n_params * spec.grad_bytes, n_params * spec.param_bytes

    def dp(kind: Collective, nbytes: float) -> float:
        return collective_s(kind, nbytes, mesh, Axis.DATA, cluster)

    if zero == 0:
        seconds = dp(Collective.ALL_REDUCE, grad_b)
    elif zero == 1:
        seconds = dp(Collective.REDUCE_SCATTER, grad_b) + dp(Collective.ALL_GATHER, param_b)
    elif zero == 2:  # sharded gradients must be reduced after every micro-batch
        seconds = m * dp(Collective.REDUCE_SCATTER, grad_b) + dp(Collective.ALL_GATHER, param_b)
    else:  # and sharded weights gathered for every forward and backward
        seconds = m * (
            dp(Collective.REDUCE_SCATTER, grad_b) + 2 * dp(Collective.ALL_GATHER, param_b)
        )
    if shape.weight_split == "R" and shape.work_split:
        # whole weights over split tokens: their gradients are partial on the tensor axis too
        seconds += collective_s(Collective.ALL_REDUCE, grad_b, mesh, Axis.TENSOR, cluster)
    return seconds
