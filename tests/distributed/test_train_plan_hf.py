"""``tidal train --plan`` on a Hugging Face LLaMA (GQA), end to end through the command line.

``tidal plan --model config.json --pp 2`` makes a pipelined plan of tensor-parallel stages for
4 devices and prints the command that trains it; that command's 4 ranks train it on gloo, and
the same settings train in this process on the reference engine. The losses, validation losses and the checkpointed (gathered, single-device layout) parameters must match
within 1e-5. (A flat plan of a Hugging Face model is test_plan_apply_hf.py's; a plan run
stopped and resumed by new processes is test_train_plan.py's.)
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from command_ranks import run_command_on_ranks

from tidal.cli.main import main
from tidal.planner import Plan, StrategyName
from tidal.train.checkpoint import latest_checkpoint, load_model_state
from tidal.train.metrics import read_metrics

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SEQ_LEN = 32


def _records(run_dir: Path, kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r["kind"] == kind]


@pytest.mark.slow
def test_hf_llama_pipelined_plan_trains_with_the_command_tidal_plan_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51: ``tidal plan --pp 2`` on 4 devices chooses a pipelined plan of tensor-parallel
    stages for the LLaMA and prints the ``tidal train`` command that trains it; that command,
    run as printed on its 4 gloo ranks, trains as one process does with the same
    batch."""
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    plan_path = tmp_path / "p.json"
    argv = ["plan", "--model", str(tmp_path / "llama"), "--devices", "4", "--pp", "2", "--tp", "2"]
    argv += ["--seq-len", str(SEQ_LEN), "--eps", "1000", "--pareto", "", "--baselines", ""]
    capsys.readouterr()
    assert main([*argv, "--json", str(plan_path)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train it: ")]
    plan = Plan.load(plan_path)
    assert plan.pipeline is not None and (plan.pp, plan.tp) == (2, 2)
    last = {u.name: u for u in plan.pipeline.stages["last"].units}
    assert last["model.layers.*.self_attn[2]"].strategy is StrategyName.HEADS
    command = shlex.split(line.removeprefix("train it: "))
    assert command[:2] == ["tidal", "train"] and command[command.index("--nproc") + 1] == "4"
    settings = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    steps = ["training.steps=3", "training.val_every=2", "training.val_batches=1",
             "data.source=synthetic", "data.synthetic_num_tokens=20000", "optimizer.eps=1e-6",
             "metrics.peak_tflops=1.0", "checkpoint.every_steps=0"]  # fmt: skip
    run_dir, reference = tmp_path / "plan", tmp_path / "reference"
    # its 4 ranks as the launcher starts them, forked from the fork server (the launch itself
    # is the README quick start's, whose plan trains under torchrun)
    run_command_on_ranks([*command[2:], "--no-plots", *(a for s in steps for a in ("--set", s)),
                          "--set", f"run_dir={run_dir}"], world_size=4, timeout_s=300)  # fmt: skip
    one = ["train", "--recipe", command[command.index("--recipe") + 1], "--no-plots"]
    assert main([*one, *(a for s in [*settings, *steps] for a in ("--set", s)),
                 "--set", f"run_dir={reference}"]) == 0  # fmt: skip
    for kind, key in (("train", "loss"), ("val", "val_loss")):
        got, want = _records(run_dir, kind, key), _records(reference, kind, key)
        assert [s for s, _ in got] == [s for s, _ in want] and want
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=TOL, rel=0)
    state, want_state = (load_model_state(latest_checkpoint(d)) for d in (run_dir, reference))
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "plan" and summary["mesh"] == "pp 2 x dp 1 x tp 2"
    assert summary["hf_config"] == str(tmp_path / "llama")
