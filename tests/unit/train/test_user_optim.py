"""A torch optimizer class as ``[optimizer]`` for the engines that step their own ([Note: your
optimizer] in tidal/train/user_optim.py): torch's defaults, a constant rate, decay on all."""

from __future__ import annotations

import pytest
import torch

from tidal.config import ConfigError
from tidal.parallel.config import OptimizerConfig
from tidal.train.user_optim import optimizer_config

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
