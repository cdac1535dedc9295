"""Hugging Face decoders from a ``config.json``: the config, a model on the meta device, its
deterministic initial values, and its FLOPs per token.

``transformers`` is an optional extra, imported only inside the functions that need it. Models
are built offline (``AutoConfig.from_pretrained(path)`` of a local file, then
``AutoModelForCausalLM.from_config``) with SDPA attention and no key/value cache, as training
runs them. The families tidal plans and trains are :data:`SUPPORTED_MODEL_TYPES`: LLaMA (with
grouped-query attention) and GPT-2 (Conv1D, a tied head); their wiring is derived from the
traced graph (tidal/planner/wiring.py), so a model of either shape is covered, whatever its sizes.

[Note: Hugging Face initial values]
``hf_init(model, seed)`` draws every parameter from one CPU generator seeded with ``seed``, in
``named_parameters()`` order (a tied weight once), by Hugging Face's generic ``_init_weights``
rule: linear and embedding weights ``N(0, initializer_range)``, biases 0, norm weights 1. So
one seed gives the same values on every rank, in one process, on any device. Buffers are not
parameters: the rotary tables are computed by the model's own initialisation when the model is
built (:func:`build_hf`), on the CPU.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidal.config.configurable import ConfigError, require
from tidal.pipeline.split import NormHead, StageParts, TokenAndPositionEmbed, TokenEmbed

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFFamily",
    "HFModelConfig",
    "build_hf",
    "hf_family",
    "hf_stage_parts",
    "hf_config_path",
    "hf_flops_per_token",
    "hf_init",
    "load_pretrained_config",
]

SUPPORTED_MODEL_TYPES = ("llama", "gpt2")
_EXTRA = "pip install 'tidal[hf]' (transformers)"


@dataclass(kw_only=True, frozen=True, slots=True)
class HFModelConfig:
    """A Hugging Face decoder to train: its ``config.json`` and the sequence length, plus the
    figures the data and the metrics need, read from the file."""

    path: str  # the config.json
    seq_len: int
    model_type: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    max_positions: int

    def __post_init__(self) -> None:
        require(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len}")
        require(
            self.seq_len <= self.max_positions,
            "seq_len",
            f"{self.seq_len} is longer than the {self.max_positions} positions {self.path} "
            f"allows; train on at most {self.max_positions} tokens",
        )

    @classmethod
    def load(
        cls, path: str | Path, *, seq_len: int | None, key: str, seq_len_key: str = "seq_len"
    ) -> HFModelConfig:
        """The config at ``path`` (a file, or a folder holding config.json); ``seq_len``
        defaults to the model's positions. Errors are ConfigErrors under ``key`` (the sequence
        length's under ``seq_len_key``)."""
        config = load_pretrained_config(path, key=key)
        positions = _get(config, "max_position_embeddings", "n_positions")
        heads = _get(config, "num_attention_heads", "n_head")
        try:
            return cls(
                path=str(hf_config_path(path, key=key)),
                seq_len=positions if seq_len is None else seq_len,
                model_type=config.model_type,
                vocab_size=config.vocab_size,
                num_layers=_get(config, "num_hidden_layers", "n_layer"),
                hidden_size=_get(config, "hidden_size", "n_embd"),
                num_heads=heads,
                num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                max_positions=positions,
            )
        except ConfigError as err:
            raise ConfigError(seq_len_key if err.key == "seq_len" else key, err.message) from None

    def pretrained(self) -> Any:
        """The ``transformers`` config, set up for training: SDPA attention, no cache."""
        config = load_pretrained_config(self.path, key="model.hf_config")
        config.use_cache = False
        config._attn_implementation = "sdpa"
        return config


def _get(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ConfigError("model.hf_config", f"the config has none of {', '.join(names)}")


def hf_config_path(path: str | Path, *, key: str) -> Path:
    """``path`` itself if it is a file, ``path/config.json`` if it is a folder holding one."""
    found = Path(path)
    if found.is_dir():
        found = found / "config.json"
    if not found.is_file():
        raise ConfigError(
            key,
            f"no Hugging Face config at {str(path)!r}: give a config.json, or a folder holding one",
        )
    return found


def load_pretrained_config(path: str | Path, *, key: str) -> Any:
    """``AutoConfig`` of the local file at ``path``, offline, of a supported family."""
    file = hf_config_path(path, key=key)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(key, f"a Hugging Face model needs the hf extra: {_EXTRA}") from None
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{file} is not a JSON config ({err})") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            key,
            f"{file} is a {model_type!r} model; tidal plans and trains Hugging Face "
            f"{' and '.join(map(repr, SUPPORTED_MODEL_TYPES))} decoders (LlamaForCausalLM, "
            f"GPT2LMHeadModel)",
        )
    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(key, f"transformers cannot read {file}: {err}") from None


def build_hf(config: HFModelConfig, *, device: str | torch.device = "meta", seed: int = 0):
    """The model of ``config``: parameters on the meta device (``device="meta"``; buffers such as
    rotary tables computed on the CPU), or on ``device`` initialised from ``seed`` ([Note:
    Hugging Face initial values])."""
    from transformers import AutoModelForCausalLM

    pretrained = config.pretrained()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pretrained, attn_implementation="sdpa")
    for module in model.modules():
        if _tables(module):
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)  # the model's own rule computes its tables
    if torch.device(device).type == "meta":
        return model
    values = dict(hf_init(model, seed)())
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(values[name])
    for module in model.modules():  # to_empty dropped the buffers' values: compute them again
        if _tables(module):
            model._init_weights(module)
    return model


def _tables(module: nn.Module) -> bool:
    """A module holding buffers and no parameters (a rotary embedding's frequencies)."""
    has_buffers = any(True for _ in module.buffers(recurse=False))
    return has_buffers and not any(True for _ in module.parameters(recurse=False))


def _parameter_values(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    std = float(getattr(model.config, "initializer_range", 0.02))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if name.endswith("bias"):
            yield name, torch.zeros(param.shape)
        elif "Norm" in type(owner).__name__:
            yield name, torch.ones(param.shape)
        else:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            yield name, noise.mul_(std)


def hf_init(model: nn.Module, seed: int = 0) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """The init source of a :func:`build_hf` model for ``tidal.initialize(..., init=)`` and the
    engines: [Note: Hugging Face initial values]."""
    return functools.partial(_parameter_values, model, seed)


def hf_flops_per_token(config: HFModelConfig, model: nn.Module) -> float:
    """Matmul FLOPs of one forward and backward pass per token, by the convention of
    ``training_flops_per_token`` (gpt.py): ``6 N`` over the parameters of linear layers (each
    shared weight once), plus attention's ``12 L T d``."""
    linear = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
        for p in m.parameters(recurse=False)
    }
    attention = 12 * config.num_layers * config.seq_len * config.hidden_size
    return float(6 * sum(linear.values()) + attention)


# ---------------------------------------------------------------------------------------------
# pipeline stages

SPLITTABLE = (
    "tidal GPT, Hugging Face LlamaForCausalLM (model_type 'llama') and GPT2LMHeadModel "
    "(model_type 'gpt2'), the latter two with attn_implementation='sdpa'"
)


class HFFamily(enum.StrEnum):
    """Hugging Face layouts tidal cuts into stages, recognised by ``config.model_type`` and
    their submodules (transformers itself is not imported)."""

    LLAMA = "hf-llama"
    GPT2 = "hf-gpt2"


def hf_family(model: nn.Module) -> HFFamily:
    """Which layout ``model`` has; :class:`ConfigError` naming the supported kinds if none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family: HFFamily | None = None
    if model_type == "llama" and all(
        hasattr(getattr(model, "model", None), a)
        for a in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        family = HFFamily.LLAMA
    elif model_type == "gpt2" and hasattr(model, "transformer"):
        family = HFFamily.GPT2
        require(
            not getattr(model.config, "add_cross_attention", False),
            "model",
            "GPT-2 with cross-attention cannot be split; use a decoder-only GPT2LMHeadModel",
        )
    if family is None or not hasattr(model, "lm_head"):
        raise ConfigError(
            "model", f"cannot split a {type(model).__name__}: supported are {SPLITTABLE}"
        )
    impl = getattr(model.config, "_attn_implementation", None)
    require(
        impl == "sdpa",
        "model",
        f"{type(model).__name__} uses attn_implementation={impl!r}; stages rely on sdpa's causal "
        "attention without a mask: load it with attn_implementation='sdpa' "
        "(or call model.set_attn_implementation('sdpa'))",
    )
    return family


class _RotaryInputs(nn.Module):
    """What every LLaMA block takes besides the stream: positions ``arange(T)``, the rotary
    tables of them, and no mask (sdpa is then causal; [Note: stage boundaries] in
    tidal/pipeline/split.py)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x_BTD: torch.Tensor) -> dict[str, Any]:
        position_ids = torch.arange(x_BTD.shape[1], device=x_BTD.device).unsqueeze(0)
        return {
            "attention_mask": None,
            "position_ids": position_ids,
            "position_embeddings": self.rotary(x_BTD, position_ids=position_ids),
        }


def hf_stage_parts(model: nn.Module) -> StageParts:
    """The embedding, blocks and head of a Hugging Face LLaMA or GPT-2 decoder."""
    decoder: Any = model  # Hugging Face submodules are attributes nn.Module's stubs cannot name
    if hf_family(model) is HFFamily.LLAMA:
        inner = decoder.model
        return StageParts(
            embed=TokenEmbed(inner.embed_tokens),
            blocks=inner.layers,
            head=NormHead(inner.norm, decoder.lm_head),
            block_inputs=_RotaryInputs(inner.rotary_emb),
            container="model.layers",
        )
    inner = decoder.transformer
    return StageParts(
        embed=TokenAndPositionEmbed(inner.wte, inner.wpe, inner.drop),
        blocks=inner.h,
        head=NormHead(inner.ln_f, decoder.lm_head),
        container="transformer.h",
    )
