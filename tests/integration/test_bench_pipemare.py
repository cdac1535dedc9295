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

from tidal.bench.pipemare import (
    PipeMareBenchConfig,
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
from tidal.pipeline.pipemare import lr_scale
from tidal.pipeline.simulate import simulate

TINY = dict(
    steps=6, stages=4, microbatches=2, num_layers=4, d_model=16, num_heads=2, seq_len=8,
    batch_size=4, val_batches=2, lrs=(1e-2,), reschedule_fraction=1.0, sync_fraction=0.34,
)  # fmt: skip


def byte_splits() -> TokenSplits:
    rng = np.random.default_rng(0)
    # A repetitive byte stream, so a few steps lower the loss.
    train = np.tile(np.arange(40, dtype=np.uint8), 50) ^ rng.integers(0, 2, 2000, dtype=np.uint8)
    return TokenSplits(train=train, val=train[::-1].copy(), vocab_size=256, name="test")


def reference_training(config: PipeMareBenchConfig, splits: TokenSplits) -> tuple[list, float]:
    """Plain one-process training of the whole model: per-step losses and final val loss."""
    lr = config.lrs[0]
    model = build_model(config)
    optimizer = make_optimizer(model.parameters(), config, lr)
    schedule = lr_schedule(config, lr)
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
    sync = run_variant(Variant.SYNC, config, config.lrs[0], splits)
    ref_losses, ref_val = reference_training(config, splits)
    assert sync.losses == pytest.approx(ref_losses, abs=1e-5, rel=0)
    assert sync.val_loss == pytest.approx(ref_val, abs=1e-5, rel=0)
    assert ref_losses[-1] < ref_losses[0]  # the run trains: the comparison is not vacuous
    assert sync.max_tau() == [0, 0, 0, 0]

    warm = run_variant(Variant.PIPEMAREW, config, config.lrs[0], splits)
    sim = simulate(variant_schedule(Variant.PIPEMAREW, config))
    assert warm.delays == sim.delays
    assert warm.max_tau() == list(sim.delay)
    assert max(warm.max_tau()) >= 1  # the asynchronous phase does delay the first stage
    # Stage 0's rate: the base one divided by its measured delay, fading out at T1 (flushed
    # steps have tau = 0, so they keep the base rate).
    base, m, t1 = (
        lr_schedule(config, config.lrs[0]).lr_at,
        config.microbatches,
        config.lr_warmup_steps,
    )
    for k in range(config.steps):
        tau = sum(warm.delays[0, mb] for mb in range(k * m, (k + 1) * m)) / m
        assert warm.lrs[0, k] == pytest.approx(base(k) * lr_scale(tau, k, t1), rel=1e-12)
    assert any(warm.lrs[0, k] < 0.99 * base(k) for k in range(config.steps))


def _run_cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tidal bench pipemare")
    add_arguments(parser)
    console = Console(record=True, width=200, file=io.StringIO())
    code = run(parser.parse_args(argv), console)
    return code, console.export_text()


def test_command_writes_json_curves_and_png(tmp_path, monkeypatch) -> None:
    import tidal.bench.pipemare as bench

    splits = byte_splits()
    monkeypatch.setattr(bench, "build_token_splits", lambda *a, **k: splits)
    code, text = _run_cli(
        ["--steps", "5", "--stages", "4", "--layers", "4", "--microbatches", "1",
         "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "4",
         "--val-batches", "1", "--lr", "1e-2", "--variants", "sync,async",
         "--results-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    (path,) = tmp_path.glob("pipemare-*.json")
    report = json.loads(path.read_text())
    assert report["bench"] == "pipemare" and "git_commit" in report and "torch_version" in report
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["sync", "async"]
    for row in rows.values():
        assert len(row["losses"]) == 5 and len(row["stage0_lrs"]) == 5
        for key in ("final_train_loss", "val_loss", "max_tau", "diverged", "seconds"):
            assert key in row, key
    assert rows["sync"]["ratio_to_sync"] == 1.0
    assert rows["async"]["ratio_to_sync"] == pytest.approx(
        rows["async"]["val_loss"] / rows["sync"]["val_loss"]
    )
    sim = simulate(variant_schedule(Variant.ASYNC, PipeMareBenchConfig(**{**TINY, "steps": 5,
                   "microbatches": 1})))  # fmt: skip
    assert rows["async"]["max_tau"] == list(sim.delay) == [3, 2, 1, 0]
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "pipemare" in text and "3 2 1 0" in text


def test_bad_variant_is_refused() -> None:
    with pytest.raises(ConfigError, match="variants"):
        _run_cli(["--variants", "sync,bogus"])
