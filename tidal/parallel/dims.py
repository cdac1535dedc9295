"""One mesh for every parallelism: ``[parallel] pp, dp, tp`` and the ``DeviceMesh`` built from it.

[Note: one mesh]
A run's ranks form one ``pp x dp x tp`` grid, tensor parallelism innermost (its ranks are
neighbours: on a GPU machine, the ones joined by the fastest links), the pipeline outermost
(it sends least). Rank ``r`` sits at ``(r // (dp * tp), r // tp % dp, r % tp)``. Every process
group of a run is a slice of that grid: the pipeline's group is ``mesh["pp"]`` (the ranks that
hold the stages of one replica), ZeRO's and the gradient reduction's is ``mesh["dp"]`` (the
replicas of one stage), the tensor group ``mesh["tp"]``. No component builds a group of its own,
so no two can disagree about who their peers are. ``[parallel]`` is the one place the shape is
said: ``pipeline.stages`` of older recipes is read as ``parallel.pp`` (tidal/train/job.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config import ConfigError, require

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIMS", "ParallelConfig", "ParallelDims", "parse_mesh"]

MESH_DIMS = ("pp", "dp", "tp")  # outermost first ([Note: one mesh])


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How a run's ranks are shared out ([Note: one mesh]).

    Attributes:
        pp: pipeline stages, one rank each (``interleaved`` puts several model chunks on each).
        dp: data-parallel replicas of each stage; ``None`` means the ranks left over, ``N //
            (pp * tp)``. With ``engine = 'chunk'`` the replicas shard their chunks (ZeRO-3).
        tp: tensor-parallel ranks per stage (from a plan's wiring: ``tidal train --plan``).
        fsdp2: in a pipeline of the reference engine, shard each stage over its ``dp``
            replicas with FSDP2 (``fully_shard``, [Note: FSDP2 stages] in
            tidal/runtime/fsdp_stage.py) instead of replicating it.
        fsdp2_offload: FSDP2 stages keep their shards, gradients and optimizer step on the
            host (``CPUOffloadPolicy``), fetched to the device for each use; with ``dp = 1``
            a stage is offloaded without being sharded.
    """

    pp: int = 1
    dp: int | None = None
    tp: int = 1
    fsdp2: bool = False
    fsdp2_offload: bool = False

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            require(value is None or value >= 1, name, f"must be >= 1, got {value}")
        require(not self.fsdp2_offload or self.fsdp2, "fsdp2_offload",
                "offloads FSDP2 stages; set parallel.fsdp2 = true too")  # fmt: skip

    def resolve(self, world_size: int) -> ParallelDims:
        """The mesh for ``world_size`` ranks; a shape that does not multiply to it is refused
        in one line that names both."""
        fixed = self.pp * self.tp
        dp = self.dp if self.dp is not None else max(1, world_size // fixed)
        dims = ParallelDims(pp=self.pp, dp=dp, tp=self.tp)
        if dims.world_size != world_size:
            raise ConfigError(
                "parallel",
                f"{dims} needs {dims.world_size} ranks, but {world_size} were started; start "
                f"{dims.world_size} (tidal train --nproc {dims.world_size}) or change the mesh",
            )
        return dims


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelDims:
    """A resolved ``pp x dp x tp`` grid ([Note: one mesh])."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __str__(self) -> str:
        return " x ".join(f"{name}{getattr(self, name)}" for name in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` coordinates of ``rank``."""
        assert 0 <= rank < self.world_size, (rank, self)
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, dim: str) -> list[list[int]]:
        """The ranks of every group along ``dim`` (what ``mesh[dim]`` holds on each rank)."""
        require(dim in MESH_DIMS, "dim", f"one of {', '.join(MESH_DIMS)}, got {dim!r}")
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [d for d in MESH_DIMS if d != dim]
        groups = []
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                ranks = []
                for i in range(sizes[dim]):
                    at = dict(zip(others, (a, b), strict=True)) | {dim: i}
                    ranks.append(self.rank_at(at["pp"], at["dp"], at["tp"]))
                groups.append(ranks)
        return groups

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The run's one ``DeviceMesh`` (every rank calls it: it creates the groups)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)


def parse_mesh(text: str) -> dict[str, int]:
    """``pp=2,dp=2`` -> ``{"pp": 2, "dp": 2}``; a wrong part is refused naming it."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_DIMS or not value.strip().isdigit():
            raise ConfigError(
                "--mesh",
                f"{part!r} is not NAME=N with NAME one of {', '.join(MESH_DIMS)} (e.g. "
                "--mesh pp=2,dp=2)",
            )
        if name in out:
            raise ConfigError("--mesh", f"{name} is given twice in {text!r}")
        out[name] = int(value)
        require(out[name] >= 1, f"--mesh {name}", f"must be >= 1, got {out[name]}")
    if not out:
        raise ConfigError("--mesh", "is empty; give e.g. --mesh pp=2,dp=2")
    return out
