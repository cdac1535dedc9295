"""What a search covers: :class:`PlannerConfig`, read by search.py, the command line and the
benches."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tidal.config.configurable import require
from tidal.planner.baselines import BASELINES
from tidal.planner.model_data import MODEL_DATA
from tidal.planner.pipelines import SCHEDULES
from tidal.planner.plan import Offload, Recompute
from tidal.planner.stage_split import SPLITS

__all__ = ["PARETO_EPS", "PlannerConfig"]

PARETO_EPS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(kw_only=True, frozen=True, slots=True)
class PlannerConfig:
    objective: str = "memory"  # or "time"
    eps: float = 0.05  # memory objective: allowed slowdown over the fastest plan
    global_batch: int | None = None  # sequences per step; default one per device
    tp: int | None = None  # force the tensor-parallel size
    # force the pipeline size: 1 flat plans only, p > 1 pipelined plans of p stages only
    # ([Note: the chosen plan] in search.py); None searches both
    pp: int | None = None
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    pareto: tuple[float, ...] = PARETO_EPS  # eps values of the memory-time frontier; () skips
    baselines: tuple[str, ...] = tuple(BASELINES)  # names in baselines.BASELINES
    solver_time_limit_s: float = 60.0
    # blocks' recomputation modes to choose from; a model whose attention core cannot be
    # recomputed alone (a Hugging Face one) leaves out selective
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    # also search pipeline stages ([Note: pipeline stages] in pipelines.py), the better of the
    # two plans chosen ([Note: the chosen plan] in search.py)
    pipelines: bool = True
    # eps values of the pipelined plans' frontier (each a search over every option); () skips
    pipeline_pareto: tuple[float, ...] = ()
    # the pipeline schedules searched; "pipemare" (asynchronous) is opt-in
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    # model data searched off the device ([Note: model data offload] in strategies.py), as
    # fractions: of the optimizer state on the host, of a ZeRO-3 unit's parameters there (at
    # most the optimizer's), and of the offloaded state on the node's NVMe (the cluster's
    # disk); every combination is searched (offloads()), and `tidal train --plan` runs each
    # (planner.check.offload_runs); (0.0,) keeps it all on the device
    offload: tuple[float, ...] = (0.0,)
    offload_params: tuple[float, ...] = (0.0,)
    offload_nvme: tuple[float, ...] = (0.0,)
    # pipelined plans' first stages may keep activations on their mirror stages' devices
    # ([Note: activations on a peer] in pipelines.py); priced, not run
    peer: bool = False
    # how pipelined plans split the blocks into stages ([Note: stage splits] in stage_split.py)
    stage_splits: tuple[str, ...] = ("even",)
    # pipelined plans' micro-batch sizes, the graph's scaled to each ([Note: micro-batch
    # scaling] in graph.py); () keeps the traced one
    micro_batches: tuple[int, ...] = ()
    # which transform holds each stage's model data, FSDP2's units or tidal's chunks, chosen
    # after the search ([Note: chunk stages in plans] in model_data.py): "auto", "fsdp2" or
    # "chunks"; FSDP2 by default, the faster of the two where both were measured (bench
    # plan-check --ranks: 1.05 s against 1.64 s a step on 4 gloo ranks)
    model_data: str = "fsdp2"

    def __post_init__(self) -> None:
        require(
            self.objective in ("memory", "time"),
            "objective",
            f"must be 'memory' or 'time', got {self.objective!r}",
        )
        require(self.eps >= 0, "eps", f"must be >= 0, got {self.eps}")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            require(value >= 0, name, f"bytes per parameter, so >= 0 (2, 2 and 12 for mixed-"
                    f"precision Adam), got {value}")  # fmt: skip
        unknown = sorted(set(self.baselines) - set(BASELINES))
        require(not unknown, "baselines", f"unknown {unknown}; choose from {', '.join(BASELINES)}")
        if self.global_batch is not None:
            require(
                self.global_batch >= 1, "global_batch", f"must be >= 1, got {self.global_batch}"
            )
        require(self.pp is None or self.pp >= 1, "pp", f"must be >= 1, got {self.pp}")
        require(self.pp in (None, 1) or self.pipelines, "pp",
                f"asks for {self.pp} pipeline stages, and pipelines are not searched")  # fmt: skip
        unknown = sorted(set(self.schedules) - set(SCHEDULES))
        require(not unknown, "schedules", f"unknown {unknown}; choose from {', '.join(SCHEDULES)}")
        unknown = sorted(set(self.stage_splits) - set(SPLITS))
        require(bool(self.stage_splits) and not unknown, "stage_splits",
                f"must be some of {', '.join(SPLITS)}, got {self.stage_splits!r}")  # fmt: skip
        require(self.model_data in MODEL_DATA, "model_data",
                f"must be one of {', '.join(MODEL_DATA)}, got {self.model_data!r}")  # fmt: skip
        require(all(b >= 1 for b in self.micro_batches), "micro_batches",
                f"must be sizes >= 1, got {self.micro_batches!r}")  # fmt: skip
        for name in ("offload", "offload_params", "offload_nvme"):
            fractions = getattr(self, name)
            require(
                bool(fractions) and all(0 <= f <= 1 for f in fractions),
                name,
                f"must be fractions in [0, 1], got {fractions!r}",
            )
        require(
            bool(self.offloads()),
            "offload_params",
            f"each of {self.offload_params} exceeds every optimizer fraction {self.offload}: "
            "parameters go to the host only with their optimizer state; add 0",
        )
        require(
            bool(self.recompute) and all(isinstance(m, Recompute) for m in self.recompute),
            "recompute",
            f"must be some of {', '.join(Recompute)}, got {self.recompute!r}",
        )

    def offloads(self) -> tuple[Offload, ...]:
        """Every combination of the three fractions that [Note: model data offload] allows."""
        found = [
            Offload(optimizer=f, params=g, nvme=h)
            for f, g, h in itertools.product(self.offload, self.offload_params, self.offload_nvme)
            if g <= f and (f > 0 or h == 0)
        ]
        return tuple(dict.fromkeys(found))
