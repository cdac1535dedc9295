"""Megatron-LM at its real configuration: (tensor x pipeline x data) meshes, sequence parallelism,
selective or full recompute, the distributed optimizer, interleaved stages and the micro-batch,
searched over the whole grid and priced by the planner's cluster rules.

The layout baselines of baselines.py are Megatron's *intra-operator* layouts on the planner's own
``dp x tp`` mesh (the seed paper's comparison). A practitioner runs Megatron with pipeline stages
and its distributed optimizer; this module is that configuration, so the planner's claims can be
measured against the strongest one. It is analytic (no trace): the shapes of a GPT-like decoder
are all it needs, and every figure is a formula a reader can redo by hand (docs/planner.md).

[Note: Megatron's memory]
Per device, on the most loaded rank (the first pipeline stage), the sum of:

- weights and optimizer: Megatron's own estimator (``theoretical_memory_usage``): the
  transformer layers' ``P_t = 2 L h^2 ((1 + g/a) + (f/h) x)`` weights split over the tensor
  ranks (``g`` query groups of ``a`` heads, ``x`` = 3/2 for a gated MLP, else 1) and ``P_r = 4 L
  h + 2 h`` LayerNorm weights whole on each, the most loaded shard ``(P_t / p + V h) / t + P_r /
  p`` (plus ``V h / t`` for an untied head when ``p = 1``), times 18 bytes per parameter (bf16
  weights, fp32 gradients, fp32 masters and two moments), or ``6 + 12 / d`` with the
  distributed optimizer;
- activations: the estimator's formula for sequence parallelism with selective recompute
  (Korthikanti et al. 2022, Table 2): ``s b h (18 + 4 f / h)`` per layer times ``L`` (``L / p``
  layers a stage, ``p`` micro-batches in flight), plus ``8 s b p`` (the embedding's input) and
  ``s b h p`` (its dropout mask), times the interleaved schedule's ``1 + (p - 1) / (p v)``, or
  ``min(1, m / p)`` without interleaving, plus ``4 s b h (1 + V / h)`` (the head and the loss)
  when ``p = 1``, all over ``t``. Without sequence parallelism, its second formula: ``s b h (10
  + 24 / t)`` a layer (``10 + (8 + 4 f / h) / t`` here, for any MLP width), the embedding's ``8 s
  b p + s b h p`` whole, the same factor, ``2 s b (V / t + h)`` when ``p = 1``, and 5% more for
  temporaries. The estimator has no full recompute (it counts what selective recompute keeps);
  here full recompute keeps its first formula's structure with a layer's ``2 s b h`` input
  (split by ``t`` under sequence parallelism) in place of the layer's terms, and brings one
  layer's activations back during its backward (a transient the estimator has no term for).

[Note: Megatron's step time]
With the planner's cluster rules (matmul FLOPs at ``peak x flops_efficiency``, element-wise
bytes at ``bandwidth x bandwidth_efficiency``, alpha-beta ring collectives, no overlap of
communication with compute, as in cost_model.py): a layer's forward is ``2 s b h (h + 2 h g / a)
+ 4 s^2 b h + 2 s b h^2 + 2 s b h f (2, or 3 gated)`` FLOPs, its backward twice that, plus the
attention core's ``4 s^2 b h`` again under selective recompute or the whole forward again under
full recompute, all over ``t``. Its memory-bound kernels, as Megatron fuses them, move in the
forward ``22 s b h`` bytes outside the tensor-parallel regions (two LayerNorms reading and
writing 2 bytes an element, two bias-dropout-adds reading two inputs and writing an output and a
mask: 4 + 4 + 7 + 7; over ``t`` with sequence parallelism), ``4 s b f / t`` in the bias-GeLU
(``6 s b f / t`` gated: two inputs), and without flash attention ``9 a s^2 b / t`` on the
attention scores (the fused softmax reads and writes them, dropout reads, writes and keeps a
mask); the backward moves twice the forward's bytes (each kernel reads its saved input and the
incoming gradient and writes a gradient), a recompute the recomputed part's once more. Its
tensor-parallel collectives on the ``2 s b h`` activations are 4 all-reduces (6 with full
recompute) or, with sequence parallelism, 6 all-gathers and 4 reduce-scatters (8 and 6). The
last stage adds the head's ``2 s b h V`` x 3 FLOPs over ``t``. A stage's micro-batch time ``T`` is its layers plus the heavier end (the head)
plus its send and receive of ``2 s b h / t`` bytes each way to the next stage (``v`` of them
interleaved); the pipeline takes ``(m + (p - 1) / v) T``; the gradients' collectives over the
data axis follow, an all-reduce of fp32 gradients, or with the distributed optimizer a
reduce-scatter of them and an all-gather of the bf16 weights. Stages are the outermost axis
(Megatron's rank order), so data-parallel ranks share a node while ``t d`` fits in one.

[Note: Megatron's optimizer offload]
Megatron-Core offloads a fraction ``f`` of the distributed optimizer's fp32 state to the CPU and
updates it there (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``: its
``HybridDeviceOptimizer``). Priced as tidal's ([Note: model data offload] in strategies.py): the
device keeps ``6 + 12 (1 - f) / d`` bytes a parameter, the host ``12 f / d`` within the device's
share of its node's memory; a step adds the ``f / d`` share's fp32 gradients down and bf16
weights up over the host link and the node's CPU Adam over it, with no overlap (Megatron
overlaps part of the copies, so this is its slower side, as it is tidal's). The grid searches it
only where asked (``offloads``), with the distributed optimizer.

[Note: Megatron's activation offload]
Megatron-Core also moves activations to the host (``--fine-grained-activation-offloading
--offload-modules ...``, with pipelines and interleaving, beside selective recompute): a
layer's saved inputs go down after its forward and come back before its backward, on their own
stream. Priced as tidal's host swap ([Note: activations on the host] in ilp.py), with every
module a layer saves offloaded: the device keeps none of its layers' activations but two
layers' worth per micro-batch as a transient (one in use, the next coming back), the host the
layers' terms of the activation formula within the device's share of its node's memory, and
each layer adds per micro-batch only what its copies (``2 x`` its saved bytes over the host
link) take beyond its own forward and backward. The grid searches it only where tidal's search
has its host swap (``activation_offloads``), with selective recompute.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from tidal.config.configurable import require
from tidal.planner.cluster import Axis, ClusterSpec, Collective, Mesh, collective_s
from tidal.planner.plan import Recompute

__all__ = [
    "MegatronBest",
    "MegatronConfig",
    "MegatronMemory",
    "MegatronRow",
    "TransformerShape",
    "megatron_best",
    "megatron_flops_per_step",
    "megatron_grid",
    "megatron_memory",
    "megatron_step_s",
]

_ACT_BYTES = 2  # bf16 activations and weights


@dataclass(kw_only=True, frozen=True, slots=True)
class TransformerShape:
    """A GPT-like decoder's sizes: what Megatron's formulas read. ``vocab``: before Megatron pads
    it to a multiple of ``128 t``; ``query_groups``: None for as many as heads."""

    num_layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    vocab: int
    tied: bool = True
    query_groups: int | None = None
    gated: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "ffn", "seq_len", "vocab"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")

    @property
    def groups(self) -> int:
        return self.heads if self.query_groups is None else self.query_groups

    def padded_vocab(self, tp: int) -> int:
        """Megatron's ``--make-vocab-size-divisible-by 128``, times the tensor-parallel size."""
        multiple = 128 * tp
        return -(-self.vocab // multiple) * multiple

    def layer_params(self) -> tuple[float, float]:
        """Megatron's estimator's parameter count of the transformer layers: (split over the
        tensor-parallel ranks: attention and MLP weights; whole on each: the LayerNorms, the
        final one included)."""
        L, h = self.num_layers, self.hidden
        mlp = self.ffn / h * (1.5 if self.gated else 1.0)
        return 2 * L * h * h * ((1 + self.groups / self.heads) + mlp), 4 * L * h + 2 * h


@dataclass(kw_only=True, frozen=True, slots=True)
class MegatronConfig:
    """One point of Megatron's grid: ``tp x pp x dp`` devices, ``vp`` model chunks per pipeline
    rank (1: not interleaved), ``num_microbatches`` of ``micro_batch`` sequences per step."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    sequence_parallel: bool = True
    recompute: Recompute = Recompute.SELECTIVE
    distributed_optimizer: bool = True
    vp: int = 1
    optimizer_offload: float = 0.0  # [Note: Megatron's optimizer offload]
    activation_offload: bool = False  # [Note: Megatron's activation offload]
    # Megatron-Core's fused attention never writes the scores; the published A100 runs of
    # 2021-22 (fused softmax) did ([Note: Megatron's step time])
    flash_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "num_microbatches", "vp"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.recompute is not Recompute.NONE, "recompute",
                "Megatron's grid is selective or full recompute (with fused attention no "
                "recompute keeps what selective keeps)")  # fmt: skip
        require(not self.sequence_parallel or self.tp > 1, "sequence_parallel", "needs tp > 1")
        require(0 <= self.optimizer_offload <= 1 and (self.distributed_optimizer
                or not self.optimizer_offload), "optimizer_offload",
                "is a fraction in [0, 1] of the distributed optimizer's state")  # fmt: skip
        require(not self.activation_offload or self.recompute is Recompute.SELECTIVE,
                "activation_offload", "is searched beside selective recompute")  # fmt: skip

    @property
    def name(self) -> str:
        parts = [
            f"t{self.tp} p{self.pp} d{self.dp}",
            f"mb{self.micro_batch} x{self.num_microbatches}",
        ]
        if self.vp > 1:
            parts.append(f"v{self.vp}")
        parts.append("sp" if self.sequence_parallel else "no-sp")
        parts.append(f"{self.recompute} recompute")
        parts.append("dist-opt" if self.distributed_optimizer else "ddp")
        if self.optimizer_offload:
            parts.append(f"{self.optimizer_offload:.0%} optimizer on the CPU")
        if self.activation_offload:
            parts.append("activations on the CPU")
        if not self.flash_attention:
            parts.append("softmax attention")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, object]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vp": self.vp,
                "micro_batch": self.micro_batch, "num_microbatches": self.num_microbatches,
                "sequence_parallel": self.sequence_parallel, "recompute": str(self.recompute),
                "distributed_optimizer": self.distributed_optimizer,
                "optimizer_offload": self.optimizer_offload,
                "activation_offload": self.activation_offload,
                "flash_attention": self.flash_attention}  # fmt: skip


@dataclass(kw_only=True, frozen=True, slots=True)
class MegatronMemory:
    """Bytes on the most loaded device; see [Note: Megatron's memory]."""

    weights_and_optimizer: float
    activations: float
    transient: float
    # optimizer state and activations on the host ([Note: Megatron's optimizer offload],
    # [Note: Megatron's activation offload])
    host: float = 0.0

    @property
    def estimator_bytes(self) -> float:
        """What Megatron's ``theoretical_memory_usage`` reports (no transient term)."""
        return self.weights_and_optimizer + self.activations

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations + self.transient


def megatron_memory(shape: TransformerShape, c: MegatronConfig) -> MegatronMemory:
    """Per-device peak of ``c``; see [Note: Megatron's memory]."""
    shard, f = _shard_params(shape, c), c.optimizer_offload
    per_param = 6 + 12 * (1 - f) / c.dp if c.distributed_optimizer else 18
    activations = _activation_bytes(shape, c)
    transient = _layer_bytes(shape, c) if c.recompute is Recompute.FULL else 0.0
    host = shard * 12 * f / c.dp
    if c.activation_offload:  # [Note: Megatron's activation offload]
        on_host = _activation_bytes(shape, c) - _activation_bytes(shape, c, layers=False)
        activations -= on_host
        host += on_host
        transient = 2 * _layer_bytes(shape, c)
    return MegatronMemory(weights_and_optimizer=shard * per_param, activations=activations,
                          transient=transient, host=host)  # fmt: skip


def _shard_params(shape: TransformerShape, c: MegatronConfig) -> float:
    """Parameters on the most loaded rank, by the estimator: its stage's layers and the
    embedding over ``t`` (an untied head too on a single stage)."""
    embedding = shape.hidden * shape.padded_vocab(c.tp)
    split, whole = shape.layer_params()
    shard = (split / c.pp + embedding) / c.tp + whole / c.pp
    if not shape.tied and c.pp == 1:
        shard += embedding / c.tp
    return shard


def _layer_bytes(shape: TransformerShape, c: MegatronConfig) -> float:
    """One layer's saved activations per micro-batch on one device, without full recompute."""
    sbh = shape.seq_len * c.micro_batch * shape.hidden
    outside = c.tp if c.sequence_parallel else 1  # what only sequence parallelism splits
    return sbh * (10 / outside + (8 + 4 * shape.ffn / shape.hidden) / c.tp)


def _activation_bytes(shape: TransformerShape, c: MegatronConfig, *, layers: bool = True) -> float:
    """Megatron's estimator's activation formulas, extended to full recompute as [Note:
    Megatron's memory] says; written in its order (the schedule's factor applies to the
    embedding terms too). ``layers=False``: without the layers' terms."""
    s, b, h, t, p = shape.seq_len, c.micro_batch, shape.hidden, c.tp, c.pp
    V = shape.padded_vocab(t)
    outside = t if c.sequence_parallel else 1
    full = c.recompute is Recompute.FULL
    layer = (2 * s * b * h / outside if full else _layer_bytes(shape, c)) if layers else 0.0
    if c.sequence_parallel or full:
        total = layer * shape.num_layers + 8 * s * b * p / t + s * b * h * p / outside
        total *= _schedule_factor(c)
        if p == 1:
            total += 4 * s * b * h / outside + 4 * s * b * V / t
        return total
    # its formula without sequence parallelism (selective recompute)
    total = layer * shape.num_layers + 8 * s * b * p + s * b * h * p
    total *= _schedule_factor(c)
    if p == 1:
        total += 2 * (s * b * V / t + s * b * h)
    return total * 1.05


def _schedule_factor(c: MegatronConfig) -> float:
    """The estimator's in-flight factor: ``1 + (p - 1) / (p v)`` interleaved, else ``min(1, m /
    p)`` for a pipeline (``p`` micro-batches' worth of layers are counted already)."""
    if c.vp > 1:
        return 1 + (c.pp - 1) / (c.pp * c.vp)
    return min(1.0, c.num_microbatches / c.pp) if c.pp > 1 else 1.0


def _layer_forward_flops(shape: TransformerShape, b: int) -> tuple[float, float]:
    """(the whole layer's, the attention core's) forward FLOPs for ``b`` sequences."""
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    qkv = 2 * s * b * h * (h + 2 * h * shape.groups / a)
    core = 4 * s * s * b * h
    mlp = 2 * s * b * h * shape.ffn * (3 if shape.gated else 2)
    return qkv + core + 2 * s * b * h * h + mlp, core


def _layer_memory_bound_bytes(shape: TransformerShape, c: MegatronConfig) -> float:
    """Bytes a layer's fused element-wise kernels move per micro-batch on one device, forward,
    backward and recompute; see [Note: Megatron's step time]."""
    s, b, h, t = shape.seq_len, c.micro_batch, shape.hidden, c.tp
    outside = t if c.sequence_parallel else 1
    forward = s * b * (22 * h / outside + (6 if shape.gated else 4) * shape.ffn / t)
    scores = 0.0 if c.flash_attention else 9 * shape.heads * s * s * b / t
    full = c.recompute is Recompute.FULL
    return (3 + full) * forward + 4 * scores  # selective recompute redoes the scores


def megatron_step_s(shape: TransformerShape, c: MegatronConfig, cluster: ClusterSpec) -> float:
    """Seconds per step of ``c`` on ``cluster``; see [Note: Megatron's step time]."""
    s, b, h, t, p = shape.seq_len, c.micro_batch, shape.hidden, c.tp, c.pp
    rate = cluster.peak_flops * cluster.flops_efficiency
    mesh = Mesh(dp=c.dp, tp=t)
    activation = _ACT_BYTES * s * b * h

    def tp(kind: Collective, times: int) -> float:
        return times * collective_s(kind, activation, mesh, Axis.TENSOR, cluster)

    forward, core = _layer_forward_flops(shape, b)
    again = forward if c.recompute is Recompute.FULL else core
    full = c.recompute is Recompute.FULL
    if c.sequence_parallel:
        comm = tp(Collective.ALL_GATHER, 8 if full else 6)
        comm += tp(Collective.REDUCE_SCATTER, 6 if full else 4)
    else:
        comm = tp(Collective.ALL_REDUCE, 6 if full else 4)
    layer_s = (3 * forward + again) / t / rate + comm
    layer_s += _layer_memory_bound_bytes(shape, c) / (
        cluster.memory_bandwidth * cluster.bandwidth_efficiency
    )
    if c.activation_offload:  # what the copies take beyond the layer's own work
        layer_s += max(0.0, 2 * _layer_bytes(shape, c) / cluster.host_link_bandwidth - layer_s)
    head_s = 3 * 2 * s * b * h * shape.padded_vocab(t) / t / rate
    stage_s = shape.num_layers / p * layer_s + head_s
    if p > 1:
        stage_s += c.vp * 2 * _p2p_s(activation / t, c, cluster)
    pipeline_s = (c.num_microbatches + (p - 1) / c.vp) * stage_s
    return pipeline_s + _data_sync_s(shape, c, mesh, cluster)


def _p2p_s(nbytes: float, c: MegatronConfig, cluster: ClusterSpec) -> float:
    """One send to the next stage: within a node while the whole mesh fits in one."""
    same_node = c.tp * c.dp * c.pp <= cluster.devices_per_node
    if same_node:
        return cluster.intra_node_latency_s + nbytes / cluster.intra_node_bandwidth
    return cluster.inter_node_latency_s + nbytes / cluster.inter_node_bandwidth


def _data_sync_s(
    shape: TransformerShape, c: MegatronConfig, mesh: Mesh, cluster: ClusterSpec
) -> float:
    params = _shard_params(shape, c)

    def dp(kind: Collective, nbytes: float) -> float:
        return collective_s(kind, nbytes, mesh, Axis.DATA, cluster)

    if c.distributed_optimizer:
        seconds = dp(Collective.REDUCE_SCATTER, 4 * params) + dp(Collective.ALL_GATHER, 2 * params)
        hosted = params * c.optimizer_offload / c.dp  # [Note: Megatron's optimizer offload]
        seconds += hosted * 6 / cluster.host_link_bandwidth
        return seconds + hosted * cluster.devices_on_node / cluster.host_adam_params_per_s
    return dp(Collective.ALL_REDUCE, 4 * params)


def megatron_flops_per_step(
    shape: TransformerShape, global_batch: int, *, full_recompute: bool
) -> float:
    """The FLOPs per step Megatron's papers count (Narayanan et al. 2021, eq. 3, generalised to
    any MLP width): ``(3 or 4) x forward`` of every layer plus three times the head's logits."""
    forward, _ = _layer_forward_flops(shape, global_batch)
    passes = 4 if full_recompute else 3
    head = 3 * 2 * shape.seq_len * global_batch * shape.hidden * shape.vocab
    return passes * forward * shape.num_layers + head


@dataclass(kw_only=True, frozen=True, slots=True)
class MegatronRow:
    config: MegatronConfig
    memory: MegatronMemory
    step_time_s: float

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _configs(shape: TransformerShape, cluster: ClusterSpec, global_batch: int,
             micro_batches: tuple[int, ...], offloads: tuple[float, ...] = (0.0,),
             activation_offloads: tuple[bool, ...] = (False,)) -> Iterator[MegatronConfig]:  # fmt: skip
    n = cluster.devices
    for t in _divisors(min(n, cluster.devices_per_node)):
        if shape.heads % t or shape.groups % t or shape.ffn % t or n % t:
            continue
        for p in _divisors(n // t):
            if shape.num_layers % p:
                continue
            d = n // (t * p)
            for mb in micro_batches:
                if global_batch % (d * mb):
                    continue
                m = global_batch // (d * mb)
                vps = [1] + [
                    v for v in _divisors(shape.num_layers // p)[1:] if p > 1 and m % p == 0
                ]
                for vp in vps:
                    for sp in (False, True) if t > 1 else (False,):
                        for recompute, moved in _recomputes(activation_offloads):
                            for dist_opt, f in _optimizers(d, offloads):
                                yield MegatronConfig(
                                    tp=t, pp=p, dp=d, micro_batch=mb, num_microbatches=m,
                                    sequence_parallel=sp, recompute=recompute,
                                    distributed_optimizer=dist_opt, vp=vp, optimizer_offload=f,
                                    activation_offload=moved,
                                )  # fmt: skip


def _recomputes(activation_offloads: tuple[bool, ...]) -> Iterator[tuple[Recompute, bool]]:
    """(recompute, activations on the host) pairs: selective recompute with each of
    ``activation_offloads``, full recompute keeping them ([Note: Megatron's activation
    offload])."""
    for moved in activation_offloads:
        yield Recompute.SELECTIVE, moved
    yield Recompute.FULL, False


def _optimizers(d: int, offloads: tuple[float, ...]) -> Iterator[tuple[bool, float]]:
    """(distributed optimizer, fraction on the CPU) pairs: plain data parallel, and the
    distributed optimizer with each offload fraction; over one data-parallel rank it changes
    nothing unless it offloads (Megatron-Core's CPU offload runs inside it)."""
    yield False, 0.0
    for f in offloads:
        if d > 1 or f > 0:
            yield True, f


def megatron_grid(shape: TransformerShape, cluster: ClusterSpec, *, global_batch: int,
                  micro_batches: tuple[int, ...] = (1, 2, 4, 8),
                  offloads: tuple[float, ...] = (0.0,),
                  activation_offloads: tuple[bool, ...] = (False,)) -> list[MegatronRow]:  # fmt: skip
    """Every configuration Megatron-LM accepts for ``shape`` on ``cluster`` with ``global_batch``
    sequences a step: ``t`` within a node dividing heads, groups and the MLP; ``p`` dividing the
    layers; interleaving when the micro-batches divide by ``p``; with the distributed optimizer,
    each fraction of ``offloads`` on the CPU whose state fits the host ([Note: Megatron's
    optimizer offload]); with selective recompute, activations on the host or not, each of
    ``activation_offloads`` whose bytes fit it ([Note: Megatron's activation offload])."""
    rows = [
        MegatronRow(
            config=c,
            memory=megatron_memory(shape, c),
            step_time_s=megatron_step_s(shape, c, cluster),
        )  # fmt: skip
        for c in _configs(
            shape, cluster, global_batch, micro_batches, offloads, activation_offloads
        )
    ]
    return [r for r in rows if r.memory.host <= cluster.host_bytes_per_device]


@dataclass(kw_only=True, frozen=True, slots=True)
class MegatronBest:
    """Megatron's fastest configuration that fits, its least-memory one (fitting or not), and
    its memory-time frontier (no configuration both faster and smaller)."""

    fastest: MegatronRow | None
    least_memory: MegatronRow
    num_configs: int
    frontier: tuple[MegatronRow, ...] = ()


def megatron_best(rows: list[MegatronRow], device_memory_bytes: float) -> MegatronBest:
    require(
        bool(rows), "global_batch", "no Megatron configuration splits this batch over the devices"
    )
    fits = [r for r in rows if r.peak_memory_bytes <= device_memory_bytes]
    fastest = min(fits, key=lambda r: (r.step_time_s, r.peak_memory_bytes)) if fits else None
    least = min(rows, key=lambda r: (r.peak_memory_bytes, r.step_time_s))
    assert math.isfinite(least.peak_memory_bytes)
    frontier, smallest = [], math.inf
    for row in sorted(rows, key=lambda r: (r.step_time_s, r.peak_memory_bytes)):
        if row.peak_memory_bytes < smallest:
            frontier.append(row)
            smallest = row.peak_memory_bytes
    return MegatronBest(fastest=fastest, least_memory=least, num_configs=len(rows),
                        frontier=tuple(frontier))  # fmt: skip
