"""Model definitions: a GPT-2 style decoder with presets, parameter and FLOP counts, and
Hugging Face decoders from a config.json (transformers imported only when one is built)."""

from tidal.models.build import build_model, computes_loss, model_flops_per_token, model_init
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
from tidal.models.hf import HFModelConfig

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "GPTConfig",
    "HFModelConfig",
    "ModelConfig",
    "build_gpt",
    "build_model",
    "computes_loss",
    "gpt_init",
    "model_flops_per_token",
    "model_init",
    "closed_form_num_params",
    "num_params",
    "preset",
    "training_flops_per_token",
]
