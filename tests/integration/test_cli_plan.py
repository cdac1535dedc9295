"""``tidal plan`` and ``tidal bench plan`` from the command line (in process)."""

from __future__ import annotations

import json

from tidal.cli.main import main
from tidal.planner import Plan


def test_plan_writes_the_json_the_issue_names(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    code = main(
        ["plan", "--model", "demo", "--devices", "16", "--devices-per-node", "8",
         "--device-memory", "80GiB", "--pareto", "0,0.5", "--baselines", "megatron,zero3",
         "--json", str(out)]
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
    assert qkv["count"] == 4 and qkv["memory"]["total"] > 0
    assert len(report["pareto"]) >= 2
    plan = Plan.load(out)  # what `tidal train --plan` reads
    assert plan.dp * plan.tp == 16
    printed = capsys.readouterr().out
    assert "blocks.*.mlp.fc" in printed and "megatron" in printed and "LP gap" in printed


def test_plan_bad_input_is_one_line_and_exit_2(capsys) -> None:
    assert main(["plan", "--model", "gpt5", "--devices", "8"]) == 2
    assert "unknown preset 'gpt5'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt3-13b", "--devices", "8", "--tp", "3"]) == 2
    assert "tp: 3 does not split" in capsys.readouterr().err
    args = ["plan", "--model", "gpt3-13b", "--devices", "8", "--device-memory", "2GiB"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no plan fits in 2.00GiB per device: the least any plan needs is" in err


def test_bench_plan_writes_results(tmp_path, capsys) -> None:
    args = ["bench", "plan", "--models", "demo", "--devices", "8", "--results-dir"]
    assert main([*args, str(tmp_path)]) == 0
    (path,) = tmp_path.glob("plan-*.json")
    data = json.loads(path.read_text())
    assert data["bench"] == "plan" and data["git_commit"] and data["torch_version"]
    (row,) = data["rows"]
    assert row["model"] == "demo" and row["devices"] == 8
    assert set(row["baselines"]) == {"megatron", "megatron_sp", "zero3"}
    assert f"results: {path}" in capsys.readouterr().out
