"""``tidal bench compose``'s pure parts: the peers' byte formula, what a failed run means to the
search ([Note: fits, refused, failed] in benchmarks/compose.py), the rows, ratios, targets and
tables, and one rank's own memory figure. Nothing here starts a rank: the runs are stood in for."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import compose
from benchmarks.compose import (
    COMPOSITIONS,
    ComposeSettings,
    Composition,
    add_fixed_ratios,
    depth_bounds,
    fixed_depth,
    not_runnable_row,
    settings_from_args,
    tables,
    target_rows,
    zero3_bytes,
)
from benchmarks.compose_ranks import is_budget_failure, refusal_line
from benchmarks.dp_runs import num_params_at_depth
from tidal.cli.args import build_parser
from tidal.train.job import find_recipe, load_job

TIDAL_CHUNKS = COMPOSITIONS[0]
GiB = 1 << 30


def test_the_peers_bytes_are_zero3s_formula() -> None:
    # two all-gathers of the fp32 parameters and one reduce-scatter, each (N-1)/N of them
    assert zero3_bytes(1000, nproc=4) == {
        "bytes_all_gathered": 6000.0, "bytes_reduce_scattered": 3000.0,
        "bytes_sent": 0.0, "bytes_all_reduced": 0.0,
    }  # fmt: skip
    assert zero3_bytes(1000, nproc=1)["bytes_all_gathered"] == 0


def test_the_configurations_are_data_with_the_issues_seven() -> None:
    """The issue's seven, and pp2 x dp2 reducing once per step beside them."""
    labels = [c.label for c in COMPOSITIONS]
    assert labels == ["dp4 chunk ZeRO-3", "pp4", "pp2 x dp2 chunk", "pp2 x dp2 chunk + NVMe",
                      "pp2 x tp2", "pp2 x dp2 chunk, reduce per step",
                      "DeepSpeed ZeRO-3 offload (dp4)", "FSDP2 CPU offload (dp4)"]  # fmt: skip
    assert len({c.key for c in COMPOSITIONS}) == len(COMPOSITIONS)


BUDGET = "2 of 4 ranks failed: rank 0: ConfigError: memory.device_budget: rank 0 would hold 1GiB; rank 1: RuntimeError: Connection closed by peer"  # fmt: skip
REFUSED = "4 of 4 ranks failed: rank 0: ConfigError: pipeline.schedule: pipemare updates with microbatches in flight; rank 1: ConfigError: pipeline.schedule: pipemare updates"  # fmt: skip
BROKEN = "1 of 4 ranks failed: rank 2: KeyError: 'weight'"


def test_a_failure_is_a_budget_a_refusal_or_neither() -> None:
    assert is_budget_failure(BUDGET) and refusal_line(BUDGET) is None
    assert is_budget_failure("1 of 4 ranks failed: rank 3: killed by signal SIGKILL")
    assert not is_budget_failure(REFUSED)
    assert (
        refusal_line(REFUSED) == "pipeline.schedule: pipemare updates with microbatches in flight"
    )
    assert not is_budget_failure(BROKEN) and refusal_line(BROKEN) is None


def _settings(**kw: Any) -> ComposeSettings:
    return ComposeSettings(recipe="tiny", host_budget_bytes=GiB, max_layers=40, **kw)


def _fake_runs(monkeypatch: pytest.MonkeyPatch, outcome: Any) -> list[int]:
    """``_run`` stood in for by ``outcome(depth)``: a peak RSS per rank, or an error."""
    probed: list[int] = []

    def run(settings: ComposeSettings, composition: Composition, depth: int, **_: Any) -> Any:
        probed.append(depth)
        result = outcome(depth)
        if isinstance(result, str):
            return result
        return [{"hwm_rss_bytes": result, "ru_maxrss_bytes": result, "rss_after_warmup_bytes": 0,
                 "base_rss_bytes": 0, "hwm_rss_after_build_bytes": 0}] * 4  # fmt: skip

    monkeypatch.setattr(compose, "_run", run)
    return probed


def test_budget_failures_and_peaks_over_the_budget_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # up to 9 blocks within the budget, 10 and 11 over it, then tidal refuses its tiers
    probed = _fake_runs(monkeypatch, lambda d: GiB // 2 if d < 10 else GiB + 1 if d < 12 else BUDGET)  # fmt: skip
    row = compose._scale_row(_settings(bisections=8), TIDAL_CHUNKS)
    assert row["largest_num_layers"] == 9 and "error" not in row
    assert row["largest_num_params"] > 0 and not row["capped"]
    assert [t["num_layers"] for t in row["tries"]] == sorted(set(probed))
    assert any(t.get("error") == BUDGET for t in row["tries"])


def test_a_refusal_on_the_ranks_is_not_runnable_and_another_failure_an_error(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    _fake_runs(monkeypatch, lambda d: GiB // 2 if d < 3 else REFUSED)
    row = compose._scale_row(_settings(), TIDAL_CHUNKS)
    assert row["not_runnable"].startswith("pipeline.schedule: pipemare")
    assert "largest_num_layers" not in row
    _fake_runs(monkeypatch, lambda d: BROKEN)
    row = compose._scale_row(_settings(), TIDAL_CHUNKS)
    assert row["error"] == BROKEN and "not_runnable" not in row


def test_a_configuration_tidal_refuses_at_job_check_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    probed = _fake_runs(monkeypatch, lambda d: GiB // 2)
    refused = Composition(key="x", label="pp2 x dp2 chunk pipedream",
                          overrides=("engine=chunk", "parallel.pp=2", "parallel.dp=2",
                                     "pipeline.schedule=pipedream"))  # fmt: skip
    row = compose._scale_row(_settings(), refused)
    assert row == not_runnable_row(refused, row["not_runnable"])
    assert row["not_runnable"].startswith("pipeline.schedule:") and not probed
    fixed = compose.fixed_rows(_settings(compositions=()), 2)
    assert fixed == []
    # pp4 refuses a model of 1 block (4 stages), not one deep enough for its stages
    pp4 = next(c for c in COMPOSITIONS if c.key == "pp4")
    assert compose._refusal(_settings(), pp4, 1) is not None
    assert compose._refusal(_settings(), pp4, 4) is None


def test_depth_bounds_every_configuration_by_all_ranks_model_data() -> None:
    settings = ComposeSettings(recipe="demo", host_budget_bytes=GiB, max_layers=10_000)
    base = load_job(find_recipe("demo"), settings.overrides_at(TIDAL_CHUNKS, 1, 1))
    start, limit = depth_bounds(base, TIDAL_CHUNKS, settings)
    assert num_params_at_depth(base, limit) * 16 > 4 * GiB >= num_params_at_depth(base, limit - 1) * 16  # fmt: skip
    assert 1 <= start < limit
    # the peers build deferred: no rank holds their whole weights either
    assert [depth_bounds(base, peer, settings) for peer in COMPOSITIONS[-2:]] == [
        (start, limit)
    ] * 2
    _, capped = depth_bounds(base, TIDAL_CHUNKS, ComposeSettings(recipe="demo", max_layers=8))
    assert capped == 9


def _fixed(key: str, *, moved: float, step: float, system: str = "tidal") -> dict[str, Any]:
    per_rank = {"bytes_all_gathered": moved / 2, "bytes_reduce_scattered": moved / 4,
                "bytes_sent": moved / 8, "bytes_all_reduced": moved / 8}  # fmt: skip
    figure = {"bytes": 100, "kind": "accounting", "source": "s"}
    return {"section": "fixed", "composition": key, "label": key, "system": system,
            "num_layers": 3, "median_step_s": step, "bytes_per_step": [per_rank] * 4,
            "bytes_source": "tidal's counters", "peak_rss_bytes": [400] * 4,
            "base_rss_bytes": [300] * 4, "rss_after_warmup_bytes": [0] * 4,
            "tidal_memory": [figure] * 4 if system == "tidal" else None}  # fmt: skip


def _scale(key: str, params: int | None, *, system: str = "tidal", capped: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"section": "scale", "composition": key, "label": key, "system": system,
            "host_budget_bytes_per_rank": GiB, "d_model": 64, "tries": [],
            "largest_num_layers": 3 if params else None, "largest_num_params": params,
            "largest_peak_rss_bytes": [1] * 4 if params else None, "capped": capped}  # fmt: skip


def test_the_scale_footnote_says_how_the_rows_peers_built_the_model() -> None:
    def note(peer: dict[str, Any]) -> str:
        (table,) = tables({"rows": [_scale("dp4-zero3", 300), peer]})
        return str(table.note)

    deferred = _scale("fsdp2", 100, system="fsdp2-cpu-offload") | {"build": "deferred"}
    assert "No rank holds the whole model" in note(deferred)
    assert "deepspeed.zero.Init" in note(deferred)
    # a run from before the peers built deferred has no "build" key: what it did is kept
    assert "whole model on every rank first" in note(_scale("fsdp2", 100, system="fsdp2-cpu-offload"))  # fmt: skip


def test_ratios_targets_and_tables() -> None:
    fixed = [_fixed("dp4-zero3", moved=1000, step=2.0), _fixed("pp2-dp2-chunk", moved=550, step=1.0),
             _fixed("deepspeed", moved=900, step=4.0, system="deepspeed-zero3-offload"),
             {"section": "fixed", **not_runnable_row(COMPOSITIONS[4], "parallel.tp: no")}]  # fmt: skip
    add_fixed_ratios(fixed)
    assert fixed[1]["moved_vs_dp4"] == pytest.approx(0.55) and fixed[1]["step_vs_dp4"] == 0.5
    assert fixed[0]["figure_rss_bytes"] == [400] * 4 and fixed[0]["peak_over_figure"] == [1.0] * 4
    assert fixed[2]["peak_over_figure"] == [None] * 4  # a peer: tidal makes no figure
    scale = [_scale("dp4-zero3", 300), _scale("pp4", 500, capped=True),
             _scale("deepspeed", 200, system="deepspeed-zero3-offload"),
             _scale("fsdp2", 450, system="fsdp2-cpu-offload")]  # fmt: skip
    targets = {t["target"]: t for t in target_rows(scale, fixed)}
    assert targets["largest-vs-deepspeed"]["value"] == 2.5
    assert (
        targets["largest-vs-deepspeed"]["holds"] and targets["largest-vs-deepspeed"]["lower_bound"]
    )
    assert targets["largest-vs-fsdp2"]["holds"] is False  # 500 / 450 misses 1.25: both shown
    assert targets["bytes-pp2-dp2-vs-dp4"]["holds"] is True
    assert targets["bytes-pp2-dp2-per-step-vs-dp4"]["holds"] is None  # not in the run
    assert target_rows([], [])[2]["holds"] is None  # not measured
    rows = [*scale, {"section": "scale", **not_runnable_row(COMPOSITIONS[3], "memory.nvme_dir: no")},
            *fixed, *({"section": "targets", **t} for t in targets.values())]  # fmt: skip
    made = tables({"rows": rows})
    assert [t.title.split(": ")[1].split(" (")[0] for t in made] == [
        "largest model per configuration", "one model all fit",
        "per-rank peak beside tidal's figure", "targets"]  # fmt: skip
    cells = [cell for t in made for row in t.rows for cell in row]
    assert "not runnable: memory.nvme_dir: no" in cells and ">= 3" in cells
    assert ">= 2.50x" in cells and "misses" in cells and "holds" in cells


def test_quick_changes_only_the_defaults_not_given() -> None:
    parser = build_parser()
    quick = settings_from_args(parser.parse_args(["bench", "compose", "--quick", "--steps", "4"]))
    assert (quick.recipe, quick.max_layers, quick.steps, quick.warmup_steps) == ("tiny", 6, 4, 1)
    plain = settings_from_args(parser.parse_args(["bench", "compose", "--compositions", "pp4,fsdp2"]))  # fmt: skip
    assert plain.recipe == "demo" and plain.compositions == ("pp4", "fsdp2")
    assert fixed_depth(plain, [_scale("a", 10), _scale("b", None)]) == 3
    assert fixed_depth(ComposeSettings(layers=7), []) == 7


def test_a_chunk_ranks_figure_is_made_before_training_and_bounds_what_its_store_holds(
    tmp_path: Any,
) -> None:
    """[Note: tidal's memory figure]: one chunk stage under a device budget it must evict
    under; the figure, taken before the first step, is the model data plus the budget, and
    the store's peaks on both tiers stay within it. (This test trains, in one process.)"""
    from benchmarks.compose_ranks import _memory_figure
    from tidal.train import Trainer

    trainer = Trainer("tiny", [f"run_dir={tmp_path}", "engine=chunk", "training.device=cpu",
                               "data.source=synthetic", "data.synthetic_num_tokens=20000",
                               "training.steps=3", "memory.device_budget=4MiB"])  # fmt: skip
    figure = _memory_figure(trainer.part)
    (held,) = trainer.part.engine.weights.values()
    before = held.stats()
    assert figure["kind"] == "prediction" and before["bytes_to_device"] == 0  # nothing ran yet
    assert figure["bytes"] == sum(before["model_data_bytes"].values()) + 4 * 2**20
    trainer.fit(progress=False)
    after = held.stats()
    assert after["bytes_to_host"] > 0  # the budget made it evict
    assert after["peak_device_bytes"] + after["peak_host_bytes"] <= figure["bytes"]
