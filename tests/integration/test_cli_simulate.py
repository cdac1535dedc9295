"""``tidal simulate`` as a command module: arguments, table, JSON and PNG output."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from rich.console import Console

from tidal.cli.simulate import add_arguments, run
from tidal.config import ConfigError


def _run(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tidal simulate")
    add_arguments(parser)
    console = Console(record=True, width=160, file=io.StringIO())
    code = run(parser.parse_args(argv), console)
    return code, console.export_text()


def test_simulate_writes_json_and_png(tmp_path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "timeline.png"
    code, text = _run(
        ["--schedule", "pipemare", "--stages", "4", "--microbatches", "2",
         "--activation-bytes", "1MiB", "--json", str(out), "--png", str(png), "--programs"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["schedule"] == "pipemare" and report["stages"] == 4
    assert report["steps"] == 4  # the asynchronous default
    assert report["steady_bubble_fraction"] == 0.0
    assert report["weight_versions"] == [1, 1, 1, 1]
    assert report["delay"] == [2, 1, 1, 0]  # ceil((p - 1 - s) / m)
    assert report["peak_activation_bytes"] == [4 * 2**20, 3 * 2**20, 2 * 2**20, 2**20]
    assert report["makespan"] > 0 and len(report["busy_s"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert "rank 0: 0F0v0" in text  # --programs
    assert "steady bubble 0.00%" in text and "4.00MiB" in text


def test_simulate_sync_bubble_in_summary(tmp_path) -> None:
    out = tmp_path / "sim.json"
    code, text = _run(
        ["--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
         "--forward-s", "1", "--backward-s", "2,2,2,2", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 1
    assert report["bubble_fraction"] == pytest.approx(3 / 11)
    assert report["makespan"] == pytest.approx(33.0)
    assert "bubble 27.27%" in text


def test_simulate_bad_input_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="multiple of stages"):
        _run(
            ["--schedule", "interleaved", "--stages", "4", "--microbatches", "6", "--virtual", "2"]
        )
    with pytest.raises(ConfigError, match="--forward-s"):
        _run(["--schedule", "gpipe", "--forward-s", "fast"])


def test_tidal_simulate_command(tmp_path, capsys) -> None:
    """Through ``tidal``'s own parser: GPipe's bubble is (p-1)/(m+p-1); bad input exits 2."""
    from tidal.cli.main import main

    out = tmp_path / "gpipe.json"
    argv = ["simulate", "--schedule", "gpipe", "--stages", "4", "--microbatches", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bubble_fraction"] == pytest.approx(3 / 7)
    assert report["peak_activations"] == [4, 4, 4, 4] and report["delay"] == [0, 0, 0, 0]
    assert (
        main(["simulate", "--schedule", "interleaved", "--virtual", "2", "--microbatches", "6"])
        == 2
    )
    assert "multiple of stages" in capsys.readouterr().err


def test_simulate_a_preset_partitions_it(tmp_path, capsys) -> None:
    """``--model``: the balanced split covers every block once, its per-stage costs feed the
    simulator (stage activations come from the profile), and a memory limit below the least any
    split needs exits 2 naming it."""
    from tidal.cli.main import main
    from tidal.models import preset

    out = tmp_path / "tiny.json"
    argv = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"]
    assert main([*argv, "--model", "tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ranges = report["block_ranges"]
    assert ranges[0][0] == 0 and ranges[-1][1] == preset("tiny").num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(x > 0 for x in report["peak_activation_bytes"])
    assert report["peak_activation_bytes"][0] > report["peak_activation_bytes"][1] * 0.5
    assert main([*argv, "--model", "tiny", "--stage-memory", "1KiB"]) == 2
    assert "the least memory per stage any split needs" in capsys.readouterr().err
