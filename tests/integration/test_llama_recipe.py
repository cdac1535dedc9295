"""The shipped Hugging Face LLaMA recipe (`llama-tiny`: its config.json beside it, built
offline) trains, checkpoints and resumes bit for bit on the reference and the chunk engine,
from a folder that is not the checkout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.cli.main import main
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

pytest.importorskip("transformers")

ENGINES = {
    "reference": [],
    # Below the model data beside the activations (2.4 MiB at the least): chunks move.
    "chunk": ["engine=chunk", "chunk.size=8192", "memory.device_budget=2700KiB"],
}


def _fit(run_dir: Path, engine: str, steps: int, resume: bool = False) -> dict:
    overrides = [f"run_dir={run_dir}", f"training.steps={steps}", "training.val_every=2",
                 "training.log_every=1", "checkpoint.every_steps=2", "optimizer.decay_steps=6",
                 *ENGINES[engine]]  # fmt: skip
    return Trainer("llama-tiny", overrides).fit(resume=resume)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_llama_recipe_trains_resumes_exactly_and_exports(
    engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe finds its config.json beside itself, not here
    whole = _fit(tmp_path / "whole", engine, 6)
    _fit(tmp_path / "split", engine, 4)
    _fit(tmp_path / "split", engine, 6, resume=True)

    def records(run: str) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / run)]

    assert records("split") == records("whole") and len(records("whole")) == 9
    assert whole["hf_config"].endswith("recipes/hf/llama-tiny.json")
    assert whole["num_params"] == 106_816 and whole["final_loss"] < 5.3
    if engine == "chunk":
        assert whole["evictions"] > 0
        # Exported as a Hugging Face folder that transformers loads with the trained logits.
        out = tmp_path / "export"
        assert main(["export", str(tmp_path / "whole"), "--out", str(out), "--check"]) == 0
        said = capsys.readouterr().out
        assert "hf/: AutoModelForCausalLM logits within" in said, said
        assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "llama"
