"""What ``tidal bench dp`` runs (:class:`DpSettings`) and how it runs one configuration.

The sections build on this module: perf and scale in :mod:`benchmarks.dp`, nvme in
:mod:`benchmarks.dp_nvme`, which :mod:`benchmarks.dp` runs; so both import it, and neither the
other's internals.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.dp_systems import DP_SYSTEMS, run_case
from tidal.config import require
from tidal.models import closed_form_num_params
from tidal.testing import RankFailure, run_on_ranks
from tidal.train.job import JobConfig, find_recipe, load_job

__all__ = [
    "MODEL_DATA_BYTES_PER_PARAM",
    "SCALE_STEPS",
    "SECTIONS",
    "DpSettings",
    "fixed_overrides",
    "num_params_at_depth",
    "per_rank_memory",
    "recipe_job",
    "run_configuration",
    "scale_overrides",
    "teardown_figures",
]

SECTIONS = ("perf", "scale", "nvme")
SCALE_STEPS = 2
SCALE_SEQ_LEN = 64
# AdamW model data per parameter in fp32: weight, gradient and two moments.
MODEL_DATA_BYTES_PER_PARAM = 16

_FIXED = ("training.device=cpu",)
_UNLIMITED = ("memory.device_budget=none", "memory.host_budget=none")
# Probes train briefly: one sequence per rank, synthetic tokens, no checkpoints or validation.
_SCALE_OVERRIDES = (
    "data.source=synthetic", "training.grad_accum_steps=1", "training.precision=fp32",
    f"model.seq_len={SCALE_SEQ_LEN}", f"training.steps={SCALE_STEPS}",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DpSettings:
    """What ``tidal bench dp`` runs; ``overrides`` apply to every configuration.

    The scale section runs on ``max(nprocs)`` ranks, once per per-rank host budget, with
    ``bisections`` probes after the doubling. tidal is given ``tidal_device_fraction`` of a budget
    as its device tier (gathered chunks and activations) and the rest, less what the rank held
    before building the model, as its host tier. ``timeout_s`` bounds one configuration.
    """

    sections: tuple[str, ...] = SECTIONS
    recipe: str = "demo"
    systems: tuple[str, ...] = DP_SYSTEMS
    nprocs: tuple[int, ...] = (1, 2)
    steps: int = 10
    warmup_steps: int = 3
    host_budgets_bytes: tuple[int, ...] = (1 << 30,)
    bisections: int = 3
    tidal_device_fraction: float = 0.1
    nvme_model_factor: float = 2.0
    timeout_s: float = 600.0
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(SECTIONS))
        require(not unknown, "--section", f"unknown {unknown}; choose from {SECTIONS}")
        unknown = sorted(set(self.systems) - set(DP_SYSTEMS))
        require(not unknown, "--systems", f"unknown {unknown}; choose from {DP_SYSTEMS}")
        require(bool(self.systems), "--systems", "choose at least one system")
        require(
            bool(self.nprocs) and min(self.nprocs) >= 1,
            "--nproc",
            f"rank counts must be >= 1, got {self.nprocs}",
        )
        require(
            self.steps > self.warmup_steps >= 0,
            "--steps",
            f"{self.steps} must exceed --warmup ({self.warmup_steps}), which must be >= 0",
        )
        require(
            all(b > 0 for b in self.host_budgets_bytes),
            "--host-budget",
            f"budgets must be > 0, got {self.host_budgets_bytes}",
        )
        require(self.bisections >= 0, "bisections", f"must be >= 0, got {self.bisections}")
        require(self.nvme_model_factor > 0, "nvme_model_factor",
                f"must be > 0, got {self.nvme_model_factor}")  # fmt: skip

    @property
    def scale_nproc(self) -> int:
        return max(self.nprocs)


def recipe_job(recipe: str, overrides: Sequence[str]) -> JobConfig:
    return load_job(find_recipe(recipe), list(overrides))


# [Note: teardown failures]
# With gloo, a rank of two sometimes aborts inside ``destroy_process_group`` after its run is
# complete ("terminate called without an active exception", SIGABRT; about 1 in 25 runs of 2
# ranks here, for every system), which :func:`run_on_ranks` rightly reports as a failed rank.
# A bench of dozens of configurations would lose one most times it runs, and the scale search
# would read it as "does not fit". So each rank also writes its figures to a file before it
# returns: when every rank wrote them, the run itself succeeded, and the row keeps the figures
# and says what failed after them (``teardown_error``). Any other failure is the row's error.


def run_configuration(
    case: Any, nproc: int, timeout_s: float, *, fn: Callable[[Any], dict[str, Any]] = run_case
) -> list[dict[str, Any]] | str:
    """Every rank's figures, or why the configuration failed: ``fn(case)`` on each rank (by
    default a :class:`Case`'s :func:`run_case`), ``case`` a dataclass with a ``result_dir``
    where each rank writes its figures too."""
    with tempfile.TemporaryDirectory(prefix="tidal-bench-dp-") as folder:
        case = dataclasses.replace(case, result_dir=folder)
        try:
            # Spawned: each rank's peak memory is its own process's, not a fork server's too.
            return run_on_ranks(fn, world_size=nproc, args=(case,), timeout_s=timeout_s,
                                start="spawn")  # fmt: skip
        except RankFailure as err:
            paths = [Path(folder) / f"rank{r}.json" for r in range(nproc)]
            if not all(p.is_file() for p in paths):
                return _first_lines(str(err))
            note = _first_lines(str(err))
            return [{**json.loads(p.read_text()), "teardown_error": note} for p in paths]


def _first_lines(text: str) -> str:
    """What each failed rank raised or how it died, without the tracebacks."""
    head, *lines = text.splitlines()
    return f"{head} " + "; ".join(line for line in lines if line.startswith("rank "))


def teardown_figures(first: dict[str, Any]) -> dict[str, str]:
    """See [Note: teardown failures]."""
    return {"teardown_error": first["teardown_error"]} if "teardown_error" in first else {}


def per_rank_memory(ranks: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    return {
        "peak_rss_bytes": [r["hwm_rss_bytes"] for r in ranks],
        "ru_maxrss_bytes": [r["ru_maxrss_bytes"] for r in ranks],
        "rss_after_warmup_bytes": [r["rss_after_warmup_bytes"] for r in ranks],
        "base_rss_bytes": [r["base_rss_bytes"] for r in ranks],
        # Each rank builds the whole model before a system shards it (tidal in the nvme
        # section builds it deferred): this shows that peak.
        "peak_rss_after_build_bytes": [r["hwm_rss_after_build_bytes"] for r in ranks],
    }


def fixed_overrides(settings: DpSettings) -> tuple[str, ...]:
    """The user's overrides, then what every section fixes: the CPU, chunks, unlimited tiers."""
    return (*settings.overrides, *_FIXED, "engine=chunk", *_UNLIMITED)


def scale_overrides(settings: DpSettings) -> tuple[str, ...]:
    batch = f"training.batch_size={settings.scale_nproc}"
    return (*fixed_overrides(settings), *_SCALE_OVERRIDES, batch)


def num_params_at_depth(base: JobConfig, depth: int) -> int:
    return closed_form_num_params(dataclasses.replace(base.model.resolve_gpt(), num_layers=depth))
