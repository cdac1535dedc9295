"""``tidal bench pipemare`` on a tiny GPT: JSON and PNG, sync equals plain training, tau equals
the simulator's."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

from benchmarks.pipemare import (
    PipeMareBenchConfig,
    Section,
    Variant,
    add_arguments,
    build_model,
    lr_schedule,
    make_optimizer,
    run,
    run_variant,
    samplers,
    variant_schedule,
)
from tidal.config import ConfigError
from tidal.data import TokenSplits
from tidal.pipeline.simulate import simulate
from tidal.runtime.pipemare import lr_scale

SECTION = Section(optimizer="adamw", microbatches=2, lr=1e-2)  # type: ignore[arg-type]
TINY = dict(
    steps=6, stages=4, num_layers=4, d_model=16, num_heads=2, seq_len=8, batch_size=4,
    val_batches=2, sections=(SECTION,), reschedule_fraction=1.0, sync_fraction=0.34,
)  # fmt: skip


def byte_splits() -> TokenSplits:
    rng = np.random.default_rng(0)
    # A repetitive byte stream, so a few steps lower the loss.
    train = np.tile(np.arange(40, dtype=np.uint8), 50) ^ rng.integers(0, 2, 2000, dtype=np.uint8)
    return TokenSplits(train=train, val=train[::-1].copy(), vocab_size=256, name="test")


def reference_training(config: PipeMareBenchConfig, splits: TokenSplits) -> tuple[list, float]:
    """Plain one-process training of the whole model: per-step losses and final val loss."""
    (section,) = config.sections
    model = build_model(config)
    optimizer = make_optimizer(model.parameters(), config, section)
    schedule = lr_schedule(config, section.lr)
    train, val_batches = samplers(config, splits)
    losses = []
    for step in range(config.steps):
        loss = model(*train.batch(step))
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        val = sum(float(model(idx, tgt)) for idx, tgt in val_batches) / len(val_batches)
    return losses, val


def test_sync_equals_plain_training_and_async_tau_equals_simulator() -> None:
    config = PipeMareBenchConfig(**TINY, variants=(Variant.SYNC, Variant.PIPEMAREW))
    splits = byte_splits()
    sync = run_variant(Variant.SYNC, config, SECTION, splits)
    ref_losses, ref_val = reference_training(config, splits)
    assert sync.losses == pytest.approx(ref_losses, abs=1e-5, rel=0)
    assert sync.val_loss == pytest.approx(ref_val, abs=1e-5, rel=0)
    assert ref_losses[-1] < ref_losses[0]  # the run trains: the comparison is not vacuous
    assert sync.max_tau() == [0, 0, 0, 0]

    warm = run_variant(Variant.PIPEMAREW, config, SECTION, splits)
    sim = simulate(variant_schedule(Variant.PIPEMAREW, config, SECTION.microbatches))
    assert warm.delays == sim.delays
    assert warm.max_tau() == list(sim.delay)
    assert max(warm.max_tau()) >= 1  # the asynchronous phase does delay the first stage
    # Stage 0's rate: the base one divided by its measured delay, fading out at T1 (flushed
    # steps have tau = 0, so they keep the base rate).
    base, m, t1 = (
        lr_schedule(config, SECTION.lr).lr_at,
        SECTION.microbatches,
        config.lr_warmup_steps,
    )
    for k in range(config.steps):
        tau = sum(warm.delays[0, mb] for mb in range(k * m, (k + 1) * m)) / m
        assert warm.lrs[0, k] == pytest.approx(base(k) * lr_scale(tau, k, t1), rel=1e-12)
    assert any(warm.lrs[0, k] < 0.99 * base(k) for k in range(config.steps))


def test_prediction_variant_runs_forwards_on_predicted_weights() -> None:
    config = PipeMareBenchConfig(**TINY, variants=(Variant.PIPEMARE_LR, Variant.PIPEMARE_LR_PRED))
    splits = byte_splits()
    plain = run_variant(Variant.PIPEMARE_LR, config, SECTION, splits)
    predicted = run_variant(Variant.PIPEMARE_LR_PRED, config, SECTION, splits)
    assert predicted.delays == plain.delays and predicted.lrs == plain.lrs  # same rule, same tau
    # Until a stage has updated and measured a delay its forward runs on the live weights ...
    assert predicted.losses[0] == plain.losses[0]
    # ... and then on w + tau_hat * delta, which changes the losses the forwards see.
    assert predicted.losses[2:] != plain.losses[2:]


def _run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tidal bench pipemare")
    add_arguments(parser)
    console = Console(record=True, width=200, file=io.StringIO())
    code = run(parser.parse_args(argv), console)
    return code, console.export_text()


@pytest.mark.slow
def test_command_writes_json_curves_and_png(tmp_path, monkeypatch) -> None:
    import benchmarks.pipemare as bench

    splits = byte_splits()
    monkeypatch.setattr(bench, "build_token_splits", lambda *a, **k: splits)
    code, text = _run_cli(
        ["--steps", "5", "--stages", "4", "--layers", "4", "--sections", "sgd:1:0.05,adamw:2:1e-2",
         "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "4",
         "--val-batches", "1", "--variants", "sync,async", "--results-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    (path,) = tmp_path.glob("pipemare-*.json")
    report = json.loads(path.read_text())
    assert report["bench"] == "pipemare" and "git_commit" in report and "torch_version" in report
    rows = {(row["section"], row["variant"]): row for row in report["rows"]}
    sections = ["sgd m=1 lr=0.05", "adamw m=2 lr=0.01"]
    assert list(rows) == [(s, v) for s in sections for v in ("sync", "async")]
    for row in rows.values():
        assert len(row["losses"]) == 5 and len(row["stage0_lrs"]) == 5
        for key in ("final_train_loss", "val_loss", "max_tau", "diverged", "seconds"):
            assert key in row, key
    for section, m in zip(sections, (1, 2), strict=True):
        sync, async_ = rows[section, "sync"], rows[section, "async"]
        assert sync["microbatches"] == async_["microbatches"] == m
        assert sync["ratio_to_sync"] == 1.0
        assert async_["ratio_to_sync"] == pytest.approx(async_["val_loss"] / sync["val_loss"])
        config = PipeMareBenchConfig(**{**TINY, "steps": 5})
        sim = simulate(variant_schedule(Variant.ASYNC, config, m))
        assert async_["max_tau"] == list(sim.delay)
    # The optimizers differ per section, so do the sync curves (same init, same batches).
    assert rows[sections[0], "sync"]["losses"][0] == rows[sections[1], "sync"]["losses"][0]
    assert rows[sections[0], "sync"]["losses"][1:] != rows[sections[1], "sync"]["losses"][1:]
    assert rows[sections[0], "async"]["max_tau"] == [3, 2, 1, 0]
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "pipemare" in text and "3 2 1 0" in text and "adamw m=2 lr=0.01" in text


def test_bad_variant_is_refused() -> None:
    with pytest.raises(ConfigError, match="variants"):
        _run_cli(["--variants", "sync,bogus"])


@pytest.mark.parametrize("text", ["sgd:1", "sgd:x:0.1", "rmsprop:1:0.1", "sgd:0:0.1", "sgd:1:-1"])
def test_bad_section_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="sections"):
        _run_cli(["--sections", text])
