"""``tidal bench train``: rows per recipe and variant, and a self-describing JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_train, write_results
from tidal.config import ConfigError


@pytest.mark.slow
def test_bench_rows_and_results_file(tmp_path: Path) -> None:
    # The chunk engine, whose optimizer is tidal's own: each case's process then skips what
    # torch.optim's first add_param_group imports (torch._dynamo, about 3 s). The bench's rows
    # are the same for either engine.
    rows = bench_train(
        ["tiny"],
        ["training.batch_size=2", "engine=chunk"],
        variants=["", "training.precision=bf16,training.seed=3"],
        steps=4,
        warmup_steps=1,
    )
    assert [(r["recipe"], r["precision"]) for r in rows] == [("tiny", "fp32"), ("tiny", "bf16")]
    for row in rows:
        assert row["steady_steps"] == 3
        assert row["tokens_per_step"] == 2 * 64
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["median_step_s"])
        assert row["peak_memory_bytes"]["host"] > 0
    path = write_results("train", rows, folder=tmp_path)
    data = json.loads(path.read_text())
    for key in ("command", "git_commit", "torch_version", "device", "created_at"):
        assert key in data
    assert data["bench"] == "train" and data["rows"] == rows


def test_bench_checks_every_case_before_running() -> None:
    with pytest.raises(ConfigError, match="training.precision"):
        bench_train(["tiny"], variants=["", "training.precision=fp9"], steps=4, warmup_steps=1)
    with pytest.raises(ValueError, match="must exceed"):
        bench_train(["tiny"], steps=2, warmup_steps=2)
