"""A torch optimizer class as ``[optimizer]`` for the engines that step their own ([Note: your
optimizer] in tidal/train/user_optim.py): torch's defaults, a constant rate, decay on all."""

from __future__ import annotations

import pytest
import torch

from tidal.config import ConfigError
from tidal.parallel.config import OptimizerConfig
from tidal.train.job import load_job
from tidal.train.user_optim import optimizer_config, own_optimizer, runs_on

CONSTANT = {"warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay_on": "all"}


def test_torch_classes_map_with_torch_defaults() -> None:
    sgd = optimizer_config(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True},
                           runs_on="chunk")  # fmt: skip
    assert sgd == OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True,
                                  weight_decay=0.0, **CONSTANT)  # fmt: skip
    adamw = optimizer_config(torch.optim.AdamW, {}, runs_on="chunk")
    assert adamw == OptimizerConfig(name="adamw", lr=1e-3, beta1=0.9, beta2=0.999,
                                    weight_decay=0.01, **CONSTANT)  # fmt: skip
    decoupled = optimizer_config(torch.optim.Adam, {"decoupled_weight_decay": True},
                                 runs_on="plan")  # fmt: skip
    assert decoupled.name == "adamw" and decoupled.weight_decay == 0.0
    assert optimizer_config(torch.optim.Adam, {"foreach": False}, runs_on="chunk").name == "adam"


def test_arguments_it_does_not_implement_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match="FSDP2 stages step their own optimizer .*maximize=True"):
        optimizer_config(torch.optim.SGD, {"maximize": True}, runs_on="sharded stages")
    with pytest.raises(ConfigError, match=r"optimizer_kwargs: torch.optim.sgd.SGD takes no betas"):
        optimizer_config(torch.optim.SGD, {"betas": (0.9, 0.9)}, runs_on="chunk")


@pytest.mark.parametrize(
    ("settings", "plan", "taken_by"),
    [
        ({}, False, None),  # one plain stage takes yours
        ({"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b"}}, False, None),
        ({"dp": 2}, False, None),
        ({"engine": "chunk"}, False, "chunk"),
        ({"engine": "chunk", "parallel": {"pp": 2}}, False, "chunk"),
        ({}, True, "plan"),
        ({"parallel": {"tp": 2}}, False, "sharded stages"),
        ({"parallel": {"fsdp2": True}}, False, "sharded stages"),
        ({"parallel": {"pp": 2}, "pipeline": {"schedule": "pipemare"}}, False,
         "asynchronous stages"),
    ],
    ids=["one-stage", "1f1b", "dp2", "chunk", "chunk-stages", "plan", "tp", "fsdp2", "pipemare"],
)  # fmt: skip
def test_plain_synchronous_stages_take_your_optimizer_and_the_rest_say_what_steps_theirs(
    settings: dict, plan: bool, taken_by: str | None
) -> None:
    settings = dict(settings)
    if settings.pop("dp", None):
        settings["parallel"] = {"dp": 2}
    job = load_job({"model": {"preset": "tiny"}, **settings})  # no [optimizer]: yours is the one
    assert runs_on(job, plan=plan) == taken_by
    if taken_by is None:
        return
    with pytest.raises(ConfigError, match="^optimizer: .*not the factory") as err:
        own_optimizer(job, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), optimizer_kwargs=None,
                      lr_scheduler=None, runs_on=taken_by)  # fmt: skip
    assert "\n" not in str(err.value)
