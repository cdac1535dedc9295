"""Your own model as a pipeline ([Note: sequential pipelines] in tidal/pipeline/sequential.py):
an MLP and a small CNN, each an ``nn.Sequential``, trained by 1F1B over 2 stages on 2 gloo ranks,
log the reference engine's losses, resume exactly and export under their own names; a model a
pipeline cannot cut is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tidal
from tidal.testing import run_on_ranks
from tidal.testing.your_models import cnn, images, mlp, regression, run_config
from tidal.train.metrics import read_metrics

BATCH = 8
TOL = 1e-5


CASES = {
    "mlp": (mlp, lambda: regression(BATCH), F.mse_loss),
    "cnn": (lambda: cnn(batch_norm=False), lambda: images(BATCH), None),
}


def _your_sgd() -> dict[str, Any]:
    """Your torch optimizer and scheduler ([Note: your optimizer] in tidal/train/user_optim.py)."""
    return {"optimizer": torch.optim.SGD,
            "optimizer_kwargs": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)}  # fmt: skip


def _fit(run_dir: Path, case: str, steps: int, *, stages: int, resume: bool = False,
         memory: dict[str, Any] | None = None, own: dict[str, Any] | None = None) -> dict:  # fmt: skip
    build, data, loss_fn = CASES[case]
    config = run_config(run_dir, steps=steps, batch=BATCH)
    if own is not None:  # the optimizer is said once: yours
        del config["optimizer"]
    if stages > 1:
        config["pipeline"] = {"stages": stages, "microbatches": 2, "schedule": "1f1b"}
    if memory is not None:  # {"device_budget": ..., "pipeline": none | auto | ...}
        config["memory"] = {"device_budget": memory["device_budget"]}
        config["pipeline"]["memory"] = memory["pipeline"]
    trainer = tidal.Trainer(build(), config, train_data=data(), val_data=data()[:2],
                            loss_fn=loss_fn, **(own or {}))  # fmt: skip
    return trainer.fit(resume=resume)


def _pipeline(root: str, case: str) -> dict:
    summary = _fit(Path(root) / "pipe", case, 6, stages=2)
    _fit(Path(root) / "split", case, 4, stages=2)
    _fit(Path(root) / "split", case, 6, stages=2, resume=True)
    if case == "cnn":
        _fits_its_budget_with_savers(Path(root))
    else:  # your optimizer and scheduler on each stage, stopped mid-schedule and resumed
        _fit(Path(root) / "own-split", case, 3, stages=2, own=_your_sgd())
        _fit(Path(root) / "own-split", case, 6, stages=2, own=_your_sgd(), resume=True)
    return summary


def _fits_its_budget_with_savers(root: Path) -> None:
    """Your model under a device budget (issue 18): one byte below what the most loaded rank
    needs keeping everything, ``none`` is refused and ``auto`` trains the same numbers."""
    import torch.distributed as dist

    roomy = _fit(root / "roomy", "cnn", 2, stages=2,
                 memory={"device_budget": "1GiB", "pipeline": "none"})  # fmt: skip
    needs: list[Any] = [None, None]
    dist.all_gather_object(needs, roomy["pipeline"]["memory"]["predicted_peak_bytes"])
    budget = max(needs) - 1
    with pytest.raises(tidal.ConfigError, match=r"rank \d needs .* set pipeline.memory = 'auto'"):
        _fit(
            root / "none", "cnn", 6, stages=2, memory={"device_budget": budget, "pipeline": "none"}
        )
    summary = _fit(root / "auto", "cnn", 6, stages=2,
                   memory={"device_budget": budget, "pipeline": "auto"})  # fmt: skip
    assert _records(root / "auto") == _records(root / "pipe")
    figures: list[Any] = [None, None]
    dist.all_gather_object(figures, summary["pipeline"]["memory"])
    assert all(f["measured_peak_bytes"] <= f["predicted_peak_bytes"] <= budget for f in figures)
    assert sum(f["blocks_recomputed"] + f["blocks_swapped"] for f in figures) > 0, figures


def _lrs_and_losses(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["lr"], r["loss"]) for r in read_metrics(run_dir) if r["kind"] == "train"]


def _records(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_your_sequential_model_as_a_pipeline_equals_the_reference_engine(
    case: str, tmp_path: Path
) -> None:
    _fit(tmp_path / "reference", case, 6, stages=1)
    summaries = run_on_ranks(_pipeline, world_size=2, args=(str(tmp_path), case), timeout_s=240)
    assert summaries[0]["engine"] == "pipeline 1f1b x2"
    # Balanced by counted FLOPs: the first layer alone in stage 0 ties the bottleneck of any
    # other cut (the second matmul or convolution is the heaviest child), and 1F1B's stage 0
    # holds two microbatches in flight, so the tie goes to the split keeping its activations few.
    ranges = summaries[0]["pipeline"]["block_ranges"]
    assert ranges == [[0, 1], [1, len(CASES[case][0]())]]
    reference, pipe = _records(tmp_path / "reference"), _records(tmp_path / "pipe")
    assert [r[0] for r in pipe] == [r[0] for r in reference] and len(pipe) == 9
    for (_, loss, val), (_, ref_loss, ref_val) in zip(pipe, reference, strict=True):
        assert (loss or val) == pytest.approx(ref_loss or ref_val, abs=TOL)
    assert _records(tmp_path / "split") == pipe
    if case == "mlp":  # your SGD and StepLR, one per stage: as on one stage, lr included
        _fit(tmp_path / "own", case, 6, stages=1, own=_your_sgd())
        own, piped = (_lrs_and_losses(tmp_path / name) for name in ("own", "own-split"))
        assert [lr for lr, _ in own] == [lr for lr, _ in piped] == [0.05, 0.025, 0.025, 0.0125,
                                                                     0.0125, 0.00625]  # fmt: skip
        assert [v for _, v in piped] == pytest.approx([v for _, v in own], abs=TOL)
        configured = _lrs_and_losses(tmp_path / "reference")  # [optimizer]'s AdamW: another run
        assert [v for _, v in own] != pytest.approx([v for _, v in configured], abs=TOL)
    # The pipeline's checkpoint is the whole model under its own names, as any engine's.
    from tidal.train.export import check_export, export_run

    out = export_run(tmp_path / "pipe", out=tmp_path / "export")
    assert any("tensors equal to" in line for line in check_export(out))
    model = CASES[case][0]()
    model.load_state_dict(tidal.train.safetensors.read_safetensors(out / "model.safetensors"))


def _meta_pipeline(root: str) -> dict:
    with torch.device("meta"):
        model = mlp()  # its torch.manual_seed(0) draws nothing here: training.seed is 0 too
    config = run_config(Path(root) / "meta", steps=4, batch=BATCH)
    config["pipeline"] = {"stages": 2, "microbatches": 2, "schedule": "1f1b"}
    trainer = tidal.Trainer(model, config, train_data=regression(BATCH),
                            val_data=regression(BATCH)[:2], loss_fn=F.mse_loss)  # fmt: skip
    summary = trainer.fit()
    (stage,) = trainer.part.engine.modules.values()
    summary["meta_parameters"] = sum(p.is_meta for p in stage.parameters())
    return summary


@pytest.mark.slow
def test_your_model_on_the_meta_device_trains_as_if_built_for_real(tmp_path: Path) -> None:
    """Each rank materialises its stages' children alone, with the values the model built for
    real after ``torch.manual_seed(training.seed)`` has ([Note: sequential pipelines])."""
    _fit(tmp_path / "reference", "mlp", 4, stages=1)
    summaries = run_on_ranks(_meta_pipeline, world_size=2, args=(str(tmp_path),), timeout_s=240)
    assert [s["meta_parameters"] for s in summaries] == [0, 0]
    reference, meta = _records(tmp_path / "reference"), _records(tmp_path / "meta")
    assert [r[0] for r in meta] == [r[0] for r in reference]
    for (_, loss, val), (_, ref_loss, ref_val) in zip(meta, reference, strict=True):
        assert (loss or val) == pytest.approx(ref_loss or ref_val, abs=TOL)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            lambda: cnn(batch_norm=True),
            "your model has buffers (1.running_mean, 1.running_var, 1.num_batches_tracked)",
        ),
        (lambda: nn.Linear(16, 1), "Linear is not one: put its layers in an nn.Sequential"),
        (lambda: nn.Sequential(nn.Linear(16, 1)), "2 stages for an nn.Sequential of 1 children"),
    ],
)
def test_a_model_a_pipeline_cannot_cut_is_one_line(model, message: str, tmp_path: Path) -> None:
    from tidal.train.pipeline_part import check_pipeline_job

    job = tidal.load_job({"run_dir": str(tmp_path), "pipeline": {"stages": 2}})
    with pytest.raises(tidal.ConfigError, match=r"parallel.pp: .*" + _escaped(message)):
        check_pipeline_job(job, world_size=2, model=model())


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_your_own_module_is_one_stage_and_is_cut_only_as_an_nn_sequential(tmp_path: Path) -> None:
    """[Note: sequential pipelines]: FSDP2 without a pipeline is one stage, which holds any
    module whole, BatchNorm's statistics included; a pipeline cuts only an nn.Sequential, and
    normalises no statistics per microbatch across stages. Each refusal is one line."""
    from tidal.train.pipeline_part import check_pipeline_job

    job = tidal.load_job({"run_dir": str(tmp_path), "parallel": {"fsdp2": True}})
    assert job.needs_stages
    check_pipeline_job(job, world_size=1, model=nn.Linear(16, 1))
    check_pipeline_job(job, world_size=1, model=nn.Sequential(nn.Linear(16, 1), nn.BatchNorm1d(1)))
    piped = tidal.load_job({"run_dir": str(tmp_path), "parallel": {"pp": 2}})
    with pytest.raises(
        tidal.ConfigError, match=r"^parallel.pp: .*Linear is not one: .*parallel.pp = 1\)$"
    ):
        check_pipeline_job(piped, world_size=2, model=nn.Linear(16, 1))
    with pytest.raises(
        tidal.ConfigError, match=r"^parallel.pp: your model has buffers .*parallel.pp = 1\)$"
    ):
        check_pipeline_job(
            piped, world_size=2, model=nn.Sequential(nn.Linear(16, 1), nn.BatchNorm1d(1))
        )
