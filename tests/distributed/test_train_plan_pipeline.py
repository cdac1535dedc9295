"""``tidal train --plan`` on pipelined plans ([Note: planned pipeline stages] in
tidal/train/plan_stage.py): plans ``tidal plan`` makes for a tiny GPT (dropout 0) on 4 devices
train on 4 gloo ranks as one process does.

- ``pp2-dp2``: two stages of two data-parallel ranks (``--pp 2 --tp 1``): the planner's ZeRO
  levels and recomputation per stage;
- ``pp2-tp2``: two stages of two tensor-parallel ranks (``--pp 2 --tp 2``, a large ``--eps`` so
  that it splits): sequence parallelism, so the stream crosses the stage boundary split along
  the sequence, a vocabulary-split embedding and a loss on split logits;
- ``pp2-v2``: the same GPT with four blocks, interleaved (``v = 2``): each rank holds two model
  chunks, neither of which is the first or the last stage on both;
- ``pp2-tp2-swap``: eight blocks on tensor-parallel stages whose blocks keep what they save on
  the host (MPress's host swap, which the search picks where a fast host link hides it), a
  stage's whole blocks' or one class of it ([Note: savers per tensor class] in
  tidal/planner/block_savers.py: the search takes the MLP's alone on one stage);
- ``pp2-dp2-offload``: all of the model data on the host, every unit ZeRO-3: FSDP2's CPU
  offload on every group of every stage;
- ``pp2-dp2-nvme``: half of each rank's optimizer updated on the host and half of that kept on
  NVMe ([Note: the optimizer on the host] in tidal/runtime/host_optimizer.py);
- ``pp2-dp2-part``: all of the optimizer on the host and half of the parameters: FSDP2's CPU
  offload on the groups nearest half, the host optimizer updating them in place and the rest
  beside them;
- ``pp2-dp2-pipemare``: PipeMare (``--schedules pipemare``), asynchronous, on the stages it
  can version ([Note: PipeMare plans] in tidal/planner/pipelines.py): every unit whole on each
  data rank, nothing recomputed; it must equal the hand-written pp2 x dp2 mesh under PipeMare
  (its delays and discrepancy correction alike);
- ``pp2-dp2-peer``: MPress's peer swap (``--peer``) on four blocks under a device limit that
  only lending meets: the first stage keeps one block's saved activations on its mirror's
  devices ([Note: lending in plan runs] in tidal/train/plan_lending.py);
- ``pp2-dp2-stages``: each stage its own offload ([Note: offload per stage] in
  tidal/planner/pipelines.py): on devices of 0.97 MiB the fastest plan keeps the first stage on
  the device and half of the last stage's optimizer on the host;
- ``pp2-dp2-chunks``: all of the model data on the host, ``--model-data auto``: each stage's in
  tidal's chunks under the plan's device budget, ZeRO-3 over its two data ranks ([Note: chunk
  stages in plans] in tidal/planner/model_data.py). The other cases' are FSDP2's (the default).

Losses, gradient norms, validation losses and the checkpointed parameters (whole, in the
one-process layout) must equal a one-process run's (PipeMare's: the hand-written mesh's); a ``pp2-tp2`` run stopped at step 2
resumes without a plan (the one checkpoint format) as the unbroken run goes on. One spawn of 4
ranks runs every case.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tidal.cli.main import main
from tidal.models import preset
from tidal.models.gpt import measure_gpt
from tidal.planner import ClusterSpec, Plan, PlannerConfig, Recompute, StrategyName, make_plan
from tidal.planner.block_savers import HOST_MODES
from tidal.planner.plan import Layout, Offload
from tidal.runtime.shares import local
from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.checkpoint import latest_checkpoint, load_model_state
from tidal.train.metrics import read_metrics
from tidal.train.plan_lending import LentParts, lent_parts

WORLD = 4
STEPS = 3
TOL = 1e-5
MEMORY_TOL = 0.10  # the bound on what the runtime meters
FP32 = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
CASES = (
    "pp2-dp2", "pp2-tp2", "pp2-v2", "pp2-tp2-swap", "pp2-dp2-offload", "pp2-dp2-nvme",
    "pp2-dp2-part", "pp2-dp2-stages", "pp2-dp2-pipemare", "pp2-dp2-peer", "pp2-dp2-chunks",
)  # fmt: skip
HOSTED = {"pp2-dp2-nvme": (0, 1), "pp2-dp2-part": (0, 1), "pp2-dp2-stages": (1,)}  # pp ranks
LAYERS = {"pp2-v2": 4, "pp2-tp2-swap": 8, "pp2-dp2-peer": 4}  # the others: the tiny GPT's 2
# the run each case must equal: one process without a pipeline for a synchronous schedule;
# for PipeMare, whose stale weights depend on the pipeline, the hand-written mesh of the same
# pipeline on the same 4 ranks (plain replicas of each stage)
PIPEMARE = {"pipeline": {"schedule": "pipemare", "microbatches": 2, "partition": "even"},
            "parallel": {"pp": 2, "dp": 2}}  # fmt: skip
REFERENCES = {"pp2-dp2-pipemare": "reference-pipemare"}

JOB: dict[str, Any] = {
    "name": "plan-pipeline",
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "synthetic_num_tokens": 20_000},
    "training": {
        "steps": STEPS,
        "batch_size": 4,  # the plans' global batch: one sequence a device
        "device": "cpu",
        "log_every": 1,
        "val_every": 2,
        "val_batches": 1,
    },
    "optimizer": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS, "eps": 1e-6},
    "checkpoint": {"every_steps": 2},
    "metrics": {"peak_tflops": 1.0},
}


def _job(run_dir: Path, *, layers: int = 2, **training: Any) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["run_dir"] = str(run_dir)
    job["model"]["num_layers"] = layers
    job["training"].update(training)
    return job


def _from_the_command_line(path: Path, *flags: str) -> Plan:
    argv = ["plan", "--model", "tiny", "--devices", str(WORLD), "--dropout", "0", "--pp", "2"]
    assert main([*argv, *flags, "--pareto", "", "--baselines", "", "--json", str(path)]) == 0
    return Plan.load(path)


def _made(*, layers: int, cluster: ClusterSpec | None = None, **config: Any) -> Plan:
    """``make_plan`` (what ``tidal plan`` calls) priced for the run's fp32 AdamW: 4 bytes a
    weight and a gradient, 8 of optimizer state, so that its memory can be held to the run's."""
    model = dataclasses.replace(preset("tiny"), num_layers=layers, dropout=0.0)
    planner = PlannerConfig(pp=2, pareto=(), baselines=(), **FP32, **config)
    cluster = cluster or ClusterSpec(devices=WORLD)
    return make_plan(measure_gpt(model, micro_batch=1), cluster, planner).plan


def _lending() -> Plan:
    """The fastest plan without recomputation on devices of 98% of what the first stage of
    the best such plan holds without lending (the last stage holds less): it lends."""
    config: dict[str, Any] = {"tp": 1, "objective": "time", "recompute": (Recompute.NONE,)}
    alone = _made(layers=4, **config).pipeline
    assert alone is not None
    first, last = (alone.stages[k].memory.total for k in ("first", "last"))
    assert last < 0.98 * first, (first, last)
    cluster = ClusterSpec(devices=WORLD, device_memory_bytes=int(0.98 * first))
    return _made(layers=4, cluster=cluster, peer=True, **config)


def _cases(root: Path) -> dict[str, Plan]:
    cases = {
        "pp2-dp2": _made(layers=2, tp=1, eps=10.0),
        "pp2-tp2": _from_the_command_line(root / "pp2-tp2.json", "--tp", "2", "--eps", "1000"),
        "pp2-v2": _made(layers=4, tp=1, schedules=("interleaved",)),
        # MPress's host swap, searched (tidal plan --swap) where a fast host link hides it
        "pp2-tp2-swap": _made(
            layers=8,
            tp=2,
            objective="time",
            recompute=tuple(Recompute),
            cluster=ClusterSpec(devices=WORLD, host_link_bandwidth=1e14),
        ),
        # all of the model data on the host (tidal plan --offload 1 --offload-params 1)
        "pp2-dp2-offload": _made(layers=2, tp=1, offload=(1.0,), offload_params=(1.0,)),
        # half the optimizer on the host, half of that on NVMe (--offload 0.5 --nvme ...)
        "pp2-dp2-nvme": _made(
            layers=2,
            tp=1,
            offload=(0.5,),
            offload_nvme=(0.5,),
            cluster=ClusterSpec(devices=WORLD, nvme_bytes_per_node=2**40),
        ),
        # half the parameters on the host (--offload 1 --offload-params 0.5)
        "pp2-dp2-part": _made(layers=2, tp=1, offload=(1.0,), offload_params=(0.5,)),
        # lending to the mirror stage (--peer), where nothing else fits
        "pp2-dp2-peer": _lending(),
        # all of it on the host, in chunks (tidal plan --model-data auto)
        "pp2-dp2-chunks": _made(
            layers=2, tp=1, offload=(1.0,), offload_params=(1.0,), model_data="auto"
        ),  # fmt: skip
        # asynchronous (--schedules pipemare)
        "pp2-dp2-pipemare": _made(layers=2, tp=1, schedules=("pipemare",)),
        # each stage its own (--offload 0,0.5 --objective time on devices of 0.97 MiB)
        "pp2-dp2-stages": _made(
            layers=2,
            tp=1,
            objective="time",
            offload=(0.0, 0.5),
            cluster=ClusterSpec(devices=WORLD, device_memory_bytes=int(0.97 * 2**20)),
        ),
    }
    # What each case is there for: a planner that changes its choices should not go unnoticed.
    for plan in cases.values():
        assert plan.pp == 2 and plan.pipeline is not None
    assert {u.zero for u in cases["pp2-dp2"].units} - {0}, "some ZeRO sharding"
    tp2 = cases["pp2-tp2"].pipeline
    assert tp2 is not None
    last = {u.name: u for u in tp2.stages["last"].units}
    assert last["blocks.*[1]"].out_layout is Layout.SEQ  # the stream crosses split
    assert last["blocks.*.attn.qkv"].strategy is StrategyName.COLWISE
    v2 = cases["pp2-v2"].pipeline
    assert v2 is not None and v2.virtual_stages == 2 and v2.schedule == "interleaved"
    swap = cases["pp2-tp2-swap"].pipeline
    assert swap is not None and cases["pp2-tp2-swap"].tp == 2
    modes = {c.recompute["blocks.*"] for c in swap.stages.values()}
    assert modes <= set(HOST_MODES) and Recompute.SWAP_MLP in modes, modes
    offload = cases["pp2-dp2-offload"]
    assert offload.offload.params == 1.0 and offload.dp == 2 and offload.pipeline is not None
    assert {u.zero for c in offload.pipeline.stages.values() for u in c.units
            if u.kind in ("linear", "embedding", "norm")} == {3}  # fmt: skip
    nvme = cases["pp2-dp2-nvme"]
    assert (nvme.offload.optimizer, nvme.offload.nvme, nvme.dp) == (0.5, 0.5, 2)
    part = cases["pp2-dp2-part"]
    assert (part.offload.optimizer, part.offload.params, part.dp) == (1.0, 0.5, 2)
    stages = cases["pp2-dp2-stages"]
    assert stages.offloads() == [Offload(), Offload(optimizer=0.5)] and stages.dp == 2
    peer = cases["pp2-dp2-peer"]
    assert peer.pipeline is not None and peer.pipeline.stages["first"].memory.lent > 0
    # the plan lends 60% of a block's saved bytes: the MLP's 55% comes nearer than a block
    parts, lent = lent_parts(peer, 0), peer.pipeline.stages["first"].memory.lent
    assert (parts.blocks, parts.child, lent_parts(peer, 1)) == (0, "mlp", LentParts())
    assert abs(parts.priced_bytes - lent) < 0.1 * lent
    chunked = cases["pp2-dp2-chunks"]
    assert [chunked.rank_chunks(r) is not None for r in (0, 1)] == [True, True]
    assert all(p.rank_chunks(r) is None for n, p in cases.items() if n != "pp2-dp2-chunks"
               for r in (0, 1))  # fmt: skip
    pipemare = cases["pp2-dp2-pipemare"]
    assert pipemare.pipeline is not None and pipemare.pipeline.schedule == "pipemare"
    assert (pipemare.dp, pipemare.tp, pipemare.num_microbatches) == (2, 1, 2)
    assert {u.zero for c in pipemare.pipeline.stages.values() for u in c.units} == {0}
    return cases


# -- what each rank runs ---------------------------------------------------------------------------


def _train_cases(cases: dict[str, Plan], root: Path) -> dict[str, Any]:
    results = {}
    for name, plan in cases.items():
        job = _job(root / name / "whole", layers=LAYERS.get(name, 2))
        if any(o.nvme for o in plan.offloads()):
            job["memory"] = {"nvme_dir": str(root / name / f"nvme-{dist.get_rank()}")}
        trainer = Trainer(job, plan=plan)
        trainer.fit()
        figures = trainer.part.summary_figures()
        results[name] = {
            "optimizers": sorted(
                {type(w.optimizer).__name__ for w in trainer.engine.weights.values()}
            ),  # fmt: skip
            "host_optimizer": figures.get("host_optimizer_bytes"),
            # the largest AdamW state of one parameter the host updates: the split's granule
            "granule": max(
                [
                    2 * local(p).nbytes
                    for w in trainer.engine.weights.values()
                    for p in getattr(w.optimizer, "on_host", [])
                ],
                default=0,
            ),
            "offloaded": _offload_policies(trainer),
            "host_swap_bytes": figures.get("host_swap_bytes", 0),
            "holders": sorted({type(w).__name__ for w in trainer.engine.weights.values()}),
            "stages": sorted(trainer.engine.weights),
            "step": trainer.engine.step,
            "model_data": figures["model_data_bytes"],
            "lent_bytes": trainer.part.memory.counters()["lent_bytes"],
            "chunk_stages": figures["pipeline"]["chunk_stages"],
        }
    Trainer({**_job(root / "reference-pipemare"), **PIPEMARE}).fit()
    # stopped after step 2, then resumed without a plan: dp 4 plain replicas
    Trainer(_job(root / "resumed", steps=2), plan=cases["pp2-tp2"]).fit()
    if dist.get_rank() == 0:
        shutil.copytree(root / "resumed", root / "without-plan")
    dist.barrier()
    Trainer(_job(root / "without-plan")).fit(resume=True)
    return results


def _offload_policies(trainer: Trainer) -> list[str]:
    """The offload policy of every FSDP2 group of this rank's stages, by its class's name."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for held in trainer.engine.weights.values():
        for module in held.module.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    found.append(type(group.offload_policy).__name__)
    return found


# -- the tests -------------------------------------------------------------------------------------


def _records(run_dir: Path, kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipelined-plans")
    cases = _cases(root)
    ranks = run_on_ranks(_train_cases, world_size=WORLD, args=(cases, root), timeout_s=400)
    for layers in {2, *LAYERS.values()}:
        Trainer(_job(root / f"reference-{layers}", layers=layers)).fit()
    return {"root": root, "cases": cases, "ranks": ranks}


def _same_run(got: Path, want: Path) -> None:
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("val", "val_loss")):
        mine, theirs = _records(got, kind, key), _records(want, kind, key)
        assert [s for s, _ in mine] == [s for s, _ in theirs], (kind, key)
        if any(v is None for _, v in theirs):  # an asynchronous schedule has no global norm
            assert mine == theirs, (kind, key)
            continue
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=TOL, rel=0)
    state, want_state = (load_model_state(latest_checkpoint(d)) for d in (got, want))
    assert state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_a_pipelined_plan_trains_as_one_process_does(runs: dict[str, Any], case: str) -> None:
    root = runs["root"]
    reference = root / REFERENCES.get(case, f"reference-{LAYERS.get(case, 2)}")
    _same_run(root / case / "whole", reference)
    losses = _records(reference, "train", "loss")
    assert losses[-1][1] != pytest.approx(losses[0][1], abs=1e-3), "training must move"
    summary = json.loads((root / case / "whole" / "summary.json").read_text())
    plan = runs["cases"][case]
    assert summary["engine"] == "plan" and summary["mesh"] == f"pp 2 x dp {plan.dp} x tp {plan.tp}"
    stages = plan.pipeline.pp * plan.pipeline.virtual_stages
    held = [rank[case]["stages"] for rank in runs["ranks"]]
    assert sorted(s for stages_here in held for s in stages_here) == sorted(
        s for s in range(stages) for _ in range(plan.dp * plan.tp)
    )  # every stage on each of its dp x tp ranks, and only there
    for r, rank in enumerate(runs["ranks"]):
        holder = "ChunkStageParams" if case == "pp2-dp2-chunks" else "PlanStageWeights"
        assert rank[case]["holders"] == [holder] and rank[case]["step"] == STEPS
        # the swap moved what the blocks saved, on every rank, and nothing elsewhere
        assert (rank[case]["host_swap_bytes"] > 0) == (case == "pp2-tp2-swap")
        # FSDP2's CPU offload holds every group of the offloading plan, and no other plan's
        policies = set(rank[case]["offloaded"])
        assert (policies == {"CPUOffloadPolicy"}) == (case == "pp2-dp2-offload"), policies
        # half the parameters: some groups offloaded, some not, on every rank
        mixed = {"CPUOffloadPolicy", "OffloadPolicy"}
        assert (policies == mixed) == (case == "pp2-dp2-part"), policies
        # the first stage's ranks lend (to the mirror's), and only in the lending plan
        pp_rank = r // (plan.dp * plan.tp)
        lends = case == "pp2-dp2-peer" and pp_rank == 0
        assert (rank[case]["lent_bytes"] > 0) == lends, (r, rank[case]["lent_bytes"])
        if lends:  # each micro-batch lends what the MLP saves, as its units are priced
            each = rank[case]["lent_bytes"] / (STEPS * plan.num_microbatches)
            priced = lent_parts(plan, 0).priced_bytes
            assert each == pytest.approx(priced, rel=MEMORY_TOL), (r, each, priced)
        # the host's share of the optimizer is the host optimizer's, on those ranks alone
        hosted = rank[case]["optimizers"] == ["HostStepped"]
        assert hosted == (pp_rank in HOSTED.get(case, ())), (r, rank[case]["optimizers"])


def test_a_pipelined_plan_runs_checkpoint_resumes_without_a_plan(runs: dict[str, Any]) -> None:
    root = runs["root"]
    _same_run(root / "without-plan", root / "pp2-tp2" / "whole")


@pytest.mark.parametrize("case", ["pp2-dp2", "pp2-v2", "pp2-dp2-stages"])
def test_each_ranks_model_data_is_what_the_plan_predicts(runs: dict[str, Any], case: str) -> None:
    """What a rank's stages hold after a step, as the runtime meters it, within 10% of the
    cost model's figures for its pipeline rank: AdamW's state (its shards), and the parameters
    where every unit is ZeRO-3 (sharded at rest as at the peak; ZeRO-1 and -2 units hold
    their weights whole from forward to backward, which the plan counts and a rest between
    steps does not show). The gradients are freed by then. With each stage its own offload,
    the device's share of the optimizer state is its rank's."""
    plan = runs["cases"][case]
    sharded = all(u.zero == 3 for c in plan.pipeline.stages.values() for u in c.units
                  if u.memory.params)  # fmt: skip
    assert sharded == (case == "pp2-dp2")  # what each case is there for
    for rank, held in enumerate(runs["ranks"]):
        figures, pp_rank = held[case]["model_data"], rank // (plan.dp * plan.tp)
        predicted = plan.rank_memory(pp_rank)
        checked = [("optimizer", "optimizer_state"), *([("params", "params")] if sharded else [])]
        for kind, key in checked:
            want = getattr(predicted, kind)
            assert figures[key] == pytest.approx(want, rel=MEMORY_TOL), (case, rank, kind, figures)


def test_chunk_stages_hold_the_plans_device_bytes(runs: dict[str, Any]) -> None:
    """Each rank's chunk store under its pipeline rank's budget, the plan's predicted peak, and
    within 10% of it at its own peak (the store meters its chunks and the activations, as the
    plan counts them); the model data went through the host (its parameters and optimizer
    state are there by the plan) and was sharded over the two data ranks."""
    plan = runs["cases"]["pp2-dp2-chunks"]
    for rank, held in enumerate(runs["ranks"]):
        pp_rank = rank // plan.dp
        (figures,) = held["pp2-dp2-chunks"]["chunk_stages"].values()
        budgets = plan.rank_chunks(pp_rank)
        assert budgets is not None and figures["device_budget"] == budgets.device_bytes
        predicted = plan.rank_memory(pp_rank).total
        assert budgets.device_bytes == pytest.approx(predicted, abs=1)
        peak = figures["peak_device_bytes"]
        assert (1 - MEMORY_TOL) * predicted <= peak <= predicted, (rank, peak, predicted)
        assert figures["bytes_to_host"] > 0 and figures["evictions"] > 0, (rank, figures)
        assert figures["bytes_reduce_scattered"] > 0, (rank, figures)


def test_the_optimizer_on_the_host_and_nvme_holds_what_the_plan_predicts(
    runs: dict[str, Any],
) -> None:
    """Of each rank's AdamW state, the device's (half) and the host's (half, in its memory and
    on NVMe together) within 10% of the plan's figures for its pipeline rank; the split between
    host memory and NVMe (a quarter each) within one parameter's state, the granule the
    runtime splits by ([Note: the optimizer on the host])."""
    plan = runs["cases"]["pp2-dp2-nvme"]
    for rank, held in enumerate(runs["ranks"]):
        case = held["pp2-dp2-nvme"]
        figures, host, granule = case["model_data"], case["host_optimizer"], case["granule"]
        predicted = plan.rank_memory(rank // plan.dp)
        assert figures["optimizer_state"] == pytest.approx(predicted.optimizer, rel=MEMORY_TOL)
        # nvme = 1/2 of what the host updates, so what stays in its memory is as much
        on_host = host["state"] + host["nvme"]
        assert on_host == pytest.approx(2 * predicted.nvme, rel=MEMORY_TOL), (rank, host)
        assert 0 < granule < on_host
        assert abs(host["nvme"] - predicted.nvme) <= granule, (rank, host, granule)
        assert abs(host["state"] - predicted.nvme) <= granule, (rank, host, granule)
        assert host["masters"] == 0  # staged at each step from the device's share only
