"""``tidal plan`` and ``tidal bench plan`` from the command line (in process)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import warnings

import pytest
import torch

from tidal.cli.args import build_parser
from tidal.cli.main import main
from tidal.cli.plan_command import how_to_train, train_argv
from tidal.models import preset
from tidal.models.gpt import measure_gpt
from tidal.planner import Plan, Recompute
from tidal.planner.plan import Layout, MemoryBreakdown, Offload, StrategyName, UnitChoice
from tidal.train.job import load_job


def test_plan_writes_the_json_the_issue_names(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(
        ["plan", "--model", "demo", "--devices", "16", "--devices-per-node", "8",
         "--device-memory", "80GiB", "--pareto", "0,0.5", "--baselines", "megatron,zero3",
         "--pipeline-pareto", "0,1", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    for key in ("peak_memory_bytes", "step_time_s", "solve_s", "lp_gap", "units", "baselines"):
        assert key in report, key
    assert report["peak_memory_bytes"] <= 80 * 1024**3
    for name in ("megatron", "zero3"):
        assert report["baselines"][name]["peak_memory_bytes"] > 0
        assert report["baselines"][name]["step_time_s"] > 0
    qkv = next(u for u in report["units"] if u["name"] == "blocks.*.attn.qkv")
    # the units shown are the first stage's where the pipelined plan is chosen
    blocks = report["pipeline"]["stages"]["first"]["blocks"] if report["pipeline"] else 4
    assert qkv["count"] == blocks and qkv["memory"]["total"] > 0
    assert len(report["pareto"]) >= 2
    assert [p["eps"] for p in report["pipeline_search"]["pareto"]] == [0.0, 1.0]
    plan = Plan.load(out)  # what `tidal train --plan` reads
    assert plan.pp * plan.dp * plan.tp == 16
    captured = capsys.readouterr()
    printed = captured.out
    assert "blocks.*.mlp.fc" in printed and "megatron" in printed and "LP gap" in printed
    # Issue 17: a practitioner reads it. Runs of a module's own ops are named by their ops, every
    # column has a legend, the time counts the tracing and every mesh, and progress is shown.
    assert "blocks.*[0]: add" in printed and "mlp[0]: gelu" in printed
    assert "zero: its parameter state split over the dp ranks" in printed
    assert "plan saves: 1 - the plan's peak / the baseline's" in printed
    timing = report["timing_s"]
    assert 0 < timing["trace"] < timing["total"] and report["solve_s"] == timing["total"]
    # issue 24: solve_s is the whole command, each phase listed (in a test the process started
    # long before this command, so its "start and imports" is the test session's)
    phases = timing["phases"]
    assert list(phases)[:5] == ["start and imports", "trace", "meshes", "pipelines", "pareto"]
    assert {"baselines", "megatron", "other"} <= set(phases)
    assert sum(phases.values()) == pytest.approx(timing["total"], rel=1e-9)
    assert f"planned in {timing['total']:.1f} s (start and imports" in printed
    assert "tidal plan:" in captured.err and "solving dp 4 x tp 4" in captured.err
    for name, base in report["baselines"].items():  # a negative saving comes with its reason
        if base["saving"] is not None and base["saving"] < 0:
            assert f"{name} holds less" in printed and "the plan spends memory for speed" in printed
    # Issue 24: Megatron-LM at its best, each of its rows beside the plan that compares with it
    best = report["megatron_best"]
    assert best["num_configs"] > 10 and "against Megatron-LM's best of" in printed
    least = best["least_memory"]
    assert least["config"]["tp"] * least["config"]["pp"] * least["config"]["dp"] == 16
    assert best["plan_least_memory"]["peak_memory_bytes"] <= report["peak_memory_bytes"]
    saving = 1 - best["plan_least_memory"]["peak_memory_bytes"] / least["peak_memory_bytes"]
    assert best["plan_least_memory"]["saving"] == pytest.approx(saving)
    if best["fastest"] is not None and best["plan_at_fastest_step_time"] is None:
        assert "no plan, flat or pipelined, is as fast as Megatron-LM" in printed
    # Issue 49: how to train it (the real parser takes the command), and what cannot run yet
    (line,) = [x for x in printed.splitlines() if x.startswith("train it: ")]
    argv = shlex.split(line.removeprefix("train it: ").split(" (on every machine")[0])
    train = build_parser().parse_args(argv[1:])
    assert (train.recipe, train.plan, train.nnodes, train.nproc) == ("demo", str(out), 2, 8)
    job = load_job(train.recipe, train.overrides)
    assert job.engine == "reference" and job.model.preset == "demo"  # the engine plans run on
    if plan.pipeline is None:
        assert job.training.batch_size == plan.micro_batch * plan.dp
        assert job.training.grad_accum_steps == plan.num_microbatches
    else:  # issue 51: the pipelined plan is chosen, and trains
        assert job.training.batch_size == plan.micro_batch * plan.dp * plan.num_microbatches
        assert job.training.grad_accum_steps == 1  # not the recipe's 4
        assert job.num_microbatches != plan.num_microbatches  # the plan sets its pipeline's
    assert "priced, not run by tidal train yet: the pipelined plan" not in printed


def test_every_plan_option_says_what_it_does() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    plan = sub.choices["plan"]
    bare = [a.option_strings for a in plan._actions if not (a.help or "").strip()]
    assert not bare and len(plan._actions) > 20


def test_the_train_command_of_a_plan_and_how_to_save_it() -> None:
    """Without --json the line says to save the plan first; a plan over machines runs on each
    (--nnodes); a one-device plan runs in this process."""
    plan = Plan(model="gpt2-small", devices=16, dp=4, tp=4, micro_batch=2, seq_len=64,
                num_microbatches=3, units=[], recompute={}, memory=MemoryBreakdown(),
                step_time_s=1.0)  # fmt: skip
    args = build_parser().parse_args(["plan", "--model", "gpt2-small", "--devices", "16"])
    line = how_to_train(plan, args)
    assert line.startswith("train it: save it with --json plan.json, then tidal train ")
    argv = shlex.split(line.split(", then ")[1].split(" (on every machine")[0])
    train = build_parser().parse_args(argv[1:])
    assert (train.plan, train.nnodes, train.nproc, train.rdzv_endpoint) == ("plan.json", 2, 8,
                                                                          "HOST:PORT")  # fmt: skip
    assert train.overrides[-2:] == ["training.batch_size=8", "training.grad_accum_steps=3"]
    alone = dataclasses.replace(plan, devices=1, dp=1, tp=1)
    one = train_argv(dataclasses.replace(alone, num_microbatches=1), plan_path="p.json",
                     recipe="tiny", settings=[], devices_per_node=8)  # fmt: skip
    assert one == ["tidal", "train", "--recipe", "tiny", "--plan", "p.json", "--set",
                   "training.batch_size=2", "--set", "training.grad_accum_steps=1"]  # fmt: skip
    # the refusals are check_plan's own (planner.check.not_run): parameters on the host of
    # units that keep their weights whole are priced, not run; of ZeRO-3 units, on any mesh
    part = Offload(optimizer=1.0, params=0.5)
    sharded = UnitChoice(name="fc", module="fc", segment=None, kind="linear",
                         strategy=StrategyName.REPLICATE, in_layout=Layout.R, out_layout=Layout.R,
                         zero=3, count=1, memory=MemoryBreakdown(params=1.0))  # fmt: skip
    for mesh in (plan, alone):
        assert how_to_train(dataclasses.replace(mesh, offload=part, units=[sharded]),
                            args).startswith("train it: ")  # fmt: skip
    whole = dataclasses.replace(sharded, zero=1, memory=MemoryBreakdown(host=1.0))
    assert how_to_train(dataclasses.replace(plan, offload=part, units=[whole]),
                        args).startswith("this plan keeps parameters of units below ZeRO-3 on the "
                                         "host (--offload-params), priced")  # fmt: skip
    disk = how_to_train(dataclasses.replace(plan, offload=Offload(optimizer=1.0, nvme=0.5)), args)
    assert "--set memory.nvme_dir=NVME_DIR" in disk
    assert disk.endswith("NVME_DIR a folder on the node's NVMe drive)")


def test_plan_bad_input_is_one_line_and_exit_2(capsys) -> None:
    assert main(["plan", "--model", "gpt5", "--devices", "8"]) == 2
    assert "unknown preset 'gpt5'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt3-13b", "--devices", "8", "--tp", "3"]) == 2
    assert "tp: 3 does not split" in capsys.readouterr().err
    args = ["plan", "--model", "gpt3-13b", "--devices", "8", "--device-memory", "2GiB"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no plan fits in 2.00GiB per device: the least any plan needs is" in err


def test_plan_with_the_optimizer_on_the_host_says_so(tmp_path, capsys) -> None:
    """--offload: at 1 MiB a device only a plan with its optimizer on the host fits; the line
    says so and the JSON records it, and the line after says how to train it."""
    args = ["plan", "--model", "tiny", "--devices", "2", "--device-memory", "1MiB",
            "--pareto", "", "--baselines", "", "--json", str(tmp_path / "p.json")]  # fmt: skip
    assert main(args) == 2  # nothing fits without offload
    assert "no plan fits in 1.00MiB per device" in capsys.readouterr().err
    assert main([*args, "--offload", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "with 100% of the optimizer on the host (" in out
    assert f"train it: tidal train --recipe tiny --plan {tmp_path / 'p.json'} --nproc 2" in out
    (priced,) = [x for x in out.splitlines() if x.startswith("priced, not run by tidal train")]
    assert "host" not in priced
    plan = Plan.load(tmp_path / "p.json")
    assert plan.offload == Offload(optimizer=1.0) and plan.memory.host > 0
    assert plan.peak_memory_bytes <= 1024**2
    assert main(["plan", "--model", "tiny", "--devices", "2", "--offload", "0,x"]) == 2
    assert "--offload: expected numbers" in capsys.readouterr().err
    # the parameters too, and the optimizer state on a disk the nodes have
    disk = [*args, "--offload", "1", "--offload-params", "1", "--nvme", "1GiB", "--device-memory",
            "400KiB"]  # fmt: skip
    assert main(disk) == 0
    out = capsys.readouterr().out
    assert "with 100% of the optimizer on the host, 100% of the parameters" in out
    plan = Plan.load(tmp_path / "p.json")
    assert plan.offload.params == 1.0 and plan.peak_memory_bytes <= 400 * 1024
    assert main([*args, "--offload", "0.5", "--offload-params", "1"]) == 2
    assert "offload_params: each of (1.0,) exceeds every optimizer fraction" in (
        capsys.readouterr().err
    )


def test_swap_reaches_the_search_only_when_asked(tmp_path, monkeypatch) -> None:
    """--swap adds the host swap to the blocks' modes the search chooses among, whole and by
    class of tensor; without it the search never sees it ([Note: activations on the host] in
    tidal/planner/ilp.py, [Note: savers per tensor class] in tidal/planner/block_savers.py)."""
    import tidal.planner as planner

    seen = []
    real = planner.make_plan

    def spy(graph, cluster, config, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(config.recompute)
        return real(graph, cluster, config, **kwargs)

    monkeypatch.setattr(planner, "make_plan", spy)
    args = ["plan", "--model", "tiny", "--devices", "2", "--pareto", "", "--baselines", "",
            "--json", str(tmp_path / "p.json")]  # fmt: skip
    assert main(args) == 0 and main([*args, "--swap"]) == 0
    without, with_swap = seen
    assert Recompute.SWAP not in without and Recompute.SWAP in with_swap
    assert set(with_swap) - set(without) == {Recompute.SWAP, Recompute.SWAP_ATTENTION,
                                             Recompute.SWAP_MLP, Recompute.SELECTIVE_SWAP_MLP}  # fmt: skip


def test_bench_plan_writes_results(tmp_path, capsys) -> None:
    args = ["bench", "plan", "--models", "demo", "--devices", "8", "--results-dir"]
    assert main([*args, str(tmp_path)]) == 0
    (path,) = tmp_path.glob("plan-*.json")
    data = json.loads(path.read_text())
    assert data["bench"] == "plan" and data["git_commit"] and data["torch_version"]
    (row,) = data["rows"]
    assert row["model"] == "demo" and row["devices"] == 8
    assert set(row["baselines"]) == {
        "megatron",
        "megatron_sp",
        "zero3",
        "zero3_full",
        "zero3_offload",
        "fsdp2_cpu_offload",  # zero_infinity: only where the nodes have a disk
    }
    best = row["megatron_best"]
    assert best["least_memory"]["peak_memory_bytes"] > 0
    # issue 24: the frontiers of the plot; each is memory falling as the step time grows
    for frontier in (row["pareto"], row["pipeline"]["pareto"], best["frontier"]):
        assert len(frontier) >= 2, frontier
        ordered = sorted(frontier, key=lambda p: p["step_time_s"])
        peaks = [p["peak_memory_bytes"] for p in ordered]
        assert peaks == sorted(peaks, reverse=True)
    assert best["frontier"][-1]["peak_memory_bytes"] == best["least_memory"]["peak_memory_bytes"]
    printed = capsys.readouterr().out
    assert f"results: {path}" in printed and "against Megatron-LM at its best" in printed
    png = path.with_suffix(".png")
    assert f"plot: {png}" in printed and png.stat().st_size > 10_000


def _hf_configs(root) -> dict[str, object]:
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(root / "llama")  # fmt: skip
    transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64
    ).save_pretrained(root / "gpt2")
    transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1).save_pretrained(
        root / "bert"
    )
    return {"llama": root / "llama", "gpt2": root / "gpt2" / "config.json", "bert": root / "bert"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plan_takes_a_hugging_face_config(tmp_path, capsys, family: str) -> None:
    """A folder holding config.json, or the file: measured, planned, and a plan apply takes."""
    from tidal.models.hf import HFModelConfig, build_hf
    from tidal.parallel.plan_layout import check_plan_fits
    from tidal.planner.check import check_plan

    path = _hf_configs(tmp_path)[family]
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(path), "--devices", "4", "--eps", "1000", "--seq-len", "32"]
    args += ["--pareto", "", "--json", str(out)]
    assert main([*args, "--pp", "2", "--baselines", ""]) == 0
    piped = Plan.load(out)
    model = build_hf(HFModelConfig.load(path, seq_len=32, key="--model"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check_plan_fits(piped, model, world_size=4, seq_len=32)  # each stage on its part
    assert main([*args, "--pp", "1", "--baselines", "megatron_sp"]) == 0
    plan = Plan.load(out)
    assert plan.dp * plan.tp == 4 and plan.seq_len == 32
    assert set(plan.recompute.values()) <= {"none", "full"}  # HF cores do not recompute alone
    heads = {"llama": "model.layers.*.self_attn[2]", "gpt2": "transformer.h.*.attn[0]"}[family]
    assert plan.unit(heads).count == 2
    with warnings.catch_warnings():  # a detour into the first block is allowed, and said
        warnings.simplefilter("ignore", UserWarning)
        check_plan(model, plan)  # the planner's HF plans are ones apply can carry out
    report = json.loads(out.read_text())
    assert report["baselines"]["megatron_sp"]["peak_memory_bytes"] > 0
    assert report["megatron_best"]["least_memory"]["peak_memory_bytes"] > 0
    assert heads in capsys.readouterr().out


@pytest.mark.parametrize(
    ("model", "extra", "fragment"),
    [
        ("missing", [], "--model: no Hugging Face config at "),
        ("bert", [], "is a 'bert' model; tidal plans and trains Hugging Face 'llama' and 'gpt2'"),
        ("llama", ["--tp", "4"], "has 4 heads and 2 key/value heads; choose one of 1, 2"),
        ("llama", ["--seq-len", "65"], "--seq-len: 65 is longer than the 64 positions"),
    ],
)
def test_plan_bad_hugging_face_input_is_one_line_and_exit_2(
    tmp_path, capsys, model: str, extra: list[str], fragment: str
) -> None:
    paths = _hf_configs(tmp_path)
    capsys.readouterr()  # transformers' own warnings on writing the configs (once a process)
    path = paths.get(model, tmp_path / "nothing" / "config.json")
    assert main(["plan", "--model", str(path), "--devices", "4", *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tidal: error: ") and fragment in lines[0]


def test_a_plan_holding_more_than_megatrons_best_says_why() -> None:
    """Issue 24: a plan that spends more memory than a baseline says why; for Megatron-LM at its
    best, that matching its speed costs memory, and whether any plan reaches that speed."""
    from tidal.cli.plan import _why_more_memory

    fastest = {"name": "t4 p16 d1", "step_time_s": 5.69, "peak_memory_bytes": 70 * 1024**3}
    same = {"layout": "p8 x dp 2 x tp 4", "peak_memory_bytes": 78 * 1024**3, "saving": -0.11}
    report = {"baselines": {}, "megatron_best": {"fastest": fastest,
                                                 "plan_at_fastest_step_time": same}}  # fmt: skip
    (line,) = _why_more_memory(report)
    assert "the smallest plan (p8 x dp 2 x tp 4) holds 78.00 GiB, more than its 70.00" in line
    report["megatron_best"]["plan_at_fastest_step_time"] = None
    (line,) = _why_more_memory(report)
    assert line.startswith("no plan, flat or pipelined, is as fast as Megatron-LM's fastest")
    report["megatron_best"]["plan_at_fastest_step_time"] = {**same, "saving": 0.2}
    assert _why_more_memory(report) == []


def test_bench_plan_largest_model_that_fits(tmp_path, capsys) -> None:
    """Issue 24: the most layers whose least-memory configuration fits, for tidal (with and
    without the optimizer on the host) and for Megatron-LM's grid; one more layer does not fit
    tidal's plans (checked here)."""
    args = ["bench", "plan", "--largest", "--models", "tiny", "--devices", "2",
            "--device-memory", "8MiB", "--results-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (path,) = tmp_path.glob("plan-largest-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["tidal_layers"] >= 1 and row["megatron_layers"] >= 1
    assert row["ratio"] == pytest.approx(row["tidal_params"] / row["megatron_params"])
    from tidal.models import PRESETS
    from tidal.models.gpt import measure_gpt
    from tidal.planner import ClusterSpec, Infeasible, PlannerConfig, make_plan
    from tidal.planner.pipelines import stage_graph

    graph = measure_gpt(dataclasses.replace(PRESETS["tiny"], dropout=0.1), micro_batch=1)
    cluster = ClusterSpec(devices=2, device_memory_bytes=8 * 1024**2)
    config = PlannerConfig(pareto=(), baselines=(), pipelines=False)
    layers = row["tidal_layers"]
    make_plan(stage_graph(graph, blocks=layers, first=True, last=True), cluster, config)
    with pytest.raises(Infeasible):
        make_plan(stage_graph(graph, blocks=layers + 1, first=True, last=True), cluster, config)
    # the optimizer state on the host makes room for more ([Note: model data offload]); one
    # more layer does not fit that either
    assert row["tidal_offload_layers"] > layers
    assert row["offload_plan"]["offload"]["optimizer"] == 1.0
    assert row["offload_plan"]["host_bytes_per_device"] > 0
    # ... set beside Megatron-LM's grid with its optimizer on the CPU too
    assert row["megatron_offload_layers"] >= row["megatron_layers"]
    assert row["offload_ratio"] == pytest.approx(
        row["tidal_offload_params"] / row["megatron_offload_params"]
    )
    offloading = dataclasses.replace(config, offload=(0.0, 1.0), offload_params=(0.0, 1.0))
    with pytest.raises(Infeasible):
        blocks = row["tidal_offload_layers"] + 1
        make_plan(stage_graph(graph, blocks=blocks, first=True, last=True), cluster, offloading)
    printed = capsys.readouterr().out
    assert "the largest model whose least-memory configuration fits" in printed


def test_the_plan_near_megatrons_fastest_step_time(tmp_path) -> None:
    """Issue 24's comparison, GPT-3 13B on 8 devices (tensor axis 2, to keep it short; 175B on
    64 is `tidal bench plan`'s): the smallest plan within 5% of Megatron-LM's fastest fitting
    step time, its saving against that configuration, and no larger than the smallest at that
    step time itself."""
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt3-13b", "--devices", "8", "--tp", "2", "--pareto", "",
            "--baselines", "", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    best = json.loads(path.read_text())["megatron_best"]
    near, same = best["plan_near_fastest_step_time"], best["plan_at_fastest_step_time"]
    assert best["slack"] == 0.05 and near is not None
    assert 1.0 < near["step_time_ratio"] <= 1.05 * (1 + 1e-6)
    fastest = best["fastest"]["peak_memory_bytes"]
    assert near["saving"] == pytest.approx(1 - near["peak_memory_bytes"] / fastest)
    assert near["saving"] > 0 and near["layout"].startswith("p")  # a pipelined plan
    assert same is None or near["peak_memory_bytes"] <= same["peak_memory_bytes"] * (1 + 1e-6)
    # Megatron's own least memory within the same slack: no larger than its fastest's, and the
    # plan's saving against it the smaller one
    mine = best["near_fastest"]
    assert mine["fits"] and mine["step_time_s"] <= 1.05 * best["fastest"]["step_time_s"] * (
        1 + 1e-9
    )
    assert mine["peak_memory_bytes"] <= fastest
    against = best["plan_near_its_near_fastest"]
    assert against["saving"] == pytest.approx(
        1 - near["peak_memory_bytes"] / mine["peak_memory_bytes"]
    )
    assert against["saving"] <= near["saving"] + 1e-12


def test_plan_in_fp32_prices_fp32_and_its_command_trains_in_fp32(tmp_path, capsys) -> None:
    """--precision fp32 traces the model in fp32 (activations twice bf16's), prices fp32 AdamW
    (4 + 4 + 8 bytes a parameter), records it, and the command it prints trains in fp32."""
    base = ["plan", "--model", "tiny", "--devices", "1", "--pareto", "", "--baselines", ""]
    plans = {}
    for precision in ("bf16", "fp32"):
        path = tmp_path / f"{precision}.json"
        assert main([*base, "--precision", precision, "--json", str(path)]) == 0
        out = capsys.readouterr().out
        (line,) = [x for x in out.splitlines() if x.startswith("train it:")]
        assert ("training.precision=fp32" in line) == (precision == "fp32"), line
        plans[precision] = Plan.load(path)
    bf16, fp32 = plans["bf16"], plans["fp32"]
    assert (bf16.activation_element_bytes, fp32.activation_element_bytes) == (2, 4)
    # traced in fp32, the model's units save twice the bytes (the loss's fp32 logits aside)
    graphs = {p: measure_gpt(preset("tiny"), dtype=d)
              for p, d in (("bf16", torch.bfloat16), ("fp32", torch.float32))}  # fmt: skip
    saved = {p: sum(u.saved_bytes * u.count for u in g.units) for p, g in graphs.items()}
    assert 1.7 * saved["bf16"] < saved["fp32"] < 2 * saved["bf16"], saved
    assert (graphs["bf16"].element_bytes, graphs["fp32"].element_bytes) == (2, 4)
    # model data: fp32 AdamW's 16 bytes a parameter (4 + 4 + 8), bf16's (2 + 2 + 12) alike
    data = {k: p.memory.params + p.memory.grads + p.memory.optimizer for k, p in plans.items()}
    assert data["fp32"] == pytest.approx(data["bf16"], rel=0.01), data
    with pytest.raises(SystemExit) as refused:  # argparse's choices: one line, exit 2
        main([*base, "--precision", "fp16"])
    assert refused.value.code == 2 and "--precision" in capsys.readouterr().err
