"""The shipped Hugging Face LLaMA recipe on two ranks: as a pipeline (1F1B, 2 stages on 2 gloo
ranks, one decoder layer each, the rotary tables recomputed per stage) and sharded by the chunk
engine (ZeRO-3): the reference engine's losses, a resume equal to the unbroken run, and an export
transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.testing import run_on_ranks
from tidal.train import Trainer
from tidal.train.metrics import read_metrics

pytest.importorskip("transformers")

TOL = 1e-5
STEPS = 4


def _overrides(run_dir: Path, steps: int = STEPS) -> list[str]:
    return [f"run_dir={run_dir}", f"training.steps={steps}", "training.val_every=2",
            "training.log_every=1", "training.device=cpu", "checkpoint.every_steps=2",
            "optimizer.decay_steps=4", "optimizer.warmup_steps=2"]  # fmt: skip


def _losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


def _pipeline(root: str) -> dict:
    pipe = ["pipeline.stages=2", "pipeline.microbatches=2", "pipeline.schedule=1f1b"]
    root_path = Path(root)
    summary = Trainer("llama-tiny", [*_overrides(root_path / "pipe"), *pipe]).fit()
    Trainer("llama-tiny", [*_overrides(root_path / "split", 2), *pipe]).fit()
    Trainer("llama-tiny", [*_overrides(root_path / "split"), *pipe]).fit(resume=True)
    return summary


@pytest.mark.slow
def test_the_llama_recipe_as_a_pipeline_equals_the_reference_engine(tmp_path: Path) -> None:
    Trainer("llama-tiny", _overrides(tmp_path / "reference")).fit()
    summaries = run_on_ranks(_pipeline, world_size=2, args=(str(tmp_path),), timeout_s=240)
    assert summaries[0]["engine"] == "pipeline 1f1b x2"
    assert summaries[0]["pipeline"]["block_ranges"] == [[0, 1], [1, 2]]  # balanced: one each
    reference, pipe = _losses(tmp_path / "reference"), _losses(tmp_path / "pipe")
    assert [r[0] for r in pipe] == [r[0] for r in reference] and len(pipe) == STEPS + 2
    for (_, loss, val), (_, ref_loss, ref_val) in zip(pipe, reference, strict=True):
        assert (loss or val) == pytest.approx(ref_loss or ref_val, abs=TOL)
    assert _losses(tmp_path / "split") == pipe

    from tidal.train.export import check_export, export_run

    out = export_run(tmp_path / "pipe", out=tmp_path / "export")
    assert any("AutoModelForCausalLM logits within" in line for line in check_export(out))


def _sharded(root: str) -> dict:
    chunk = ["engine=chunk", "chunk.size=8192"]
    root_path = Path(root)
    summary = Trainer("llama-tiny", [*_overrides(root_path / "sharded"), *chunk]).fit()
    Trainer("llama-tiny", [*_overrides(root_path / "sharded-split", 2), *chunk]).fit()
    Trainer("llama-tiny", [*_overrides(root_path / "sharded-split"), *chunk]).fit(resume=True)
    return summary


@pytest.mark.slow
def test_the_llama_recipe_sharded_on_two_ranks_equals_the_reference_engine(tmp_path: Path) -> None:
    Trainer("llama-tiny", _overrides(tmp_path / "reference")).fit()
    summaries = run_on_ranks(_sharded, world_size=2, args=(str(tmp_path),), timeout_s=240)
    assert summaries[0]["engine"] == "chunk-sharded" and summaries[0]["bytes_all_gathered"] > 0
    reference, sharded = _losses(tmp_path / "reference"), _losses(tmp_path / "sharded")
    assert [r[0] for r in sharded] == [r[0] for r in reference] and len(sharded) == STEPS + 2
    for (_, loss, val), (_, ref_loss, ref_val) in zip(sharded, reference, strict=True):
        assert (loss or val) == pytest.approx(ref_loss or ref_val, abs=TOL)
    assert _losses(tmp_path / "sharded-split") == sharded
