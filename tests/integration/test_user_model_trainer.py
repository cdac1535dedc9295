"""``tidal.Trainer(model, config, train_data=..., loss_fn=...)``: your own model and data get
the same loop, metrics, checkpoints and exact resume, on the reference and the chunk engine
([Note: your own model] in tidal/train/training_part.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tidal
from tidal.cli.main import main
from tidal.testing.your_models import cnn, images, mlp, regression, run_config
from tidal.train.checkpoint import list_checkpoints, load_model_state
from tidal.train.metrics import read_metrics
from tidal.train.safetensors import read_safetensors

BATCH = 8
ENGINES = {"reference": {}, "chunk": {"engine": "chunk", "chunk": {"size": 2048}}}
# Below each model's weights, gradients and Adam state beside its activations: chunks move.
BUDGETS = {"mlp": "96KiB", "cnn": "136KiB"}


CASES = {
    "mlp": (mlp, lambda: regression(BATCH), F.mse_loss),
    # cross-entropy on the output: the default
    "cnn": (lambda: cnn(batch_norm=True), lambda: images(BATCH), None),
}


# Sharded over two ranks each rank's BatchNorm normalises its own rows (as under DDP), so the
# CNN compared with one process normalises by groups.
TWO_RANKS = {
    "mlp": CASES["mlp"],
    "cnn-groupnorm": (lambda: cnn(batch_norm=False), lambda: images(BATCH), None),
}


def _fit(run_dir: Path, case: str, engine: str, steps: int, resume: bool = False) -> dict:
    build, data, loss_fn = {**CASES, **TWO_RANKS}[case]
    config = {**run_config(run_dir, steps=steps, batch=BATCH), **ENGINES[engine]}
    if engine == "chunk":
        config["memory"] = {"device_budget": BUDGETS[case.split("-")[0]]}
    trainer = tidal.Trainer(build(), config, train_data=data(), val_data=data()[:2],
                            loss_fn=loss_fn)  # fmt: skip
    return trainer.fit(resume=resume)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES)
def test_your_model_trains_checkpoints_and_resumes_exactly(
    case: str, engine: str, tmp_path: Path
) -> None:
    whole = _fit(tmp_path / "whole", case, engine, 6)
    _fit(tmp_path / "split", case, engine, 4)
    split = _fit(tmp_path / "split", case, engine, 6, resume=True)

    def records(run: str) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / run)]

    assert records("split") == records("whole") and len(records("whole")) == 9  # 6 steps, 3 vals
    losses = [loss for _, loss, val in records("whole") if val is None]
    assert losses[-1] < losses[0]  # it learns
    assert split["resumed_from_step"] == 4 and whole["engine"] == engine
    assert whole["model_tflops_per_s"] is None and whole["tokens_per_s"] > 0  # rows per second
    assert [step for step, _ in list_checkpoints(tmp_path / "whole")][-1] == 6
    if engine == "chunk":
        assert whole["evictions"] > 0


@pytest.mark.parametrize("case", CASES)
def test_your_model_needs_your_data_and_is_exported_under_its_own_names(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(tidal.ConfigError, match="train_data"):
        tidal.Trainer(mlp(), {"run_dir": str(tmp_path / "x")})
    _fit(tmp_path / "run", case, "chunk", 2)
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--check"]) == 0
    said = capsys.readouterr().out
    assert (
        "tensors equal to" in said
        and "your own torch.nn.modules.container.Sequential, as given" in said
    )
    # Parameters and buffers (the CNN's batch-norm statistics) load strictly into a new model
    # that then computes what the trained one computed at its last checkpoint.
    state = read_safetensors(out / "model.safetensors")
    model = CASES[case][0]()
    model.load_state_dict(state, strict=True)
    ((step, checkpoint),) = list_checkpoints(tmp_path / "run")[-1:]
    assert step == 2 and state.keys() == load_model_state(checkpoint).keys()
    inputs = CASES[case][1]()[0][0]
    trained = CASES[case][0]()
    trained.load_state_dict(load_model_state(checkpoint))
    assert torch.equal(model.eval()(inputs), trained.eval()(inputs))


def _fit_on_this_rank(root: str, case: str) -> dict:
    whole = _fit(Path(root) / "two", case, "chunk", 4)
    _fit(Path(root) / "split", case, "chunk", 2)
    _fit(Path(root) / "split", case, "chunk", 4, resume=True)
    return whole


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_RANKS)
def test_your_model_on_two_ranks_is_sharded_equals_one_process_and_resumes(
    case: str, tmp_path: Path
) -> None:
    """Each rank its half of every batch; the chunk engine shards over the ranks (ZeRO-3)."""
    from tidal.testing import run_on_ranks

    ranks = run_on_ranks(_fit_on_this_rank, world_size=2, args=(str(tmp_path), case),
                         timeout_s=120)  # fmt: skip
    _fit(tmp_path / "one", case, "chunk", 4)
    assert ranks[0]["engine"] == "chunk-sharded" and ranks[0]["bytes_all_gathered"] > 0

    def records(run: str) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / run)]

    flat = [v for r in records("one") for v in r[1:] if v is not None]
    assert [v for r in records("two") for v in r[1:] if v is not None] == pytest.approx(
        flat, rel=1e-5
    )
    assert records("split") == records("two") and len(flat) == 6  # 4 steps, 2 vals; exact resume
