"""``tidal train --plan``: the Trainer on planner-made plans against one process, and the CLI.

Each plan trains the tiny GPT (dropout 0) on 2 gloo ranks with the same job as a one-process
run of one plain stage: two micro-batches a step (so ZeRO-1 units accumulate), validation
mid-run and at the end, a checkpoint at the end. Losses, validation losses and the checkpointed
(whole, single-device layout) parameters must match the reference's; a run stopped at step 2
and resumed must continue exactly as the unbroken run, and as closely resumed under another
plan's mesh or without a plan (for two of the plans: each run costs seconds on 2 cores). One
spawn of 2 ranks runs every case.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.cli.main import main
from tidal.config import ConfigError
from tidal.models import closed_form_num_params, preset
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Plan, PlannerConfig, Recompute, StrategyName, make_plan
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import latest_checkpoint, load_model_state
from tidal.train.metrics import read_metrics

WORLD = 2
STEPS = 3
RESUMED = ("tp2-megatron", "dp2-mixed-zero")  # the most intricate layouts and optimizer state
ACROSS = ("on-dp2", "without-plan")  # where a plan run's checkpoint resumes besides its own plan
TOL = 1e-5
MEMORY_TOL = 0.10  # the bound on what the runtime meters
TINY = preset("tiny")

JOB: dict[str, Any] = {
    "name": "plan",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,
        "grad_accum_steps": 2,
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
    },
    # One schedule for the unbroken run and for both parts of the resumed one. Adam divides by
    # |grad| + eps: with the default eps of 1e-8, near-zero gradients that differ by rounding
    # (sums taken in another order across ranks) step up to lr apart (2.4e-5 at dp 2).
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS, "eps": 1e-6},
    "metrics": {"peak_tflops": 1.0},
}


def _job(run_dir: Path, **training: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["training"].update(training)
    return job


def _planned(*, tp: int, micro_batch: int = 1, **config: Any) -> Plan:
    graph = measure_gpt(TINY, micro_batch=micro_batch)
    config = {"pareto": (), "baselines": (), **config}
    return make_plan(
        graph, ClusterSpec(devices=WORLD), PlannerConfig(pipelines=False, tp=tp, **config)
    ).plan


def _with_zero(plan: Plan, zeros: dict[str, int]) -> Plan:
    units = [dataclasses.replace(u, zero=zeros.get(u.name, u.zero)) for u in plan.units]
    return dataclasses.replace(plan, units=units)


def _cases() -> dict[str, Plan]:
    """Plans the planner makes for the tiny GPT on 2 devices (a large eps lets it shard)."""
    cases = {
        "tp2": _planned(tp=2, eps=10.0),
        # heads, colwise / rowwise pairs and split sequences: the fused qkv's rows reordered
        "tp2-megatron": _planned(tp=2, eps=1000.0),
        "dp2": _planned(tp=1, eps=10.0),  # ZeRO-3
        # ZeRO-1 (accumulating unsynchronised), -2, and -0 (all-reduced by hooks) side by side
        "dp2-mixed-zero": _with_zero(_planned(tp=1, micro_batch=4, eps=0.0), {"ln_f": 0}),
    }
    # What each case is there for: a planner that changes its choices should not go unnoticed.
    assert cases["tp2-megatron"].unit("blocks.*.attn.qkv").strategy is StrategyName.COLWISE
    assert {u.zero for u in cases["dp2-mixed-zero"].units} >= {0, 1, 2}
    return cases


# -- what each rank runs ---------------------------------------------------------------------------


def _train_cases(cases: dict[str, Plan], root: Path) -> dict[str, Any]:
    results = {}
    for name, plan in cases.items():
        trainer = Trainer(_job(root / name / "whole"), plan=plan)
        trainer.fit()
        if name in RESUMED:  # the same run stopped after step 2, then resumed by a new Trainer
            Trainer(_job(root / name / "resumed", steps=2), plan=plan).fit()
            for other in ACROSS:  # [Note: plan stages]: the one format resumes on any mesh
                if dist.get_rank() == 0:
                    shutil.copytree(root / name / "resumed", root / name / other)
            dist.barrier()
            Trainer(_job(root / name / "resumed"), plan=plan).fit(resume=True)
            Trainer(_job(root / name / "on-dp2"), plan=cases["dp2"]).fit(resume=True)
            Trainer(_job(root / name / "without-plan")).fit(resume=True)
        (held,) = trainer.engine.weights.values()
        results[name] = {"summary": trainer.part.summary_figures(),
                         "holder": type(held).__name__, "step": trainer.engine.step}  # fmt: skip
    return results


# -- the tests -------------------------------------------------------------------------------------


def _records(run_dir: Path, kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("plans")
    cases = _cases()
    ranks = run_on_ranks(_train_cases, world_size=WORLD, args=(cases, root), timeout_s=240)
    Trainer(_job(root / "reference")).fit()
    return {"root": root, "cases": cases, "ranks": ranks}


@pytest.mark.parametrize("case", ["tp2", "tp2-megatron", "dp2", "dp2-mixed-zero"])
def test_a_plan_trains_as_one_process_does(runs: dict[str, Any], case: str) -> None:
    root = runs["root"]
    whole, reference = root / case / "whole", root / "reference"
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
        got, want = _records(whole, kind, key), _records(reference, kind, key)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
    assert want[-1][1] != pytest.approx(want[0][1], abs=1e-3), "training must move"
    state, want_state = (load_model_state(latest_checkpoint(d)) for d in (whole, reference))
    assert state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)
    if case in RESUMED:  # bit for bit: [Note: exact resume] in tidal/train/trainer.py
        resumed = _records(root / case / "resumed", "train", "loss")
        assert resumed == _records(whole, "train", "loss")
    summary = json.loads((whole / "summary.json").read_text())
    plan = runs["cases"][case]
    assert summary["engine"] == "plan" and summary["mesh"] == f"dp {plan.dp} x tp {plan.tp}"
    for rank in runs["ranks"]:  # [Note: plan stages]: the one train step, on one stage
        assert rank[case]["holder"] == "PlanStageWeights" and rank[case]["step"] == STEPS


def test_a_one_device_plan_with_half_its_parameters_on_the_host(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 51: the search's plan for one device with the optimizer and half the parameters on
    the host trains as the reference does: FSDP2 on a mesh of one, CPU offload on the groups
    nearest half the parameters (others on the device), the host optimizer updating them."""
    from torch.distributed.fsdp import FSDPModule

    from tidal.memory.share import ON_HOST

    config = PlannerConfig(pipelines=False, pareto=(), baselines=(), offload=(1.0,),
                           offload_params=(0.5,))  # fmt: skip
    plan = make_plan(
        measure_gpt(TINY, micro_batch=1, dtype=torch.float32), ClusterSpec(devices=1), config
    ).plan
    assert (plan.dp, plan.tp, plan.offload.params) == (1, 1, 0.5) and plan.chunks is None
    assert {u.zero for u in plan.units if u.memory.resident + u.memory.host} == {3}
    trainer = Trainer(_job(tmp_path / "alone"), plan=plan)
    trainer.fit()
    whole, reference = tmp_path / "alone", runs["root"] / "reference"
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
        got, want = _records(whole, kind, key), _records(reference, kind, key)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
    state, want_state = (load_model_state(latest_checkpoint(d)) for d in (whole, reference))
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)
    (held,) = trainer.engine.weights.values()
    policies = {type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for m in held.module.modules() if isinstance(m, FSDPModule)
                and m._get_fsdp_state()._fsdp_param_group is not None}  # fmt: skip
    assert policies == {"CPUOffloadPolicy", "OffloadPolicy"}, policies
    params = list(held.module.parameters())
    on_host = sum(p.numel() for p in params if getattr(p, ON_HOST, False))
    assert 0 < on_host < sum(p.numel() for p in params)
    assert type(held.optimizer).__name__ == "HostStepped"


def test_a_one_device_plan_in_chunks(runs: dict[str, Any], tmp_path: Path) -> None:
    """The same search with ``--model-data auto`` keeps the model's data in tidal's chunks ([Note: chunk stages in plans] in
    tidal/planner/model_data.py): it trains as the reference does, its store under the plan's
    device budget and within 10% of it at its peak, the rest of the model data on the host."""
    config = PlannerConfig(pipelines=False, pareto=(), baselines=(), offload=(1.0,),
                           offload_params=(0.5,), param_bytes=4, grad_bytes=4,
                           optimizer_bytes=8, model_data="auto")  # fmt: skip
    plan = make_plan(
        measure_gpt(TINY, micro_batch=1, dtype=torch.float32), ClusterSpec(devices=1), config
    ).plan
    assert plan.chunks is not None and plan.chunks.device_bytes == math.ceil(plan.memory.total)
    trainer = Trainer(_job(tmp_path / "chunks"), plan=plan)
    trainer.fit()
    whole, reference = tmp_path / "chunks", runs["root"] / "reference"
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
        got, want = _records(whole, kind, key), _records(reference, kind, key)
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
    state, want_state = (load_model_state(latest_checkpoint(d)) for d in (whole, reference))
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)
    (held,) = trainer.engine.weights.values()
    assert type(held).__name__ == "ChunkStageParams"
    stats = held.stats()
    assert stats["device_budget"] == plan.chunks.device_bytes
    peak, predicted = stats["peak_device_bytes"], plan.memory.total
    assert (1 - MEMORY_TOL) * predicted <= peak <= predicted, (peak, predicted)
    assert stats["bytes_to_host"] > 0 and stats["evictions"] > 0, stats


def test_a_one_device_plan_in_chunks_with_state_on_nvme(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """All of the model data on the host and half of its optimizer state on NVMe, in chunks
    ([Note: chunk stages in plans]): it trains as the reference does, its store under the
    plan's device budget with the plan's activations, the disk holding half the chunks' state to
    the nearest chunk (the chunks' padding on top of the plan's figure, which prices
    parameters), the host the rest and the staging it reports; without ``memory.nvme_dir`` the
    run is refused in one line."""
    config = PlannerConfig(pipelines=False, pareto=(), baselines=(), offload=(1.0,),
                           offload_params=(1.0,), offload_nvme=(0.5,), param_bytes=4,
                           grad_bytes=4, optimizer_bytes=8, model_data="chunks")  # fmt: skip
    cluster = ClusterSpec(devices=1, nvme_bytes_per_node=2**40)
    plan = make_plan(measure_gpt(TINY, micro_batch=4, dtype=torch.float32), cluster, config).plan
    assert plan.chunks is not None and plan.chunks.nvme_fraction == 0.5
    with pytest.raises(ConfigError, match="memory.nvme_dir") as refused:
        Trainer(_job(tmp_path / "no-disk"), plan=plan)
    assert "\n" not in str(refused.value)
    job = _job(tmp_path / "nvme")
    job["memory"] = {"nvme_dir": str(tmp_path / "disk")}
    trainer = Trainer(job, plan=plan)
    trainer.fit()
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
        got, want = (
            _records(tmp_path / "nvme", kind, key),
            _records(runs["root"] / "reference", kind, key),
        )
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
    (held,) = trainer.engine.weights.values()
    assert type(held).__name__ == "ChunkStageParams"
    stats = held.stats()
    # the store under the plan's budget, its activations (traced in the run's fp32, at its
    # micro-batch of 4) the plan's within 10%; the rest of the plan's transient (the loss's
    # and the gathers' temporaries) is not saved for backward, so not metered on a CPU
    assert stats["device_budget"] == math.ceil(plan.memory.total) >= stats["peak_device_bytes"]
    metered, predicted = held.store.trace.peak_non_model_bytes, plan.memory.activations
    assert metered == pytest.approx(predicted, rel=MEMORY_TOL), (metered, predicted)
    capacities = [c.spec.capacity for c in held.store.chunks]
    state = [8 * n for n in capacities]  # AdamW's two fp32 moments; fp32 weights are the masters
    on_disk = stats["peak_nvme_bytes"]
    assert stats["chunks_on_nvme"] > 0 and abs(on_disk - sum(state) / 2) <= max(state) / 2
    padded = sum(capacities) / sum(p.numel() for p in held.module.parameters())
    assert plan.memory.nvme <= on_disk <= padded * plan.memory.nvme + max(state) / 2
    assert 0 < stats["host_staging_bytes"] <= 3 * max(state)
    host_bound = padded * plan.memory.host + stats["host_staging_bytes"] + max(state) / 2
    assert plan.memory.host <= stats["peak_host_bytes"] <= host_bound, stats


def test_one_class_of_what_blocks_save_on_the_host(runs: dict[str, Any], tmp_path: Path) -> None:
    """Plans that keep one class of what each block saves on the host ([Note: savers per tensor
    class] in tidal/planner/block_savers.py) train as the reference does; the host swap moves
    the attention's or the MLP's tensors alone (with the attention core recomputed, the MLP's
    bytes again), together less than the whole block's."""
    graph = measure_gpt(TINY, micro_batch=1)
    moved = {}
    for mode in (Recompute.SWAP, Recompute.SWAP_ATTENTION, Recompute.SWAP_MLP,
                 Recompute.SELECTIVE_SWAP_MLP):  # fmt: skip
        config = PlannerConfig(pipelines=False, pareto=(), baselines=(), recompute=(mode,))
        plan = make_plan(graph, ClusterSpec(devices=1), config).plan
        assert plan.recompute == {"blocks.*": mode}
        trainer = Trainer(_job(tmp_path / str(mode)), plan=plan)
        trainer.fit()
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
            got = _records(tmp_path / str(mode), kind, key)
            want = _records(runs["root"] / "reference", kind, key)
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
        moved[mode] = trainer.part.summary_figures()["host_swap_bytes"]
    attention, mlp = moved[Recompute.SWAP_ATTENTION], moved[Recompute.SWAP_MLP]
    assert attention > 0 and mlp > 0 and attention + mlp < moved[Recompute.SWAP], moved
    assert moved[Recompute.SELECTIVE_SWAP_MLP] == mlp, moved


@pytest.mark.parametrize("case", RESUMED)
def test_a_plan_runs_checkpoint_resumes_on_another_plan_and_without_one(
    runs: dict[str, Any], case: str
) -> None:
    root = runs["root"]
    want = _records(root / case / "whole", "train", "loss")
    for other in ACROSS:
        got = _records(root / case / other, "train", "loss")
        assert [s for s, _ in got] == [s for s, _ in want], other
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0), other
        state = load_model_state(latest_checkpoint(root / case / other))
        for name, value in load_model_state(latest_checkpoint(root / case / "whole")).items():
            torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)


def test_model_data_bytes_are_this_ranks_shards(runs: dict[str, Any]) -> None:
    whole = 4 * closed_form_num_params(TINY)  # fp32
    held = [rank["dp2"]["summary"]["model_data_bytes"] for rank in runs["ranks"]]
    assert sum(h["params"] for h in held) == whole  # ZeRO-3: every parameter cut in two
    for h in held:
        # AdamW's two moments per element, and a step count per parameter
        assert 2 * h["params"] < h["optimizer_state"] < 2 * h["params"] + 1024


# -- the command line -------------------------------------------------------------------------------

TINY_RUN = [
    "--recipe", "tiny", "--no-plots",
    "--set", "data.source=synthetic", "--set", "data.synthetic_num_tokens=20000",
    "--set", "training.steps=3", "--set", "training.val_batches=1",
    "--set", "training.device=cpu", "--set", "checkpoint.every_steps=0",
]  # fmt: skip


def _plan_file(path: Path, *, model: str = "tiny", devices: int = WORLD, pp: int = 1) -> Path:
    argv = ["plan", "--model", model, "--devices", str(devices), "--pp", str(pp)]
    assert main([*argv, "--json", str(path), "--pareto", "", "--baselines", ""]) == 0
    return path


def _pipelined(path: Path) -> Path:
    return _plan_file(path, devices=4, pp=2)


def _edited(path: Path, edit: Any) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _lending(data: dict[str, Any]) -> None:
    """Lending from blocks recomputed whole, which a plan run does not lend from."""
    first = data["pipeline"]["stages"]["first"]
    first["memory"]["lent"] = 1024.0
    first["recompute"] = dict.fromkeys(first["recompute"], "full")


def _pipemare(data: dict[str, Any]) -> None:
    """PipeMare on sharded units, which it cannot version: a plan of no tidal plan's."""
    data["pipeline"]["schedule"] = "pipemare"
    for stage in data["pipeline"]["stages"].values():
        for unit in stage["units"]:
            unit["zero"] = 3


def _format_1(data: dict[str, Any]) -> None:
    data["format"] = 1


@pytest.mark.parametrize(
    ("plan", "extra", "fragment"),
    [
        ("4 devices", ["--nproc", "2"], "the plan is for 4 devices (dp "),
        ("2 devices", [], "but 1 rank is running; run with --nproc 2"),
        ("missing", ["--nproc", "2"], "no plan file at"),
        ("another model", ["--nproc", "2"], "the plan was made for another model ('demo'"),
        ("pipelined", ["--nproc", "2"], "the plan is for 4 devices (pp 2 x dp "),
        ("an older format", ["--nproc", "2"], "the plan is format 1, written by another version"),
        (
            "lending",
            ["--nproc", "4"],
            "the plan keeps activations of full blocks on the mirror stage's device",
        ),
        ("pipemare", ["--nproc", "4"], "the plan runs pipemare on ZeRO-sharded units"),
    ],
)
def test_a_plan_that_cannot_run_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plan: str, extra: list[str], fragment: str
) -> None:
    path = {
        "4 devices": lambda: _plan_file(tmp_path / "p.json", devices=4),
        "2 devices": lambda: _plan_file(tmp_path / "p.json"),
        "missing": lambda: tmp_path / "nothing.json",
        "another model": lambda: _plan_file(tmp_path / "p.json", model="demo"),
        "pipelined": lambda: _pipelined(tmp_path / "p.json"),
        "an older format": lambda: _edited(_plan_file(tmp_path / "p.json"), _format_1),
        "lending": lambda: _edited(_pipelined(tmp_path / "p.json"), _lending),
        "pipemare": lambda: _edited(_pipelined(tmp_path / "p.json"), _pipemare),
    }[plan]()
    capsys.readouterr()
    run_dir = tmp_path / "run"
    code = main(["train", "--plan", str(path), *extra, *TINY_RUN, "--set", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tidal: error: --plan: "), err
    assert fragment in lines[0]
    assert not (run_dir / "checkpoints").exists()


def test_a_plan_traced_in_another_precision_than_the_run_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plan's activation figures are for the precision it was traced in: a run in another
    warns, naming `tidal plan --precision`; one in the plan's own does not."""
    config = PlannerConfig(pipelines=False, pareto=(), baselines=())
    for dtype, warns in ((torch.bfloat16, True), (torch.float32, False)):
        plan = make_plan(measure_gpt(TINY, micro_batch=4, dtype=dtype), ClusterSpec(devices=1),
                         config).plan  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", logger="tidal.train.plan_stage"):
            Trainer(_job(tmp_path / str(dtype)), plan=plan)
        said = [r.getMessage() for r in caplog.records if "--precision" in r.getMessage()]
        assert bool(said) == warns, said
        assert not warns or "2-byte activations; this run trains in fp32" in said[0], said
