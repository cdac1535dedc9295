"""``tidal train --pipeline-stages``: the Trainer's pipeline against one process, resume, bad input.

A synchronous pipeline (1F1B, 2 stages on 2 gloo ranks) of the tiny GPT must log the reference
engine's losses and validation losses (global clipping and the tied embedding included), and a
run stopped at a checkpoint and resumed must continue exactly as the unbroken run. An
asynchronous PipeMare run (the tied embedding's head one version behind the embedding) records
its measured delays, which must be the simulator's, and resumes exactly too. With ``pipeline.memory`` recompute, selective recompute or host swap the
synchronous run logs the same losses bit for bit.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.cli.main import main
from tidal.config import ConfigError, parse_bytes
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

STEPS = 4
TOL = 1e-5
JOB: dict[str, Any] = {
    "name": "pipe",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
    },
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "checkpoint": {"every_steps": 2},
    "metrics": {"peak_tflops": 1.0},
}


def _job(run_dir: Path, *, steps: int = STEPS, **pipeline: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"]["steps"] = steps
    if pipeline:
        job["parallel"] = {"pp": 2}
        job["pipeline"] = {"microbatches": 2, **pipeline}
    return job


def _fit_in_2mib(run_dir: Path, memory: str,
                 losses: tuple[list[float], list[float]]) -> list[dict[str, Any]]:  # fmt: skip
    """Train 1F1B with ``pipeline.memory = memory`` under a 2 MiB budget a rank; assert it logs
    ``losses`` bit for bit and return every rank's memory figures from its summary."""
    import torch.distributed as dist

    job = _job(run_dir, schedule="1f1b", memory=memory)
    job["memory"] = {"device_budget": "2MiB"}
    summary = Trainer(job).fit()
    assert _losses(run_dir) == losses
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, summary["pipeline"]["memory"])
    return figures


def _last_rank_lends_to_the_first(run_dir: Path, budget: str,
                                  **pipeline: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Under ``budget`` a rank, ``none`` is refused naming rank 1 and ``peer`` trains the losses
    of the same pipeline without a budget bit for bit, rank 1 lending to rank 0, every rank
    within its predicted peak within the budget; every rank's memory figures."""
    import torch.distributed as dist

    Trainer(_job(run_dir / "free", **pipeline)).fit()
    squeezed = _job(run_dir / "none", memory="none", **pipeline)
    squeezed["memory"] = {"device_budget": budget}
    with pytest.raises(ConfigError, match=r"rank 1 needs .* set pipeline.memory = 'auto'"):
        Trainer(squeezed).fit()
    lent = _job(run_dir / "peer", memory="peer", **pipeline)
    lent["memory"] = {"device_budget": budget}
    summary = Trainer(lent).fit()
    assert _losses(run_dir / "peer") == _losses(run_dir / "free")
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, summary["pipeline"]["memory"])
    assert figures[1]["lends_to"] == [0] and figures[0]["peak_held_bytes"] > 0, figures
    assert all(f["measured_peak_bytes"] <= f["predicted_peak_bytes"] <= f["budget_bytes"]
               for f in figures), figures  # fmt: skip
    return figures


def _losses(run_dir: Path) -> tuple[list[float], list[float]]:
    records = read_metrics(run_dir)
    train = [r["loss"] for r in records if r["kind"] == "train"]
    return train, [r["val_loss"] for r in records if r["kind"] == "val"]


def _worker(root: str, reference: tuple[list[float], list[float]]) -> None:
    import torch.distributed as dist

    from tidal.pipeline.schedules import make_schedule
    from tidal.pipeline.simulate import simulate

    root_path = Path(root)
    Trainer(_job(root_path / "sync", schedule="1f1b")).fit()
    train, val = _losses(root_path / "sync")
    assert train == pytest.approx(reference[0], abs=TOL), (train, reference[0])
    assert val == pytest.approx(reference[1], abs=TOL), (val, reference[1])

    # MPress's savers on every block, or on its attention part (selective): the same numbers,
    # bit for bit.
    for mode in ("recompute", "selective", "host"):
        summary = Trainer(_job(root_path / mode, schedule="1f1b", memory=mode)).fit()
        assert _losses(root_path / mode) == (train, val), mode
        figures: list[Any] = [None, None]
        dist.all_gather_object(figures, summary["pipeline"]["memory"])
        blocks = sum(f["blocks_recomputed"] + f["blocks_swapped"] for f in figures)
        assert blocks == 2 and all(f["mode"] == mode for f in figures), figures  # tiny: 2
        if mode == "host":
            assert sum(f["tensors_to_host"] for f in figures) > 0
            assert max(f["peak_host_bytes"] for f in figures) > 0

    # Under a budget rank 0 does not meet by keeping everything (2.09 MiB of 2 MiB), none is
    # refused before the first step and auto trains the same numbers, within the budget.
    squeezed = _job(root_path / "none-2MiB", schedule="1f1b", memory="none")
    squeezed["memory"] = {"device_budget": "2MiB"}
    with pytest.raises(ConfigError, match=r"rank 0 needs 2.09MiB .* set pipeline.memory = 'auto'"):
        Trainer(squeezed).fit()
    figures = _fit_in_2mib(root_path / "auto", "auto", (train, val))
    assert all(f["measured_peak_bytes"] <= f["budget_bytes"] == 2 << 20 for f in figures), figures
    assert all(f["predicted_peak_bytes"] <= 2 << 20 for f in figures), figures
    assert figures[0]["blocks_recomputed"] + figures[0]["blocks_swapped"] > 0, figures
    assert all(f["measured_peak_bytes"] > f["model_data_bytes"] for f in figures)  # it counted
    # Selective recompute (each block's attention part) also fits rank 0 into 2 MiB: measured
    # within the predicted peak, within the budget, the same numbers.
    figures = _fit_in_2mib(root_path / "selective-2MiB", "selective", (train, val))
    assert all(f["measured_peak_bytes"] <= f["predicted_peak_bytes"] <= 2 << 20 for f in figures)
    assert sum(f["blocks_recomputed"] for f in figures) == 2, figures

    # Peer swap only (MPress's device-to-device swap): rank 0 lends to rank 1 what it cannot
    # hold, rank 1 holds it within the same budget, the numbers are the same bit for bit.
    figures = _fit_in_2mib(root_path / "peer", "peer", (train, val))
    assert figures[0]["blocks_lent"] > 0 and figures[0]["lends_to"] == [1], figures
    assert figures[0]["bytes_lent"] > 0 and figures[1]["blocks_lent"] == 0, figures
    assert figures[1]["peak_held_bytes"] > 0 == figures[0]["peak_held_bytes"], figures
    # Every step's record has every stage's figures (memory.png draws them): rank 0 lends each
    # step, and the peaks reach the summary's.
    ranks = [r["pipeline_ranks"] for r in read_metrics(root_path / "peer") if r["kind"] == "train"]
    assert all(step[0]["lent_bytes"] > 0 == step[1]["lent_bytes"] for step in ranks), ranks
    assert [f["measured_peak_bytes"] for f in figures] == [r["peak_bytes"] for r in ranks[-1]]
    # Each lent microbatch came back once, before its backward; how long that waited is the
    # stall a transfer's idle window did not hide (the borrower's alone: rank 1 lends nothing).
    assert figures[0]["reclaims"] == STEPS * 2 and figures[0]["reclaim_wait_s"] > 0, figures
    assert "reclaims" not in figures[1] or figures[1]["reclaims"] == 0, figures
    assert all(f["measured_peak_bytes"] <= f["predicted_peak_bytes"] <= 2 << 20 for f in figures)
    # With virtual stages (2 chunks, 4 microbatches) the last rank is the heavier (the head's
    # logits) and lends to rank 0, an earlier rank: stage 1's bytes are held at stage 2. Under
    # GPipe (4 microbatches, all in flight) too, to rank 0 as [Note: lending]'s earlier lender.
    _last_rank_lends_to_the_first(root_path / "virtual", "1880KiB", schedule="interleaved",
                                  virtual_stages=2, microbatches=4)  # fmt: skip
    figures = _last_rank_lends_to_the_first(root_path / "gpipe", "2350KiB", schedule="gpipe",
                                            microbatches=4)  # fmt: skip
    assert figures[0]["blocks_lent"] == 0, figures
    # The links it priced were measured, and every rank planned with the same figures.
    from tidal.train.links import measure_links

    links: list[Any] = [None, None]
    dist.all_gather_object(links, measure_links(torch.device("cpu"), num_bytes=1 << 20))
    assert links[0] == links[1] and links[0].peer_bytes_per_s > 0, links

    Trainer(_job(root_path / "resumed", schedule="1f1b", steps=2)).fit()
    Trainer(_job(root_path / "resumed", schedule="1f1b")).fit(resume=True)
    assert _losses(root_path / "resumed") == (train, val)

    # PipeMare with its discrepancy correction, the tied embedding's head following the
    # embedding ([Note: tied matrices without a flush]): the delta buffer is part of what
    # resumes, and the copies are equal at the checkpoint.
    job = _job(root_path / "async", schedule="pipemare", correction=True)
    summary = Trainer(job).fit()
    split = _job(root_path / "async-resumed", steps=2, schedule="pipemare", correction=True)
    Trainer(split).fit()
    Trainer({**split, "training": {**split["training"], "steps": STEPS}}).fit(resume=True)
    assert _losses(root_path / "async-resumed") == _losses(root_path / "async")
    # Step 0 runs before any update, so it is the flushed run's loss exactly; later steps run on
    # delayed weights (the head one update behind the embedding) and stay near it.
    async_train = _losses(root_path / "async")[0]
    assert async_train[0] == train[0] and summary["final_loss"] == async_train[-1]
    assert max(abs(a - b) for a, b in zip(async_train, train, strict=True)) < 1e-2
    # Host swap and lending under PipeMare: the same numbers (the swaps hand the parameters to
    # the stage's weight-version redirection).
    swapped = _job(root_path / "async-host", schedule="pipemare", correction=True, memory="host")
    Trainer(swapped).fit()
    assert _losses(root_path / "async-host") == _losses(root_path / "async")
    # Recompute under PipeDream runs on the stashed version its forward used.
    for mode in ("none", "recompute"):
        stashing = _job(root_path / f"pipedream-{mode}", schedule="pipedream", memory=mode)
        Trainer(stashing).fit()
    assert _losses(root_path / "pipedream-recompute") == _losses(root_path / "pipedream-none")
    # At the least budget the refusal names, PipeDream's stashed versions must leave the device
    # too: they wait in the host tier ([Note: stashes on the host]), the same losses.
    tight = _job(root_path / "pipedream-tight", schedule="pipedream", memory="auto")
    tight["memory"] = {"device_budget": "1KiB"}
    with pytest.raises(ConfigError, match=r"needs at least ([\d.]+\w+) with every") as refused:
        Trainer(tight).fit()
    least = re.search(r"needs at least ([\d.]+\w+) with every", str(refused.value))
    assert least is not None
    tight["memory"] = {"device_budget": int(parse_bytes(least.group(1)) * 1.01)}
    figures = Trainer(tight).fit()["pipeline"]["memory"]
    assert _losses(root_path / "pipedream-tight") == _losses(root_path / "pipedream-none")
    assert figures["stashes_on_host"] == ([0] if dist.get_rank() == 0 else [])
    expected = simulate(make_schedule("pipemare", stages=2, microbatches=2, steps=2)).delay
    measured = summary["pipeline"]["max_delay_per_stage"]
    rank = dist.get_rank()
    assert measured == {str(rank): expected[rank]}, (measured, expected)
    assert expected[0] >= 1  # the first stage really trained on stale weights


@pytest.mark.slow
def test_pipeline_trainer_equals_reference_and_resumes(tmp_path: Path) -> None:
    Trainer(_job(tmp_path / "reference")).fit()
    reference = _losses(tmp_path / "reference")
    assert len(reference[0]) == STEPS and len(reference[1]) == 2
    run_on_ranks(_worker, world_size=2, args=(str(tmp_path), reference), timeout_s=240)


def test_bad_pipeline_input_exits_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before torchrun starts: one line naming the setting and the fix."""
    argv = ["train", "--recipe", "tiny", "--pipeline-stages", "2", "--set", "run_dir=/nonexistent"]
    assert main([*argv, "--schedule", "pipemare",
                 "--set", "training.precision=bf16"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "training.precision: pipemare is asynchronous" in err
    assert main([*argv, "--set", "training.precision=fp16", "--set", "training.device=cpu"]) == 2
    assert "training.precision: fp16 needs CUDA" in capsys.readouterr().err
    assert main([*argv, "--set", "pipeline.microbatches=9"]) == 2
    assert "pipeline.microbatches" in capsys.readouterr().err
    assert main([*argv, "--set", "pipeline.prediction=true"]) == 2  # 1f1b has no delay
    err = capsys.readouterr().err
    assert "pipeline.prediction" in err and "pipemare" in err
    assert main([*argv, "--schedule", "pipemare",
                 "--set", "pipeline.memory=recompute"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "pipeline.memory: recompute runs under synchronous and stashing schedules" in err
    assert main([*argv, "--schedule", "pipemare",
                 "--set", "pipeline.memory=selective"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "pipeline.memory: selective runs under synchronous and stashing schedules" in err
    assert len(err.strip().splitlines()) == 1


def test_a_plan_and_a_pipeline_are_refused_together(tmp_path: Path) -> None:
    from tidal.models import preset
    from tidal.models.gpt import measure_gpt
    from tidal.planner import ClusterSpec, PlannerConfig, make_plan

    graph = measure_gpt(preset("tiny"), micro_batch=1)
    config = PlannerConfig(pipelines=False, tp=1, pareto=(), baselines=())
    plan = make_plan(graph, ClusterSpec(devices=2), config).plan
    with pytest.raises(
        ConfigError, match="--plan: a plan sets the mesh .* pipeline, parallel.tp or parallel.fsdp2"
    ):
        Trainer(_job(tmp_path / "both", schedule="1f1b"), plan=plan)
    one_stage = _job(tmp_path / "fsdp2")
    one_stage["parallel"] = {"fsdp2": True}  # no pipeline, but on stages all the same
    with pytest.raises(
        ConfigError, match="--plan: a plan sets the mesh .* parallel.fsdp2 would do too"
    ):
        Trainer(one_stage, plan=plan)
    in_chunks = _job(tmp_path / "chunk")
    in_chunks["engine"] = "chunk"  # one chunk stage: refused as the chunk engine always was
    with pytest.raises(ConfigError, match="--plan: .*the chunk engine would do too; drop --plan"):
        Trainer(in_chunks, plan=plan)
    # what the plan's one stage cannot take, one line each ([Note: plan stages])
    for section, setting, said in (
        ("pipeline", {"memory": "recompute"}, "pipeline.memory: a plan chooses what each block"),
        ("training", {"precision": "fp16"}, "training.precision: a plan run trains in 'fp32' or"),
    ):
        job = _job(tmp_path / section)
        job.setdefault(section, {}).update(setting)
        with pytest.raises(ConfigError, match=said):
            Trainer(job, plan=plan)
