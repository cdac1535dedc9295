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


def _both(root: str) -> tuple[dict, dict]:
    """As a 1F1B pipeline, then sharded by the chunk engine, each also split and resumed."""
    root_path = Path(root)
    pipe = ["parallel.pp=2", "pipeline.microbatches=2", "pipeline.schedule=1f1b"]
    chunk = ["engine=chunk", "chunk.size=8192"]
    summaries = []
    for name, extra in (("pipe", pipe), ("sharded", chunk)):
        summaries.append(Trainer("llama-tiny", [*_overrides(root_path / name), *extra]).fit())
        split = root_path / f"{name}-split"
        Trainer("llama-tiny", [*_overrides(split, 2), *extra]).fit()
        Trainer("llama-tiny", [*_overrides(split), *extra]).fit(resume=True)
    return summaries[0], summaries[1]


def _equal_to(reference: list[tuple], run: list[tuple]) -> None:
    assert [r[0] for r in run] == [r[0] for r in reference] and len(run) == STEPS + 2
    for (_, loss, val), (_, ref_loss, ref_val) in zip(run, reference, strict=True):
        assert (loss or val) == pytest.approx(ref_loss or ref_val, abs=TOL)


@pytest.mark.slow
def test_the_llama_recipe_on_two_ranks_equals_the_reference_engine(tmp_path: Path) -> None:
    Trainer("llama-tiny", _overrides(tmp_path / "reference")).fit()
    reference = _losses(tmp_path / "reference")
    (pipe, sharded), _ = run_on_ranks(_both, world_size=2, args=(str(tmp_path),), timeout_s=300)
    assert pipe["engine"] == "pipeline 1f1b x2"
    assert pipe["pipeline"]["block_ranges"] == [[0, 1], [1, 2]]  # balanced: one layer each
    assert sharded["engine"] == "chunk-sharded" and sharded["bytes_all_gathered"] > 0
    for name in ("pipe", "sharded"):
        _equal_to(reference, _losses(tmp_path / name))
        assert _losses(tmp_path / f"{name}-split") == _losses(tmp_path / name)

    from tidal.train.export import check_export, export_run

    out = export_run(tmp_path / "pipe", out=tmp_path / "export")
    assert any("AutoModelForCausalLM logits within" in line for line in check_export(out))


def _tensor_parallel(root: str) -> dict:
    pipe = ["parallel.pp=2", "parallel.tp=2", "pipeline.microbatches=2", "pipeline.schedule=1f1b"]
    return Trainer("llama-tiny", [*_overrides(Path(root) / "pp2-tp2"), *pipe]).fit()


@pytest.mark.slow
def test_the_llama_recipe_as_pp2_x_tp2_equals_the_reference_engine(tmp_path: Path) -> None:
    """[Note: tensor-parallel stages]: LLaMA's separate q, k, v and gate/up projections split
    column-wise, o and down row-wise, over 2 tp ranks of each of 2 stages: the one-process
    reference's losses and validation losses."""
    Trainer("llama-tiny", _overrides(tmp_path / "reference")).fit()
    summaries = run_on_ranks(_tensor_parallel, world_size=4, args=(str(tmp_path),), timeout_s=300)
    assert summaries[0]["engine"] == "pipeline 1f1b x2 tensor-parallel stages (tp2)"
    _equal_to(_losses(tmp_path / "reference"), _losses(tmp_path / "pp2-tp2"))
