"""One front for the models a recipe can name: tidal's GPT presets and Hugging Face configs."""

from __future__ import annotations

import torch
from torch import nn

from tidal.memory.materialize import ParameterValues
from tidal.models.gpt import GPTConfig, build_gpt, gpt_init, training_flops_per_token
from tidal.models.hf import HFModelConfig, build_hf, hf_flops_per_token, hf_init

__all__ = ["build_model", "computes_loss", "model_flops_per_token", "model_init"]

AnyModelConfig = GPTConfig | HFModelConfig


def build_model(
    config: AnyModelConfig, *, device: str | torch.device = "meta", seed: int = 0
) -> nn.Module:
    """The model of ``config`` on ``device`` from ``seed`` (on the meta device: shapes only)."""
    if isinstance(config, HFModelConfig):
        return build_hf(config, device=device, seed=seed)
    return build_gpt(config, device=device, seed=seed)


def model_init(model: nn.Module, config: AnyModelConfig, seed: int) -> ParameterValues:
    """The values ``build_model(config, device=..., seed=seed)`` would give ``model``'s
    parameters, one at a time ([Note: deferred construction] in tidal/memory/materialize.py)."""
    if isinstance(config, HFModelConfig):
        return hf_init(model, seed)
    return gpt_init(model, seed)


def computes_loss(config: AnyModelConfig) -> bool:
    """Whether ``model(ids, targets)`` returns the loss (tidal's GPT), or ``model(ids).logits``
    are the logits to take it from (a Hugging Face model)."""
    return not isinstance(config, HFModelConfig)


def model_flops_per_token(config: AnyModelConfig, model: nn.Module) -> float:
    """Matmul FLOPs of one training pass per token (the MFU's numerator)."""
    if isinstance(config, HFModelConfig):
        return hf_flops_per_token(config, model)
    return training_flops_per_token(config)
