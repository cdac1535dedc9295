"""A DeepSpeed JSON config read as tidal settings: the keys with a tidal meaning, and every other
key named as ignored, so a user's existing config works and says what it left behind.

[Note: deepspeed keys]
DeepSpeed's batch is per GPU (``train_micro_batch_size_per_gpu``, with ``train_batch_size`` =
micro x accumulation x ranks); tidal's ``training.batch_size`` is the micro-batch over all ranks
([Note: global batch] in trainer.py), so the micro-batch is multiplied by the world size (from
``WORLD_SIZE``, as torchrun sets it). ZeRO stage 3 is the chunk engine, sharded over the ranks
(one process: chunks under budgets); stages 1 and 2 are served by it too, which also shards the
parameters (said among the notes); stage 0 is the reference engine. CPU offload of parameters
or optimizer state needs no key: the chunk engine keeps on the device what its budget holds and
the rest on the host (``memory.device_budget`` decides, ``auto`` without one); NVMe offload is
``memory.nvme_dir``. DeepSpeed's ``WarmupLR`` holds the rate after warm-up, ``WarmupDecayLR``
decays it linearly and ``WarmupCosineLR`` by a cosine; tidal's schedule is warm-up then cosine,
so the first two are approximated (said among the notes). Activation checkpointing has no
setting in tidal's config (its GPT recomputes per block through the planner): noted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidal.config import ConfigError

__all__ = ["from_deepspeed", "is_deepspeed_config", "load_deepspeed"]

# Keys whose presence says "this is a DeepSpeed config", for tidal.initialize's dict argument.
_MARKERS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "fp16", "bf16", "gradient_clipping",
})  # fmt: skip
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}


def is_deepspeed_config(data: Mapping[str, Any]) -> bool:
    return bool(_MARKERS & data.keys())


def load_deepspeed(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("--deepspeed", f"no DeepSpeed config at {str(path)!r}") from None
    except ValueError as err:
        raise ConfigError("--deepspeed", f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(
            "--deepspeed", f"{path} holds a JSON {type(data).__name__}, not an object"
        )
    return data


class _Reader:
    """Takes keys out of a DeepSpeed dict as they are mapped; what is left was ignored."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.left = _flatten(data)
        self.notes: list[str] = []

    def take(self, key: str, default: Any = None) -> Any:
        return self.left.pop(key, default)

    def take_under(self, prefix: str) -> dict[str, Any]:
        taken = {
            k[len(prefix) + 1 :]: v for k, v in self.left.items() if k.startswith(f"{prefix}.")
        }
        for key in taken:
            del self.left[f"{prefix}.{key}"]
        return taken


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def from_deepspeed(
    data: Mapping[str, Any], *, world_size: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """tidal settings (a nested dict, as a recipe's tables) for a DeepSpeed config, and one line
    for every key ignored or approximated ([Note: deepspeed keys])."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    r = _Reader(data)
    training: dict[str, Any] = {}
    optimizer: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    out: dict[str, Any] = {}
    _batch(r, training, world)
    if (clip := r.take("gradient_clipping")) is not None:
        training["grad_clip_norm"] = float(clip)
    _precision(r, training)
    _optimizer(r, optimizer)
    _scheduler(r, optimizer)
    _zero(r, out, memory)
    if r.take_under("activation_checkpointing"):
        r.notes.append("activation_checkpointing: no tidal setting (ignored)")
    for key, value in {"training": training, "optimizer": optimizer, "memory": memory}.items():
        if value:
            out[key] = value
    ignored = [f"{key}: ignored (no tidal meaning)" for key in sorted(r.left)]
    return out, [*r.notes, *ignored]


def _batch(r: _Reader, training: dict[str, Any], world: int) -> None:
    micro, total = r.take("train_micro_batch_size_per_gpu"), r.take("train_batch_size")
    accum = r.take("gradient_accumulation_steps")
    if accum is not None:
        training["grad_accum_steps"] = int(accum)
    if micro is not None:
        training["batch_size"] = int(micro) * world
        if total is not None and int(total) != int(micro) * int(accum or 1) * world:
            raise ConfigError(
                "train_batch_size",
                f"{total} is not train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"world size = {micro} x {accum or 1} x {world}; fix one of them",
            )
    elif total is not None:
        per_step = int(total) // int(accum or 1)
        if per_step * int(accum or 1) != int(total):
            raise ConfigError(
                "train_batch_size",
                f"{total} does not divide by gradient_accumulation_steps = {accum}",
            )
        training["batch_size"] = per_step


def _precision(r: _Reader, training: dict[str, Any]) -> None:
    bf16, fp16 = r.take("bf16.enabled"), r.take("fp16.enabled")
    if bf16 and fp16:
        raise ConfigError("bf16", "bf16.enabled and fp16.enabled are both true; pick one")
    if bf16:
        training["precision"] = "bf16"
    elif fp16:
        training["precision"] = "fp16"
        scaling = r.take_under("fp16")
        if scaling:
            r.notes.append(
                f"fp16.{', fp16.'.join(sorted(scaling))}: tidal's dynamic loss scale has its "
                f"own settings (ignored)"
            )
    r.take_under("bf16")


def _optimizer(r: _Reader, optimizer: dict[str, Any]) -> None:
    kind = r.take("optimizer.type")
    if kind is None:
        return
    name = _OPTIMIZERS.get(str(kind).lower())
    if name is None:
        raise ConfigError(
            "optimizer.type",
            f"{kind!r} has no tidal equivalent; tidal trains with AdamW, Adam or SGD",
        )
    optimizer["name"] = name
    params = r.take_under("optimizer.params")
    for ds_key, key in (("lr", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay"),
                        ("momentum", "momentum")):  # fmt: skip
        if ds_key in params:
            optimizer[key] = float(params.pop(ds_key))
    if "betas" in params:
        optimizer["beta1"], optimizer["beta2"] = map(float, params.pop("betas"))
    for key in sorted(params):
        r.notes.append(f"optimizer.params.{key}: ignored (no tidal meaning)")


def _scheduler(r: _Reader, optimizer: dict[str, Any]) -> None:
    kind = r.take("scheduler.type")
    if kind is None:
        return
    params = r.take_under("scheduler.params")
    if "warmup_num_steps" in params:
        optimizer["warmup_steps"] = int(params.pop("warmup_num_steps"))
    if "total_num_steps" in params:
        optimizer["decay_steps"] = int(params.pop("total_num_steps"))
    if "warmup_max_lr" in params:
        optimizer["lr"] = float(params.pop("warmup_max_lr"))
    if "warmup_min_lr" in params:
        params.pop("warmup_min_lr")
        r.notes.append("scheduler.params.warmup_min_lr: tidal warms up from lr / warmup_steps")
    if kind != "WarmupCosineLR":
        r.notes.append(
            f"scheduler.type {kind}: approximated by tidal's warm-up then cosine decay "
            f"(optimizer.min_lr_ratio)"
        )
    for key in sorted(params):
        r.notes.append(f"scheduler.params.{key}: ignored (no tidal meaning)")


def _zero(r: _Reader, out: dict[str, Any], memory: dict[str, Any]) -> None:
    zero = r.take_under("zero_optimization")
    stage = int(zero.pop("stage", 0))
    out["engine"] = "chunk" if stage > 0 else "reference"
    if stage in (1, 2):
        r.notes.append(
            f"zero_optimization.stage {stage}: served by the chunk engine, which shards the "
            f"parameters too (ZeRO-3)"
        )
    devices = {zero.pop(f"{what}.device", None) for what in ("offload_param", "offload_optimizer")}
    paths = {zero.pop(f"{what}.nvme_path", None) for what in ("offload_param", "offload_optimizer")}
    if "nvme" in devices:
        given = sorted(str(p) for p in paths - {None})
        if len(given) != 1:
            raise ConfigError(
                "zero_optimization",
                "NVMe offload needs one nvme_path (tidal keeps every shard on disk in one "
                f"folder, memory.nvme_dir); got {given or 'none'}",
            )
        memory["nvme_dir"] = given[0]
    if "cpu" in devices:
        r.notes.append(
            "offload to cpu: the chunk engine keeps on the device what memory.device_budget "
            "holds and the rest on the host; set the budget (--set memory.device_budget=SIZE)"
        )
    if devices & {"cpu", "nvme"} and stage == 0:
        raise ConfigError(
            "zero_optimization", "offload needs ZeRO (stage 1-3); stage 0 keeps everything on "
            "the device",
        )  # fmt: skip
    for key in sorted(zero):
        r.notes.append(f"zero_optimization.{key}: ignored (tidal places by byte budgets)")
