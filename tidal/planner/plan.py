"""A parallel plan as plain data: what the solver chose, what it costs, and its JSON form.

A :class:`Plan` is what ``tidal plan`` prints and writes, what ``tidal.parallel.plan_apply`` carries
out, and what ``tidal train --plan`` reads. It holds no torch objects, so it can be made,
compared and tested anywhere.

[Note: plan layouts]
Every activation between two units has one of four layouts on the tensor axis of the mesh (the
data axis always splits the batch):

- ``R``: replicated, every tensor-axis rank holds the whole ``[B, T, X]`` tensor;
- ``S(seq)``: sharded along the sequence (dim 1), as in Megatron's sequence parallelism;
- ``S(hid)``: sharded along the last dim (hidden, heads or vocabulary);
- ``P``: partial sums, every rank holds a full-size tensor whose sum over the axis is the value
  (a row-parallel linear's output before its all-reduce or reduce-scatter).

A unit's strategy fixes the layout it takes in and the layout it gives out; the edge between two
units pays for converting one to the other (``P -> R`` an all-reduce, ``P -> S`` a
reduce-scatter, ``S -> R`` an all-gather, ``R -> S`` a free slice, ``S -> S'`` an all-to-all).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.config.configurable import require

__all__ = [
    "Layout",
    "MemoryBreakdown",
    "Offload",
    "ChunkBudgets",
    "PipelineLayout",
    "Plan",
    "Recompute",
    "StageChoices",
    "StrategyName",
    "UnitChoice",
]

# 2: pipelined plans (``pipeline``), whose choices are per kind of stage
# 3: each kind of stage its own offload (``pipeline.stages[kind].offload``)
# 4: an interleaved rank's stages all of its kind (``pipeline.kinds``), as the rank was priced
# 5: a stage's model data in tidal's chunks under byte budgets (``chunks``); blocks keeping one
# class of what they save on the host (``swap-attention``, ``swap-mlp``, ``selective+swap-mlp``)
PLAN_FORMAT = 5


class Layout(enum.StrEnum):
    """An activation's placement on the tensor axis; see [Note: plan layouts]."""

    R = "R"
    SEQ = "S(seq)"
    HID = "S(hid)"
    P = "P"


class StrategyName(enum.StrEnum):
    """What a unit does on the tensor axis."""

    REPLICATE = "replicate"  # whole weights, whole activations: every rank computes the same
    SEQUENCE = "sequence"  # token-wise work split along the sequence; weights whole
    COLWISE = "colwise"  # linear, output features split (Megatron's column parallel)
    ROWWISE = "rowwise"  # linear, input features split; partial-sum output
    VOCAB = "vocab"  # embedding table split by vocabulary rows; partial-sum output
    HEADS = "heads"  # attention core, heads split
    HIDDEN = "hidden"  # element-wise work on a hidden-sharded activation


class Recompute(enum.StrEnum):
    """What a repeated block does with the tensors its backward needs: keep them, recompute
    them, or keep them on the host ([Note: activations on the host] in ilp.py), whole or by
    class of tensor ([Note: savers per tensor class] in block_savers.py)."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core only (Megatron's selective)
    FULL = "full"  # keep the block's input, recompute everything in backward
    SWAP = "swap"  # every saved tensor to the host after the forward, back for the backward
    SWAP_ATTENTION = "swap-attention"  # the attention's saved tensors on the host, the rest kept
    SWAP_MLP = "swap-mlp"  # the MLP's on the host, the rest kept
    # the attention core recomputed, the MLP's on the host, the rest kept
    SELECTIVE_SWAP_MLP = "selective+swap-mlp"


@dataclass(kw_only=True, frozen=True, slots=True)
class Offload:
    """What of each device's model data a plan keeps off the device, as fractions ([Note: model
    data offload] in strategies.py). Nested: parameters go to the host only where their
    optimizer state is there too (their update runs there), and the disk takes only offloaded
    optimizer state."""

    optimizer: float = 0.0  # fp32 masters and optimizer state, updated on the host
    params: float = 0.0  # of a ZeRO-3 unit's parameter shard, with its gradient
    nvme: float = 0.0  # of the offloaded optimizer state, on the node's NVMe, not in host memory

    def __post_init__(self) -> None:
        for name in ("optimizer", "params", "nvme"):
            value = getattr(self, name)
            require(
                0 <= value <= 1, f"offload.{name}", f"must be a fraction in [0, 1], got {value}"
            )
        require(
            self.params <= self.optimizer,
            "offload.params",
            f"{self.params} exceeds the optimizer's {self.optimizer}: parameters on the host are "
            "updated there, with their optimizer state; offload at least as much of the optimizer",
        )
        require(
            not self.nvme or self.optimizer > 0,
            "offload.nvme",
            "holds offloaded optimizer state, and none is offloaded",
        )

    def __bool__(self) -> bool:
        return bool(self.optimizer or self.params or self.nvme)

    def describe(self) -> str:
        """``"50% of the optimizer on the host"``, and what else it moves; ``""`` for none."""
        if not self:
            return ""
        parts = [f"{self.optimizer:.0%} of the optimizer on the host"]
        if self.params:
            parts.append(f"{self.params:.0%} of the parameters")
        if self.nvme:
            parts.append(f"{self.nvme:.0%} of that state on NVMe")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: float | dict[str, Any] | None) -> Offload:
        """A plan file's ``offload``: a dict, or one number (the optimizer's fraction, as plans
        wrote it before parameters could be offloaded)."""
        if data is None or isinstance(data, int | float):
            return cls(optimizer=float(data or 0.0))
        return cls(**{f.name: float(data.get(f.name, 0.0)) for f in dataclasses.fields(cls)})


NO_OFFLOAD = Offload()


@dataclass(kw_only=True, frozen=True, slots=True)
class ChunkBudgets:
    """A stage whose model data lives in tidal's chunks, and the budget of each of its devices
    ([Note: chunk stages in plans] in tidal/planner/model_data.py). ``device_bytes``: the chunk
    store's, its chunks, gradients and optimizer state on the device and its activations (the
    stage's predicted peak), of which ``activation_bytes`` are set aside for the activations at
    most (the chunks always get the rest). The host holds the rest of the model data, as the
    plan prices it against the host's memory, except ``nvme_fraction`` of the optimizer's
    state, which the chunks' disk tier keeps on NVMe."""

    device_bytes: int
    activation_bytes: int = 0
    nvme_fraction: float = 0.0

    def __post_init__(self) -> None:
        require(self.device_bytes > 0, "chunks.device_bytes",
                f"must be > 0, got {self.device_bytes}")  # fmt: skip
        require(0 <= self.activation_bytes < self.device_bytes, "chunks.activation_bytes",
                f"must be in [0, device_bytes), got {self.activation_bytes}")  # fmt: skip
        require(0 <= self.nvme_fraction <= 1, "chunks.nvme_fraction",
                f"must be in [0, 1], got {self.nvme_fraction}")  # fmt: skip

    def describe(self) -> str:
        """``"tidal chunks, 40.0 MiB a device"`` (``", 50% of the state on NVMe"``)."""
        disk = f", {self.nvme_fraction:.0%} of the state on NVMe" if self.nvme_fraction else ""
        return f"tidal chunks, {self.device_bytes / 2**20:.1f} MiB a device{disk}"

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ChunkBudgets | None:
        if data is None:
            return None
        return cls(device_bytes=int(data["device_bytes"]),
                   activation_bytes=int(data.get("activation_bytes", 0)),
                   nvme_fraction=float(data.get("nvme_fraction", 0.0)))  # fmt: skip


@dataclass(kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes per device; ``redundant`` is the part above a perfect 1/N split of the same data."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0
    redundant: float = 0.0
    # offloaded model data ([Note: model data offload] in strategies.py): not in the device's total
    host: float = 0.0  # bytes in the node's host memory
    nvme: float = 0.0  # bytes on the node's NVMe
    # activations kept on the mirror stage's device ([Note: activations on a peer] in pipelines.py)
    lent: float = 0.0

    @property
    def resident(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.resident + self.activations + self.transient

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total": self.total}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryBreakdown:
        return cls(**{f.name: float(data.get(f.name, 0.0)) for f in dataclasses.fields(cls)})


@dataclass(kw_only=True, slots=True)
class UnitChoice:
    """One decision unit and what the plan does with it.

    ``module`` is the unit's module path with ``*`` for the index of a repeated block
    (``blocks.*.attn.qkv``); ``segment`` is ``None`` for a leaf module and ``k`` for the k-th run
    of a module's own operations between its children (``blocks.*`` segment 1 is the first
    residual add). ``count`` is how many times the unit occurs (the number of blocks).
    """

    name: str
    module: str
    segment: int | None
    kind: str
    strategy: StrategyName
    in_layout: Layout
    out_layout: Layout
    zero: int
    count: int
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    time_s: float = 0.0
    ops: tuple[str, ...] = ()  # a segment's first few ops (``add``), which name it for a reader

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ops": list(self.ops),
            "module": self.module,
            "segment": self.segment,
            "kind": self.kind,
            "strategy": str(self.strategy),
            "in_layout": str(self.in_layout),
            "out_layout": str(self.out_layout),
            "zero": self.zero,
            "count": self.count,
            "memory": self.memory.to_dict(),
            "time_s": self.time_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UnitChoice:
        return cls(
            name=data["name"],
            module=data["module"],
            segment=data["segment"],
            kind=data["kind"],
            strategy=StrategyName(data["strategy"]),
            in_layout=Layout(data["in_layout"]),
            out_layout=Layout(data["out_layout"]),
            zero=int(data["zero"]),
            count=int(data["count"]),
            memory=MemoryBreakdown.from_dict(data.get("memory", {})),
            time_s=float(data.get("time_s", 0.0)),
            ops=tuple(data.get("ops", ())),
        )


def _units_to_json(units: list[UnitChoice]) -> list[dict[str, Any]]:
    return [u.to_dict() for u in units]


@dataclass(kw_only=True, slots=True)
class StageChoices:
    """What a kind of pipeline stage does ([Note: pipeline stages] in pipelines.py): its
    units' choices as its own ILP made them, its recomputation, the model data it keeps off
    the device ([Note: offload per stage] in pipelines.py), and its cost-model figures.
    ``blocks`` is how many of the repeated block the kind was solved with on one rank (its
    block units' ``count``); ``chunks``: its model data in tidal's chunks under those budgets
    instead of FSDP2's units ([Note: chunk stages in plans] in model_data.py)."""

    kind: str  # "first", "last" or "middle"
    blocks: int
    units: list[UnitChoice]
    recompute: dict[str, Recompute]
    memory: MemoryBreakdown
    step_time_s: float
    offload: Offload = NO_OFFLOAD
    chunks: ChunkBudgets | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "blocks": self.blocks, "units": _units_to_json(self.units),
                "recompute": {k: str(v) for k, v in self.recompute.items()},
                "memory": self.memory.to_dict(), "step_time_s": self.step_time_s,
                "offload": self.offload.to_dict(),
                "chunks": None if self.chunks is None else self.chunks.to_dict()}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageChoices:
        return cls(kind=str(data["kind"]), blocks=int(data["blocks"]),
                   units=[UnitChoice.from_dict(u) for u in data["units"]],
                   recompute={k: Recompute(v) for k, v in data["recompute"].items()},
                   memory=MemoryBreakdown.from_dict(data["memory"]),
                   step_time_s=float(data["step_time_s"]),
                   offload=Offload.from_json(data["offload"]),
                   chunks=ChunkBudgets.from_json(data.get("chunks")))  # fmt: skip


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """A pipelined plan's stages: ``pp`` ranks of ``dp x tp`` each under ``schedule`` with
    ``virtual_stages`` model chunks a rank; stage ``s`` (of ``pp * virtual_stages``, on rank
    ``s % pp``) holds the model's blocks ``block_ranges[s]`` and takes the choices of kind
    ``kinds[s]``, its rank's: a rank's chunks together were priced as one stage of the search
    ([Note: plan pipelines])."""

    pp: int
    virtual_stages: int
    schedule: str
    block_ranges: tuple[tuple[int, int], ...]
    kinds: tuple[str, ...]
    stages: dict[str, StageChoices]
    send_s: float = 0.0  # the cost model's sends between stages over a step

    def __post_init__(self) -> None:
        assert len(self.block_ranges) == len(self.kinds) == self.pp * self.virtual_stages
        assert set(self.kinds) <= set(self.stages), (self.kinds, list(self.stages))
        assert all(k == self.kinds[s % self.pp] for s, k in enumerate(self.kinds)), self.kinds

    @property
    def num_stages(self) -> int:
        return len(self.block_ranges)

    def rank_kind(self, rank: int) -> str:
        """The kind pipeline rank ``rank`` was priced as, every one of its stages'."""
        return self.kinds[rank]

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "virtual_stages": self.virtual_stages, "schedule": self.schedule,
                "block_ranges": [list(r) for r in self.block_ranges], "kinds": list(self.kinds),
                "stages": {k: c.to_dict() for k, c in self.stages.items()},
                "send_s": self.send_s}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineLayout:
        return cls(pp=int(data["pp"]), virtual_stages=int(data["virtual_stages"]),
                   schedule=str(data["schedule"]),
                   block_ranges=tuple((int(a), int(b)) for a, b in data["block_ranges"]),
                   kinds=tuple(str(k) for k in data["kinds"]),
                   stages={k: StageChoices.from_dict(c) for k, c in data["stages"].items()},
                   send_s=float(data.get("send_s", 0.0)))  # fmt: skip


@dataclass(kw_only=True, slots=True)
class Plan:
    """A whole plan: mesh, per-unit choices, recomputation, and the cost model's figures.

    [Note: plan pipelines]
    A pipelined plan (``pipeline`` set) runs ``pp`` stages of ``dp x tp`` ranks each, ``devices
    = pp x dp x tp``. Its ``units``, ``recompute`` and ``edges`` are the first stage's (what a
    reader sees first), ``memory`` is the stage with the highest peak's, ``step_time_s`` the
    pipeline's, ``offload`` the first stage's; each kind of stage has its own choices, offload
    included (``pipeline.stages``). Stage ``s`` is
    :meth:`stage_plan`: a flat plan of ``dp x tp`` over its own blocks, which
    ``tidal train --plan`` realises on that stage alone ([Note: planned pipeline stages] in
    tidal/train/plan_stage.py). ``num_microbatches`` is a step's, each of ``micro_batch`` rows
    per data-parallel rank.
    """

    model: str
    devices: int
    dp: int
    tp: int
    micro_batch: int
    seq_len: int
    num_microbatches: int
    units: list[UnitChoice]
    recompute: dict[str, Recompute]
    memory: MemoryBreakdown
    step_time_s: float
    edges: list[tuple[str, str, int]] = field(default_factory=list)
    # the model data kept off the device ([Note: model data offload] in strategies.py), which
    # `tidal train --plan` keeps there (planner.check.offload_runs); a pipeline's stages each
    # their own (rank_offload)
    offload: Offload = NO_OFFLOAD
    pipeline: PipelineLayout | None = None  # [Note: plan pipelines]
    # the model data in tidal's chunks under these budgets, not FSDP2's units ([Note: chunk
    # stages in plans] in model_data.py); a pipeline's stages each their own (rank_chunks)
    chunks: ChunkBudgets | None = None
    # the bytes of an activation's element its model was traced with (2: bf16), which its
    # activation figures assume: a run in fp32 holds twice them (plan_stage warns)
    activation_element_bytes: int = 2

    @property
    def pp(self) -> int:
        return 1 if self.pipeline is None else self.pipeline.pp

    @property
    def mesh_name(self) -> str:
        """``"dp 2 x tp 2"``, ``"pp 2 x dp 1 x tp 2"``: the mesh it runs on, for a reader."""
        mesh = f"dp {self.dp} x tp {self.tp}"
        return mesh if self.pipeline is None else f"pp {self.pp} x {mesh}"

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total

    def rank_memory(self, pp_rank: int) -> MemoryBreakdown:
        """What the cost model says a device of pipeline rank ``pp_rank`` holds: its kind's
        figures ([Note: plan pipelines]); the plan's for a flat plan."""
        if self.pipeline is None:
            return self.memory
        return self.pipeline.stages[self.pipeline.rank_kind(pp_rank)].memory

    def rank_offload(self, pp_rank: int) -> Offload:
        """What of its model data a device of pipeline rank ``pp_rank`` keeps off the device:
        its kind's, for every stage the rank holds, as it was priced; the plan's when flat."""
        if self.pipeline is None:
            return self.offload
        return self.pipeline.stages[self.pipeline.rank_kind(pp_rank)].offload

    def rank_chunks(self, pp_rank: int) -> ChunkBudgets | None:
        """Whether a device of pipeline rank ``pp_rank`` holds its stages' model data in chunks,
        and under what budgets: its kind's ([Note: chunk stages in plans] in model_data.py)."""
        if self.pipeline is None:
            return self.chunks
        return self.pipeline.stages[self.pipeline.rank_kind(pp_rank)].chunks

    def offloads(self) -> list[Offload]:
        """Each pipeline rank's offload (the plan's alone when flat)."""
        return [self.rank_offload(r) for r in range(self.pp)]

    def describe_offload(self) -> str:
        """What the plan keeps off its devices, for a reader: one offload, or each kind of
        stage's where they differ; ``""`` for none."""
        offloads = set(self.offloads())
        if len(offloads) == 1 or self.pipeline is None:
            return offloads.pop().describe()
        return "; ".join(f"{kind} stage: {c.offload.describe() or 'all on the device'}"
                         for kind, c in self.pipeline.stages.items())  # fmt: skip

    def stage_plan(self, stage: int) -> Plan:
        """The flat plan stage ``stage`` realises ([Note: plan pipelines]): its kind's choices
        and offload (its rank's: a rank's model chunks are priced as one stage), each block unit
        counted as often as the stage holds blocks, the units outside the blocks only on the
        first and the last stage (the embeddings, the head)."""
        layout = self.pipeline
        if layout is None:
            assert stage == 0, "a flat plan is one stage"
            return self
        choices = layout.stages[layout.kinds[stage]]  # its rank's, as it was priced
        start, end = layout.block_ranges[stage]
        ends = stage in (0, layout.num_stages - 1)
        units = [dataclasses.replace(u, count=end - start) if "*" in u.module else u
                 for u in choices.units if "*" in u.module or ends]  # fmt: skip
        return Plan(model=self.model, devices=self.dp * self.tp, dp=self.dp, tp=self.tp,
                    micro_batch=self.micro_batch, seq_len=self.seq_len,
                    num_microbatches=self.num_microbatches, units=units,
                    recompute=dict(choices.recompute), memory=choices.memory,
                    step_time_s=choices.step_time_s,
                    offload=choices.offload, chunks=choices.chunks,
                    activation_element_bytes=self.activation_element_bytes)  # fmt: skip

    def unit(self, name: str) -> UnitChoice:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"the plan has no unit {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "model": self.model,
            "devices": self.devices,
            "mesh": {"pp": self.pp, "dp": self.dp, "tp": self.tp},
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "num_microbatches": self.num_microbatches,
            "peak_memory_bytes": self.peak_memory_bytes,
            "step_time_s": self.step_time_s,
            "memory": self.memory.to_dict(),
            "recompute": {k: str(v) for k, v in self.recompute.items()},
            "units": [u.to_dict() for u in self.units],
            "edges": [list(e) for e in self.edges],
            "offload": self.offload.to_dict(),
            "chunks": None if self.chunks is None else self.chunks.to_dict(),
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
            "activation_element_bytes": self.activation_element_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(
                f"the plan is format {data.get('format')!r}, written by another version of "
                f"tidal; this one reads format {PLAN_FORMAT}: make the plan again with this "
                f"version's `tidal plan`"
            )
        return cls(
            model=data["model"],
            devices=int(data["devices"]),
            dp=int(data["mesh"]["dp"]),
            tp=int(data["mesh"]["tp"]),
            micro_batch=int(data["micro_batch"]),
            seq_len=int(data["seq_len"]),
            num_microbatches=int(data["num_microbatches"]),
            units=[UnitChoice.from_dict(u) for u in data["units"]],
            recompute={k: Recompute(v) for k, v in data["recompute"].items()},
            memory=MemoryBreakdown.from_dict(data["memory"]),
            step_time_s=float(data["step_time_s"]),
            edges=[(str(a), str(b), int(n)) for a, b, n in data.get("edges", [])],
            offload=Offload.from_json(data.get("offload")),
            chunks=ChunkBudgets.from_json(data.get("chunks")),
            activation_element_bytes=int(data.get("activation_element_bytes", 2)),
            pipeline=None
            if data.get("pipeline") is None
            else PipelineLayout.from_dict(data["pipeline"]),
        )

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        Path(path).write_text(json.dumps({**self.to_dict(), **(extra or {})}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))
