"""Model definitions: a GPT-2 style decoder with presets, parameter and FLOP counts."""

from tidal.models.gpt import (
    GPT,
    PRESETS,
    Block,
    GPTConfig,
    ModelConfig,
    build_gpt,
    closed_form_num_params,
    gpt_init,
    num_params,
    preset,
    training_flops_per_token,
)

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "GPTConfig",
    "ModelConfig",
    "build_gpt",
    "gpt_init",
    "closed_form_num_params",
    "num_params",
    "preset",
    "training_flops_per_token",
]
