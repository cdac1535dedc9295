"""``tidal bench dp``: the results file of a small perf run, the scale search's bracketing, and
the peers built deferred as ``tidal bench compose`` builds them. Figures are checked for
consistency, never for speed."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import dp_runs
from benchmarks.dp import search_largest
from benchmarks.dp_systems import (
    DEEPSPEED,
    FSDP2,
    Case,
    missing_reason,
    run_case,
    tidal_budget_overrides,
)
from tidal.data import BatchSampler, build_token_splits
from tidal.models import build_gpt
from tidal.parallel.accumulation import rank_rows
from tidal.testing import RankFailure, RankOutcome, run_on_ranks
from tidal.train.job import JobConfig, find_recipe, load_job


@pytest.mark.slow
def test_perf_section_through_the_cli(tmp_path: Path, bench_cli: Callable[..., Any]) -> None:
    argv = ["bench", "dp", "--recipe", "tiny", "--systems", "tidal,fsdp2-cpu-offload",
            "--nproc", "2", "--section", "perf", "--steps", "2", "--warmup-steps", "1",
            "--results-dir", str(tmp_path)]  # fmt: skip
    stdout, data = bench_cli(argv, tmp_path, "dp-*.json")
    assert "time vs tidal" in stdout
    assert "deepspeed_version" in data
    # Two ranks only: one rank is the same code path with a mesh of one, and each row spawns.
    assert data["settings"]["nprocs"] == [2] and data["settings"]["steps"] == 2
    rows = data["rows"]
    assert [(r["system"], r["nproc"]) for r in rows] == [("tidal", 2), ("fsdp2-cpu-offload", 2)]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["section"] == "perf"
        assert math.isfinite(row["median_step_s"]) and row["median_step_s"] > 0
        assert len(row["peak_rss_bytes"]) == len(row["rss_after_warmup_bytes"]) == row["nproc"]
        assert all(peak >= 0 for peak in row["peak_rss_bytes"])
    # Same model, seed and global batches: the systems train alike.
    tidal_loss = rows[0]["final_loss"]
    for row in rows:
        assert row["final_loss"] == pytest.approx(tidal_loss, rel=1e-3)


def _search(edge: int, *, start: int, limit: int, bisections: int) -> tuple[int | None, list[int]]:
    probes: list[int] = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= edge

    return search_largest(fits, start=start, limit=limit, bisections=bisections), probes


def test_search_doubles_then_bisects() -> None:
    largest, probes = _search(37, start=5, limit=1000, bisections=2)
    assert probes == [5, 10, 20, 40, 30, 35]
    assert largest == 35  # two bisections of (20, 40): coarse, never above the edge
    largest, probes = _search(37, start=5, limit=1000, bisections=10)
    assert largest == 37 and len(probes) == len(set(probes))


def test_search_halves_from_a_guess_that_does_not_fit() -> None:
    largest, probes = _search(6, start=40, limit=1000, bisections=3)
    assert probes[:3] == [40, 20, 10] and largest == 6
    assert _search(0, start=8, limit=1000, bisections=3) == (None, [8, 4, 2, 1])


def test_search_stops_below_the_known_limit() -> None:
    largest, probes = _search(10**6, start=3, limit=20, bisections=5)
    assert largest == 19 and max(probes) == 19


def test_tidal_budgets_leave_room_for_the_process() -> None:
    device, host = tidal_budget_overrides(1000, 300, 0.1)
    assert device == "memory.device_budget=100" and host == "memory.host_budget=600"
    with pytest.raises(ValueError, match="leaves the host tier nothing"):
        tidal_budget_overrides(1000, 950, 0.1)


def test_a_failure_after_every_rank_reported_keeps_the_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake_run_on_ranks(
        fn: object, *, world_size: int, args: tuple, timeout_s: float, start: str
    ) -> list:
        (case,) = args
        for rank in range(world_size - 1 if case.recipe == "crash" else world_size):
            (Path(case.result_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
        outcome = RankOutcome(1, "signal", -6, "killed by signal SIGABRT")
        raise RankFailure([outcome], world_size)

    monkeypatch.setattr(dp_runs, "run_on_ranks", fake_run_on_ranks)
    case = Case(system="tidal", recipe="tiny", overrides=(), steps=2, warmup_steps=1)
    ranks = dp_runs.run_configuration(case, 2, 10.0)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all("SIGABRT" in r["teardown_error"] for r in ranks)
    # A rank that never wrote its figures did not finish: the configuration failed.
    error = dp_runs.run_configuration(dataclasses.replace(case, recipe="crash"), 2, 10.0)
    assert error == "1 of 2 ranks failed: rank 1: killed by signal SIGABRT"


def test_nvme_rows_judge_the_budget_and_rate_the_disk() -> None:
    from benchmarks.dp_nvme import nvme_figures, nvme_table

    def rank(peak: int, moved: int) -> dict:
        disk = {"timed_bytes_to_nvme": moved // 2, "timed_bytes_from_nvme": moved // 2,
                "timed_steps": 2, "param_shards_on_nvme": 7, "num_chunks": 9}  # fmt: skip
        return {"median_step_s": 0.5, "tokens_per_step": 128, "step_s": [1.0, 0.5, 0.5],
                "losses": [5.0, 4.0, 3.0], "tidal_budgets": [], "disk": disk,
                "hwm_rss_bytes": peak, "ru_maxrss_bytes": peak, "base_rss_bytes": 0,
                "rss_after_warmup_bytes": peak - 1, "hwm_rss_after_build_bytes": peak}  # fmt: skip

    figures = nvme_figures([rank(900, 4_000), rank(1_000, 2_000)], budget_bytes=1_000)
    assert figures["fits"] and figures["tokens_per_s"] == 256
    assert figures["disk_bytes_per_step_per_rank"] == [2_000, 1_000]
    assert figures["disk_bytes_per_s_per_rank"] == [4_000, 2_000]
    assert not nvme_figures([rank(1_001, 0)], budget_bytes=1_000)["fits"]
    row = {"nproc": 2, "host_budget_bytes_per_rank": 1_000, "num_layers": 3,
           "num_params": 10, "model_data_bytes": 160, **figures}  # fmt: skip
    headers, (cells,) = nvme_table([row])
    assert len(cells) == len(headers) and cells[4] == "yes" and cells[5] == "7 / 9"


_PEER_OVERRIDES = (
    "training.device=cpu", "memory.device_budget=none", "memory.host_budget=none",
    "training.precision=fp32", "model.seq_len=32", "training.batch_size=4",
    "model.tie_embeddings=false", "model.num_layers=2", "optimizer.warmup_steps=1",
)  # fmt: skip


def _first_loss_of_build_gpt(job: JobConfig, world_size: int) -> float:
    """The first step's loss of ``build_gpt(config, seed)`` as ``run_case`` takes it: the mean of
    the ranks' losses on their rows of the first batch."""
    config, training = job.model.resolve_gpt(), job.training
    model = build_gpt(config, seed=training.seed)
    splits = build_token_splits(job.data, vocab_size=config.vocab_size, seed=training.seed)
    batches = BatchSampler(splits.train, batch_size=training.batch_size,
                           seq_len=config.seq_len, seed=training.seed)  # fmt: skip
    inputs, targets = batches.next_batch()
    with torch.no_grad():
        losses = [float(model(inputs[rows], targets[rows]))
                  for rows in (rank_rows(training.batch_size, rank=r, world_size=world_size)
                               for r in range(world_size))]  # fmt: skip
    return sum(losses) / world_size


@pytest.mark.slow
@pytest.mark.parametrize("system", [FSDP2, DEEPSPEED])
def test_the_peers_train_built_deferred(system: str) -> None:
    """Built as ``tidal bench compose`` builds them (``deferred``: no rank holds the whole
    model), each peer's loss on text falls over 6 steps; DeepSpeed's values are
    ``build_gpt``'s, so its first loss is that model's."""
    if system == DEEPSPEED and missing_reason(system) is not None:
        pytest.skip(str(missing_reason(system)))
    case = Case(system=system, recipe="tiny", overrides=_PEER_OVERRIDES, steps=6,
                warmup_steps=1, deferred=True)  # fmt: skip
    ranks = run_on_ranks(run_case, world_size=2, args=(case,), timeout_s=300)
    losses = ranks[0]["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    if system == DEEPSPEED:
        job = load_job(find_recipe("tiny"), list(_PEER_OVERRIDES))
        assert losses[0] == pytest.approx(_first_loss_of_build_gpt(job, 2), abs=1e-5)
