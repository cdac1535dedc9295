"""Model definitions: a GPT-2 style decoder with presets, parameter and FLOP counts, and
Hugging Face decoders from a config.json (transformers imported only when one is built), each
behind a :class:`ModelSpec` (spec.py), through which the layers below ``train/`` receive them."""

from tidal.models.gpt import (
    GPT,
    PRESETS,
    Block,
    GPTConfig,
    ModelConfig,
    build_gpt,
    closed_form_num_params,
    gpt_init,
    gpt_saved_shares,
    measure_gpt,
    num_params,
    preset,
    profile_gpt,
    split_gpt,
    training_flops_per_token,
)
from tidal.models.hf import HFModelConfig
from tidal.models.spec import (
    ExportAdapter,
    GPTSpec,
    HFSpec,
    ModelSpec,
    build_stages,
    profile_decoder,
    spec_for,
    split_model,
    stage_parts,
)

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "ExportAdapter",
    "GPTConfig",
    "GPTSpec",
    "HFModelConfig",
    "HFSpec",
    "ModelConfig",
    "ModelSpec",
    "build_gpt",
    "build_stages",
    "gpt_init",
    "measure_gpt",
    "closed_form_num_params",
    "num_params",
    "preset",
    "profile_decoder",
    "gpt_saved_shares",
    "profile_gpt",
    "spec_for",
    "split_gpt",
    "split_model",
    "stage_parts",
    "training_flops_per_token",
]
