"""``tidal bench mpress`` on a small GPT family: the JSON and table, and what the planner must
at least match (predicted figures; [Note: what the bench predicts] in benchmarks/mpress.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.mpress import STRATEGIES
from benchmarks.mpress_zero3 import ZERO3_ROWS
from tidal.cli.main import main


@pytest.mark.slow
def test_bench_mpress_writes_rows_and_the_plan_fits_what_one_saver_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "mpress", "--section", "predicted", "--width", "256", "--heads", "4", "--seq-len", "512",
            "--max-layers", "32", "--step-layers", "4", "--device-memory", "512MiB",
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    assert "tidal bench mpress (predicted" in capsys.readouterr().out
    (path,) = tmp_path.glob("mpress-*.json")
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(path.read_text())
    assert "torch_version" in data and "git_commit" in data
    rows = {(r["schedule"], r["strategy"]): r for r in data["rows"]}
    assert set(rows) == {(s, n) for s in ("1f1b", "pipedream") for n in (*STRATEGIES, *ZERO3_ROWS)}
    for schedule in ("1f1b", "pipedream"):
        largest = {n: rows[schedule, n]["largest_layers"] for n in STRATEGIES}
        assert largest["recompute"] > largest["none"] > 0, largest  # activations bind here
        assert largest["mpress"] >= max(largest.values()), largest
        at = rows[schedule, "mpress"]
        assert at["step_s_at_recompute_largest"] is not None
        assert at["peak_bytes_at_recompute_largest"] <= 512 << 20
    assert {r["family"] for r in data["rows"]} == {"gpt"}
    for r in data["rows"]:  # the largest is the better split's
        assert r["pipedream_updates"] == ("microbatch" if r["schedule"] == "pipedream" else None)
        if r["strategy"] in ZERO3_ROWS:  # no pipeline, no split
            continue
        assert r["largest_layers"] == max(r["largest_layers_by_split"].values()), r
    # ZeRO-3 is priced for the sequences each schedule's span trains: 1F1B one step, PipeDream
    # three ([Note: ZeRO-3 in the predicted table])
    for name in ZERO3_ROWS:
        one, three = rows["1f1b", name], rows["pipedream", name]
        assert (one["zero3_steps_in_span"], three["zero3_steps_in_span"]) == (1, 3)
        assert one["largest_layers"] == three["largest_layers"] > 0
        assert three["step_s_floor_at_recompute_largest"] < three["step_s_at_recompute_largest"]
    # The BERT-like family at a small shape: its vocabulary and microbatch, the same strategies.
    assert main(["bench", "mpress", "--section", "predicted", "--family", "bert", "--width", "128",
                 "--heads", "2", "--seq-len", "128", "--stages", "4", "--max-layers", "16",
                 "--step-layers", "4", "--device-memory", "64MiB",
                 "--results-dir", str(tmp_path / "bert")]) == 0  # fmt: skip
    (path,) = (tmp_path / "bert").glob("mpress-*.json")
    bert = json.loads(path.read_text())["rows"]
    assert {(r["family"], r["micro_batch"]) for r in bert} == {("bert", 8)}
    assert {(r["schedule"], r["strategy"]) for r in bert} == set(rows)
    # A DGX-1's mesh ([Note: two server topologies]): the plan stripes, the unstriped one never.
    assert main([*argv[:-1], str(tmp_path / "dgx1"), "--topology", "dgx1", "--host-gbps", "4"]) == 0
    (path,) = (tmp_path / "dgx1").glob("mpress-*.json")
    dgx1 = {(r["schedule"], r["strategy"]): r for r in json.loads(path.read_text())["rows"]}
    assert set(dgx1) == set(rows) and {r["topology"] for r in dgx1.values()} == {"dgx1"}
    lent = {key: r["lent_at_recompute_largest"] for key, r in dgx1.items()
            if key[1] in STRATEGIES and r["lent_at_recompute_largest"]}  # fmt: skip
    assert all(0 <= n["striped"] <= n["tensors"] for n in lent.values())
    assert max(n["striped"] for key, n in lent.items() if key[1] == "mpress") > 0
    assert all(n["striped"] == 0 for key, n in lent.items() if key[1] == "mpress-unstriped")


def test_bench_savers_meter_matches_the_model_and_every_saver_gives_the_same_gradients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.savers import STRATEGIES as MEASURED

    argv = ["bench", "savers", "--device", "cpu", "--width", "32", "--heads", "2", "--layers", "4",
            "--seq-len", "16", "--micro-batch", "2", "--stages", "2", "--microbatches", "4",
            "--copy-bytes", "65536", "--repeats", "1", "--results-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    assert "tidal bench savers on cpu" in capsys.readouterr().out
    (path,) = tmp_path.glob("savers-*.json")
    data = json.loads(path.read_text())
    assert all(rate > 0 for rate in data["copy_bytes_per_s"].values())
    assert data["block"]["forward_s"] > 0 and data["skipped"] == {}
    rows = {(r["strategy"], r["stage"]): r for r in data["rows"]}
    assert set(rows) == {(name, s) for name in MEASURED for s in (0, 1)}
    for key, r in rows.items():
        assert r["meter_peak_bytes"] == r["predicted_kept_bytes"], key
        assert r["grads_max_abs_diff"] == 0.0, key  # fp32 on the CPU: bit for bit
    assert rows["recompute", 0]["recomputed"] == 2 and rows["host", 0]["to_host"] == 2
    assert rows["recompute", 0]["meter_peak_bytes"] < rows["none", 0]["meter_peak_bytes"] / 3
    plan = [rows["plan", s] for s in (0, 1)]
    assert all(r["fits_plan"] and r["predicted_saved_bytes"] <= r["budget_bytes"] for r in plan)
    # The last stage's backward holds its logits' gradient (2 x 16 x 50257 fp32) for a while
    # ([Note: backward temporaries]); the predicted peak adds it to the saved bytes.
    last = rows["none", 1]
    assert last["backward_temporary_bytes"] >= 2 * 16 * 50257 * 4
    assert (
        last["predicted_peak_bytes"]
        == last["predicted_saved_bytes"] + last["backward_temporary_bytes"]
    )


@pytest.mark.slow
def test_bench_mpress_measured_trains_more_blocks_with_savers_under_the_same_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "mpress", "--section", "measured", "--measured-ranks", "2",
            "--measured-budget", "5MiB", "--measured-max-layers", "6", "--measured-steps", "2",
            "--measured-schedule", "1f1b", "--measured-strategy", "none",
            "--measured-strategy", "recompute", "--results-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    assert "measured: 2 gloo ranks, 5MiB each" in capsys.readouterr().out
    (path,) = tmp_path.glob("mpress-*.json")
    rows = {r["strategy"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"none", "recompute"}
    assert 0 < rows["none"]["largest_layers"] < rows["recompute"]["largest_layers"], rows
    assert "rank 0 needs" in rows["none"]["refused_above"]  # the check before the first step
    assert rows["recompute"]["step_s_at_recompute_largest"] > 0
    assert rows["none"]["step_s_at_recompute_largest"] is None  # it does not train that model


def test_pipedream_stashes_a_version_per_microbatch_in_flight_and_the_memory_split_unloads_it(
) -> None:  # fmt: skip
    # PipeDream updating after every microbatch (its own setting): stage s stashes p - s
    # versions; updating once per 8 microbatches keeps at most two. The split that fits
    # recompute-only's memory gives the first stage (the most versions) fewer blocks than the
    # split by time. 24 GPT blocks 1024 wide on 4 stages of 2 GiB.
    import argparse

    from benchmarks import mpress
    from tidal.activations import TensorClass

    parser = argparse.ArgumentParser()
    mpress.add_arguments(parser)
    args = parser.parse_args(["--width", "1024", "--heads", "8", "--seq-len", "512",
                              "--stages", "4", "--device-memory", "2GiB"])  # fmt: skip
    family = mpress._family(args)
    by_microbatch = mpress._case(family, 24, "pipedream", args, "time")
    assert by_microbatch is not None
    assert by_microbatch[0].weight_versions == (4, 3, 2, 1)
    step_args = argparse.Namespace(**{**vars(args), "pipedream_updates": "step"})
    by_step = mpress._case(family, 24, "pipedream", step_args, "time")
    assert by_step is not None and max(by_step[0].weight_versions) == 2
    first = {}
    for split_by in mpress.SPLITS:
        case = mpress._case(family, 24, "pipedream", args, split_by)
        assert case is not None, split_by
        first[split_by] = sum(1 for i in case[1]
                              if i.stage == 0 and i.tensor_class is TensorClass.BLOCK_INPUT)  # fmt: skip
    assert first["memory"] < first["time"], first


def test_zero3_is_priced_at_the_pipelines_rates_and_fits_what_its_peak_says() -> None:
    # ZeRO-3 beside the pipelines ([Note: ZeRO-3 in the predicted table]): its floor (links
    # free) with full recompute is the same compute the layer profiles price a pipeline at; the
    # largest model it reports fits and one step more does not; offloading fits more.

    import torch

    from benchmarks.mpress_zero3 import Zero3Pricer
    from tidal.models import profile_gpt
    from tidal.models.gpt import GPTConfig

    config = GPTConfig(vocab_size=1000, seq_len=256, num_layers=1, num_heads=4, d_model=256)
    budget = 96 << 20
    pricer = Zero3Pricer(config, sequences_per_step=8, gpus=4, device_memory_bytes=budget,
                         host_gbps=25.0, peer_gbps=300.0)  # fmt: skip
    embed, block, head = profile_gpt(config, micro_batch=2, seq_len=256, dtype=torch.bfloat16)
    full = [
        s for s in pricer.fitting("zero3", 8) if s.variant == "zero3_full" and s.micro_batch == 2
    ]
    (setting,) = full  # 2 sequences a GPU, as one micro-batch
    profiled = (embed.forward_s + embed.backward_s + head.forward_s + head.backward_s
                + 8 * (2 * block.forward_s + block.backward_s))  # fmt: skip
    assert setting.step_s_floor == pytest.approx(profiled, rel=1e-6)
    assert setting.step_s > setting.step_s_floor  # the gathers and reductions cost something
    most = pricer.largest("zero3", step_layers=4, max_layers=4096)
    assert 0 < most < 4096
    assert all(s.peak_bytes <= budget for s in pricer.fitting("zero3", most))
    assert pricer.fitting("zero3", most) and not pricer.fitting("zero3", most + 4)
    assert pricer.largest("zero3-offload", step_layers=4, max_layers=4096) > most
    with pytest.raises(ValueError, match="multiple of --stages"):
        Zero3Pricer(config, sequences_per_step=6, gpus=4,
                    device_memory_bytes=budget, host_gbps=25.0, peer_gbps=300.0)  # fmt: skip
