"""A DeepSpeed config read as tidal settings ([Note: deepspeed keys] in
tidal/train/deepspeed_config.py): what maps, what is named as ignored, and a ZeRO-3 CPU-offload
config that trains exactly as the same run configured natively."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from torch import nn

import tidal
from tidal.cli.main import main
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.train.deepspeed_config import from_deepspeed
from tidal.train.metrics import read_metrics

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-7,
                                              "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2,
                                                       "total_num_steps": 6}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "stage3_prefetch_bucket_size": 5e7},
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
}  # fmt: skip

NATIVE = [
    "engine=chunk", "training.batch_size=2", "training.grad_accum_steps=2",
    "training.grad_clip_norm=0.5", "training.precision=bf16", "optimizer.name=adamw",
    "optimizer.lr=0.002", "optimizer.beta1=0.9", "optimizer.beta2=0.99", "optimizer.eps=1e-7",
    "optimizer.weight_decay=0.05", "optimizer.warmup_steps=2", "optimizer.decay_steps=6",
]  # fmt: skip


def test_the_keys_with_a_tidal_meaning_map_and_every_other_is_named() -> None:
    mapped, notes = from_deepspeed(DS, world_size=2)
    assert mapped == {
        "engine": "chunk",
        "training": {"grad_accum_steps": 2, "batch_size": 4, "grad_clip_norm": 0.5,
                     "precision": "bf16"},
        "optimizer": {"name": "adamw", "lr": 2e-3, "eps": 1e-7, "weight_decay": 0.05,
                      "beta1": 0.9, "beta2": 0.99, "warmup_steps": 2, "decay_steps": 6},
    }  # fmt: skip
    text = "\n".join(notes)
    for key in ("steps_per_print", "wall_clock_breakdown", "stage3_prefetch_bucket_size",
                "offload_optimizer.pin_memory", "offload to cpu"):  # fmt: skip
        assert key in text, (key, notes)


def test_a_zero3_cpu_offload_config_trains_as_the_native_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(DS))
    common = ["--recipe", "tiny", "--no-plots", "--set", "training.steps=6",
              "--set", "training.val_every=0", "--set", "training.log_every=1",
              "--set", "memory.device_budget=2700KiB", "--set", "chunk.size=128"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tidal.train.job"):
        assert main(["train", *common, "--deepspeed", str(ds_path),
                     "--set", f"run_dir={tmp_path / 'ds'}"]) == 0  # fmt: skip
    assert any("steps_per_print: ignored" in r.getMessage() for r in caplog.records)
    native = [arg for setting in NATIVE for arg in ("--set", setting)]
    assert main(["train", *common, *native, "--set", f"run_dir={tmp_path / 'native'}"]) == 0

    def losses(run: str) -> list[tuple[int, float, float]]:
        records = read_metrics(tmp_path / run)
        return [(r["step"], r["loss"], r["lr"]) for r in records if r["kind"] == "train"]

    assert losses("ds") == losses("native") and len(losses("ds")) == 6
    summary = json.loads((tmp_path / "ds" / "summary.json").read_text())
    assert summary["engine"] == "chunk" and summary["evictions"] > 0


def test_initialize_takes_a_deepspeed_dict_and_a_json_recipe_is_pointed_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = tidal.initialize(nn.Linear(8, 8), {**DS, "bf16": {"enabled": False}})
    assert isinstance(engine.chunks, ChunkEngine)  # ZeRO-3 offload: the chunk transform
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(DS))
    assert main(["train", "--recipe", str(ds_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--deepspeed {ds_path}" in err, err


@pytest.mark.parametrize(
    ("zero", "fragment"),
    [
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "got none"),
        ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
          "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}, "got ['/a', '/b']"),
    ],
)  # fmt: skip
def test_nvme_offload_needs_one_folder(zero: dict, fragment: str) -> None:
    with pytest.raises(tidal.ConfigError, match="needs one nvme_path") as err:
        from_deepspeed({"zero_optimization": zero}, world_size=1)
    assert fragment in str(err.value)
    mapped, _ = from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/disk"}}}, world_size=1)  # fmt: skip
    assert mapped["memory"] == {"nvme_dir": "/disk"}


@pytest.mark.parametrize(
    ("change", "key", "named"),
    [
        ({"train_batch_size": 12}, "train_batch_size", "= 2 x 2 x 2"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "'Lamb' has no tidal equivalent"),
    ],
)
def test_a_batch_that_does_not_add_up_and_an_unknown_optimizer_are_refused(
    change: dict, key: str, named: str
) -> None:
    with pytest.raises(tidal.ConfigError) as refused:
        from_deepspeed({**DS, **change}, world_size=2)
    assert refused.value.key == key and named in str(refused.value)
