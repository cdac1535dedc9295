"""A user's own model in a recipe: ``[model] factory = "package.module:function"``.

[Note: factory models]
The function takes no arguments and returns an ``nn.Module`` whose ``forward(ids)`` maps token
ids ``[batch, seq_len]`` to logits ``[batch, seq_len, vocab]`` (a tensor, or an object with
``.logits`` as Hugging Face models return); the trainer takes the next-token cross-entropy. It
is built for real on the CPU from the run's seed (not on the meta device: a user's buffers,
a norm's running statistics say, have values the meta device would lose), then handed to the
engine like a model given to ``tidal.initialize``. It trains on the reference and chunk engines,
on one process or sharded over ranks, with the same metrics, checkpoints and exact resume;
pipelines, plans and ``tidal export`` need a model whose structure tidal knows (its GPT or a
Hugging Face decoder), and say so. Model FLOPs are counted as 6 x parameters per token (the
dense estimate; attention is left out).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import torch
from torch import nn

from tidal.config import ConfigError

__all__ = ["FactoryConfig", "FactorySpec", "load_factory"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FactoryConfig:
    """A factory model's resolved ``[model]`` section."""

    factory: str
    seq_len: int
    vocab_size: int


def load_factory(spec: str, *, key: str = "model.factory") -> Callable[[], Any]:
    """The function ``"package.module:function"`` names; a ConfigError naming ``key`` saying
    what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(key, f"expected 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            key,
            f"cannot import {module_name!r} ({err}); put its folder on PYTHONPATH or install it",
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(key, f"{module_name} has no function {attr!r}")
    return fn


def _refuse(what: str) -> NoReturn:
    raise ConfigError(
        "model.factory",
        f"{what} needs a model whose structure tidal knows (its GPT presets or a Hugging Face "
        f"decoder through model.hf_config); a factory model trains on the reference and chunk "
        f"engines",
    )


@dataclass(frozen=True, slots=True)
class FactorySpec:
    """The spec of a factory model ([Note: factory models])."""

    config: FactoryConfig
    computes_loss: ClassVar[bool] = False
    deferred: ClassVar[bool] = False  # built for real, not on the meta device

    def build(self, *, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
        if torch.device(device).type == "meta":
            _refuse("building on the meta device")
        torch.manual_seed(seed)
        model = load_factory(self.config.factory)()
        if not isinstance(model, nn.Module):
            raise ConfigError(
                "model.factory",
                f"{self.config.factory} returned a {type(model).__name__}, not an nn.Module",
            )
        return model.to(device)

    def init(self, model: nn.Module, seed: int) -> NoReturn:
        _refuse("deferred construction")

    def stage_parts(self, model: nn.Module) -> NoReturn:
        _refuse("a pipeline")

    def split(self, model: nn.Module, block_ranges: Sequence[tuple[int, int]]) -> NoReturn:
        _refuse("a pipeline")

    def profile(self, model: nn.Module, **kwargs: Any) -> NoReturn:
        _refuse("a pipeline")

    def graph(self, *, micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> NoReturn:
        _refuse("tidal plan")

    def wiring(self, model: nn.Module) -> NoReturn:
        _refuse("a plan")

    def num_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    def flops_per_token(self, model: nn.Module) -> float:
        return 6.0 * self.num_params(model)

    def export_adapter(self, model: nn.Module) -> NoReturn:
        _refuse("tidal export")
