"""MPress's savers on a schedule ([Note: savers on a schedule] in tidal/pipeline/savers.py) and
the ``tidal simulate --device-memory`` table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidal.activations import Links, Saver, TensorClass, keep_all, plan_savers
from tidal.activations.topology import peer_links
from tidal.cli.main import main
from tidal.pipeline.savers import BlockSaves, idle_windows, saved_tensors, step_with_savers
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.simulate import StageCosts, simulate

MiB = 1 << 20
STAGES, MICROBATCHES = 4, 8


def _sim(name: str = "1f1b"):
    steps = 1 if name == "1f1b" else 3
    schedule = make_schedule(name, stages=STAGES, microbatches=MICROBATCHES, steps=steps)
    return simulate(schedule, StageCosts(forward_s=1.0, backward_s=2.0))


def _blocks() -> list[BlockSaves]:
    return [BlockSaves(stage=s, block=s, forward_s=1.0,
                       bytes_by_class={TensorClass.BLOCK_INPUT: MiB, TensorClass.MLP: 3 * MiB})
            for s in range(STAGES)]  # fmt: skip


def _links(budget: int, *, host_bandwidth: float = 1e9) -> Links:
    return Links(stage_rank=tuple(range(STAGES)), budget_bytes=(budget,) * STAGES,
                 base_bytes=(0,) * STAGES, host_link=(0,) * STAGES,
                 host_bandwidth=(host_bandwidth,), host_budget_bytes=(None,),
                 peer_bandwidth=tuple((0.0,) * STAGES for _ in range(STAGES)))  # fmt: skip


def test_idle_windows_shrink_toward_the_last_stage_under_1f1b() -> None:
    windows = idle_windows(_sim())
    # The last stage runs each backward right after its forward; earlier stages wait for the
    # gradient to come back through the later ones.
    assert windows[-1] == 0.0
    assert list(windows) == sorted(windows, reverse=True) and windows[0] > 0


def test_copies_follow_the_schedule_and_stashed_versions_are_weights() -> None:
    saved = saved_tensors(_sim(), _blocks(), weight_bytes=[8 * MiB] * STAGES)
    copies = {item.stage: item.copies for item in saved}
    assert copies == {s: STAGES - s for s in range(STAGES)}  # 1F1B: p - s in flight
    assert not [i for i in saved if i.tensor_class is TensorClass.WEIGHTS]  # one version
    recompute = {i.tensor_class: i.recompute_s for i in saved if i.stage == 0}
    assert recompute == {TensorClass.BLOCK_INPUT: None, TensorClass.MLP: 1.0}  # all internals
    stashed = saved_tensors(_sim("pipedream"), _blocks(), weight_bytes=[8 * MiB] * STAGES)
    weights = [i for i in stashed if i.tensor_class is TensorClass.WEIGHTS]
    assert weights and weights[0].stage == 0 and weights[0].copies >= 1


def test_a_recompute_or_a_swap_the_window_cannot_hide_lengthens_the_step() -> None:
    sim = _sim()
    saved = saved_tensors(sim, _blocks(), weight_bytes=[0] * STAGES)
    kept = keep_all(saved, _links(1 << 40))
    assert step_with_savers(sim, kept).makespan_s == sim.makespan_s
    # Stage 0 holds 4 x 4 MiB: a 10 MiB budget needs savers there.
    # A host link too slow: 2 x 3 MiB at 100 kB/s is 63 s a use, over stage 0's 9 s window.
    slow = plan_savers(saved, _links(10 * MiB, host_bandwidth=1e5))
    assert {c[0] for i, c in zip(slow.saved, slow.choices, strict=True) if i.stage == 0} >= {
        Saver.RECOMPUTE
    }
    assert step_with_savers(sim, slow).makespan_s > sim.makespan_s
    # A fast host link: the round trip (2 x 3 MiB at 1 TB/s) fits stage 0's idle window.
    fast = plan_savers(saved, _links(10 * MiB, host_bandwidth=1e12))
    assert fast.added_step_s == 0.0 and fast.peak_bytes[0] <= 10 * MiB
    assert step_with_savers(sim, fast).makespan_s == sim.makespan_s


def test_simulate_prints_and_records_the_saver_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
            "--model", "tiny", "--micro-batch", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    kept = json.loads(out.read_text())
    assert "savers" not in kept
    capsys.readouterr()
    assert main([*argv, "--device-memory", "2MiB"]) == 0
    printed = capsys.readouterr().out
    assert "savers (" in printed and "held after" in printed
    report = json.loads(out.read_text())["savers"]
    assert all(r["peak_bytes"] <= 2 * MiB for r in report["ranks"])
    assert max(report["peak_bytes_before"]) > 2 * MiB  # the savers were needed
    assert report["step_s_after"] >= report["step_s_before"]
    assert {c["saver"] for c in report["choices"]} - {"keep"}
    # Devices that differ: the stages are placed so that the large one holds more than a small
    # one could (a heavy stage, or what others lend it), and no rank has to recompute.
    assert main([*argv, "--device-memory", "2MiB,2MiB,2MiB,16MiB"]) == 0
    assert "budgets 2.00MiB, 2.00MiB, 2.00MiB, 16.00MiB" in capsys.readouterr().out
    report = json.loads(out.read_text())["savers"]
    assert report["budget_bytes"] == [2 * MiB, 2 * MiB, 2 * MiB, 16 * MiB]
    assert sorted(s for r in report["ranks"] for s in r["stages"]) == [0, 1, 2, 3]
    assert report["ranks"][3]["peak_bytes"] > 2 * MiB
    assert report["step_s_after"] == report["step_s_before"]
    assert all(r["peak_bytes"] <= b for r, b in zip(report["ranks"], report["budget_bytes"],
                                                    strict=True))  # fmt: skip


def test_simulate_on_a_dgx1_stripes_only_over_nvlink_peers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[Note: two server topologies]: on a DGX-1's mesh the plan lends over several NVLinks at
    once ([Note: stripes]), and never to a GPU its borrower has no NVLink to."""
    out = tmp_path / "sim.json"
    argv = ["simulate", "--schedule", "1f1b", "--stages", "8", "--microbatches", "16",
            "--model", "gpt2-small", "--micro-batch", "4", "--device-memory", "2GiB",
            "--topology", "dgx1", "--host-gbps", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())["savers"]
    rank_of = {s: r["rank"] for r in report["ranks"] for s in r["stages"]}
    links, _ = peer_links("dgx1", 8, pair_gbps=0.0, nvlink_gbps=25.0)
    lent = [c for c in report["choices"] if c["saver"] == "peer"]
    assert any(len(c["lenders"]) > 1 for c in lent)
    assert all(links[rank_of[c["stage"]]][to] > 0 for c in lent for to in c["lenders"])
    assert all(r["peak_bytes"] <= 2 << 30 for r in report["ranks"])
    assert max(report["peak_bytes_before"]) > 2 << 30  # the savers were needed


def test_simulate_with_virtual_stages_lends_only_where_the_runtime_can(tmp_path: Path) -> None:
    """[Note: lending]: with virtual stages a stage lends to the ranks with a stage after it,
    so the last chunk's stages lend only to later ranks; the plan's lenders are those."""
    from tidal.pipeline.lending import lender_ranks
    from tidal.pipeline.schedules import make_schedule

    out = tmp_path / "sim.json"
    argv = ["simulate", "--schedule", "interleaved", "--stages", "4", "--virtual", "2",
            "--microbatches", "8", "--model", "gpt2-small", "--micro-batch", "4",
            "--device-memory", "3GiB", "--peer-gbps", "100", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())["savers"]
    schedule = make_schedule("interleaved", stages=4, microbatches=8, virtual=2)
    lent = [c for c in report["choices"] if c["saver"] == "peer"]
    assert lent  # the plan lends
    assert all(set(c["lenders"]) <= set(lender_ranks(schedule, c["stage"])) for c in lent)
    assert lender_ranks(schedule, 7) == () and lender_ranks(schedule, 3) == (0, 1, 2)


def test_saver_input_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]
    assert main([*base, "--device-memory", "1GiB"]) == 2
    assert "--device-memory: needs --model" in capsys.readouterr().err
    assert main([*base, "--model", "tiny", "--device-memory", "1KiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no saver plan fits: rank" in err[0] and "needs at least" in err[0]
    assert main([*base, "--model", "tiny", "--device-memory", "1GiB,1GiB,1GiB"]) == 2
    assert "3 sizes for 2 ranks" in capsys.readouterr().err
    assert main([*base, "--model", "tiny", "--device-memory", "1GiB", "--topology", "dgx1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a DGX-1 has 8 GPUs, not 2" in err[0]


def test_units_are_each_blocks_parts_named_by_class() -> None:
    from tidal.models import build_gpt
    from tidal.models.gpt import GPTConfig, split_gpt
    from tidal.pipeline.savers import stage_units, unit_class
    from tidal.pipeline.split import even_ranges

    model = build_gpt(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=16))
    first, last = split_gpt(model, even_ranges(2, 2))
    assert stage_units(first) == [("embed", -1), ("layers.0.ln_1", 0), ("layers.0.attn", 0),
                                  ("layers.0.ln_2", 0), ("layers.0.mlp", 0)]  # fmt: skip
    assert stage_units(last)[-1] == ("head", -1) and stage_units(last)[0] == ("layers.0.ln_1", 1)
    names = {"layers.3.self_attn": TensorClass.ATTENTION, "layers.0.mlp": TensorClass.MLP,
             "layers.1.post_attention_layernorm": TensorClass.NORM,
             "layers.0.ln_2": TensorClass.NORM, "head": TensorClass.OTHER}  # fmt: skip
    assert {path: unit_class(path) for path in names} == names


def test_a_rank_past_its_budget_stops_at_once_in_one_line() -> None:
    from tidal.config import ConfigError
    from tidal.models import build_gpt
    from tidal.models.gpt import GPTConfig, split_gpt
    from tidal.pipeline.split import even_ranges
    from tidal.train.pipeline_memory import _budget_guard

    model = build_gpt(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=16))
    first, _ = split_gpt(model, even_ranges(2, 2))
    tokens = torch.zeros((2, 8), dtype=torch.long)
    roomy = _budget_guard([first], budget=1 << 30, base=1000, rank=0)
    first(tokens)
    assert roomy.peak_bytes > 1000  # the meter counted what the forward saved
    _budget_guard([first], budget=roomy.peak_bytes - 1, base=1000, rank=3)  # its meter is inner
    with pytest.raises(ConfigError, match="rank 3 would hold .* over its budget"):
        first(tokens)


def test_what_a_recompute_keeps_and_the_loss_are_measured_as_the_meter_counts_them() -> None:
    from tidal.activations import Saver, evaluate
    from tidal.activations.apply import apply_savers
    from tidal.activations.runtime import around_forward
    from tidal.memory.activations import SavedTensorMeter
    from tidal.models import build_gpt
    from tidal.models.gpt import GPTConfig, split_gpt
    from tidal.pipeline.savers import measure_units, whole_blocks
    from tidal.pipeline.split import even_ranges

    model = build_gpt(GPTConfig(vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16))
    stages = split_gpt(model, even_ranges(4, 2))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    units = measure_units(stages, tokens, tokens, lambda s, b: 1e-3)
    (loss,) = [u for u in units if u.fixed]
    assert loss.stage == 1 and loss.path == "" and loss.num_bytes >= 2 * 8 * 64 * 4  # logits
    assert all(0 < u.keeps_bytes <= u.num_bytes for u in units if u.block >= 0)
    links = Links(stage_rank=(0, 1), budget_bytes=(1 << 30,) * 2, base_bytes=(0, 0),
                  host_link=(0, 0), host_bandwidth=(1e9,), host_budget_bytes=(None,),
                  peer_bandwidth=((0.0, 0.0), (0.0, 0.0)))  # fmt: skip
    sim = simulate(make_schedule("gpipe", stages=2, microbatches=3))
    saved = whole_blocks(saved_tensors(sim, units, weight_bytes=[0, 0]))
    assert [s.path for s in saved if s.stage == 0] == ["embed", "layers.0", "layers.1"]
    choices = [(Saver.RECOMPUTE if s.block >= 0 else Saver.KEEP, None) for s in saved]
    plan = evaluate(saved, choices, links, "")
    first = stages[0]
    apply_savers(first, {"layers.0": Saver.RECOMPUTE, "layers.1": Saver.RECOMPUTE})
    params = {p.untyped_storage()._cdata for p in first.parameters()}
    meter = SavedTensorMeter(is_model_storage=params.__contains__)
    around_forward(first, meter.tracking)
    outputs = [first(tokens.clone()) for _ in range(3)]  # GPipe: every microbatch in flight
    kept = sum(s.held_under(c[0]) for s, c in zip(saved, plan.choices, strict=True) if s.stage == 0)
    assert meter.live_bytes() == kept > 0
    del outputs
