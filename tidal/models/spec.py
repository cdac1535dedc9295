"""Models behind one interface: a :class:`ModelSpec` says all that the layers below ``train/``
need of a model, and ``train/`` hands it to them piece by piece.

[Note: model specs]
No layer below ``train/`` imports ``tidal.models``: the planner, the pipeline and the engines take
what a model gives them as values (a built model, its :class:`~tidal.pipeline.split.StageParts`,
its init values) and never build or recognise one. A spec is where those values come from, one
per family: :class:`GPTSpec` for tidal's GPT, :class:`HFSpec` for Hugging Face decoders
(LLaMA, GPT-2), chosen from the ``[model]`` section by :func:`spec_for`.

``ModelSpec`` is a Protocol, not a dataclass of callables, because every one of its operations
needs the same resolved config (the build, the init rule, the FLOPs, the export config), which
a small frozen class per family holds once; a Protocol keeps the two families free of a common
base while the type checker still sees one interface. Operations that take a built model
(``stage_parts``, ``split``, ``profile``, ``wiring``, ``num_params``) read it, not the config, so
they serve any model of the family, as :func:`split_model` and :func:`profile_decoder` do for a
model built elsewhere.

[Note: export adapters]
An :class:`ExportAdapter` maps a state dict between the model's own names and the names of the
file an export writes, and carries the config that rebuilds the model from that file. tidal's
GPT is exported under its own names, each tied weight under all of its names (a strict
``load_state_dict`` then works): identity. A Hugging Face model is exported as Hugging Face
stores it: a weight tied to another (GPT-2's ``lm_head.weight``) is left out of the file, and
``from_export`` puts it back under its name, as ``tie_weights`` does on loading.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.materialize import ParameterValues
from tidal.models.factory import FactoryConfig, FactorySpec
from tidal.models.gpt import (
    GPT,
    GPTConfig,
    ModelConfig,
    build_gpt,
    gpt_init,
    gpt_stage_parts,
    measure_gpt,
    num_params,
    training_flops_per_token,
)
from tidal.models.hf import (
    HFModelConfig,
    build_hf,
    hf_flops_per_token,
    hf_init,
    hf_stage_parts,
)
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.split import PipelineStage, StageParts, split_parts
from tidal.pipeline.stage_init import materialize_stages

if TYPE_CHECKING:  # the planner (scipy) loads only when a spec measures, profiles or wires
    from tidal.planner.measure import ModelGraph
    from tidal.planner.megatron import TransformerShape
    from tidal.planner.wiring import ModelWiring

__all__ = [
    "ExportAdapter",
    "build_stages",
    "GPTSpec",
    "HFSpec",
    "ModelSpec",
    "profile_decoder",
    "spec_for",
    "split_model",
    "stage_parts",
]

StateDict = dict[str, torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class ExportAdapter:
    """How a model's state dict leaves tidal ([Note: export adapters])."""

    format: str  # "tidal-gpt": tidal.json + tidal's names; "hf": config.json + Hugging Face's
    config: dict[str, Any]  # what rebuilds the model: GPTConfig's fields, or config.json's
    to_export: Callable[[Mapping[str, torch.Tensor]], StateDict]  # model names -> file names
    from_export: Callable[[Mapping[str, torch.Tensor]], StateDict]  # file names -> model names


class ModelSpec(Protocol):
    """A model family bound to one resolved config; see [Note: model specs]."""

    @property
    def config(self) -> GPTConfig | HFModelConfig: ...

    @property
    def computes_loss(self) -> bool:
        """Whether ``model(ids, targets)`` returns the loss (tidal's GPT), or
        ``model(ids).logits`` are the logits to take it from (a Hugging Face model)."""
        ...

    def build(self, *, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
        """The model on ``device`` initialised from ``seed``; on the meta device, shapes only."""
        ...

    def init(self, model: nn.Module, seed: int) -> ParameterValues:
        """The values ``build(device=..., seed=seed)`` gives ``model``'s parameters, one at a
        time ([Note: deferred construction] in tidal/memory/materialize.py)."""
        ...

    def stage_parts(self, model: nn.Module) -> StageParts: ...

    def split(
        self, model: nn.Module, block_ranges: Sequence[tuple[int, int]]
    ) -> list[PipelineStage]: ...

    def profile(self, model: nn.Module, **kwargs: Any) -> list[LayerProfile]:
        """Layer profiles for the pipeline partitioner; ``kwargs``: those of
        :func:`tidal.planner.stage_profile.profile_model` but ``parts``."""
        ...

    def graph(self, *, micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> ModelGraph:
        """The planner's measured graph at the config's sequence length."""
        ...

    def wiring(self, model: nn.Module) -> ModelWiring:
        """What ``tidal.parallel.plan_apply`` needs to carry a tensor-parallel plan out on ``model``."""
        ...

    def num_params(self, model: nn.Module) -> int: ...

    def flops_per_token(self, model: nn.Module) -> float:
        """Matmul FLOPs of one training pass per token (the MFU's numerator)."""
        ...

    def export_adapter(self, model: nn.Module) -> ExportAdapter: ...


# ---------------------------------------------------------------------------------------------
# parts shared by both families


def _split(
    spec: ModelSpec, model: nn.Module, ranges: Sequence[tuple[int, int]]
) -> list[PipelineStage]:
    return split_parts(model, spec.stage_parts(model), ranges)


def _profile(spec: ModelSpec, model: nn.Module, **kwargs: Any) -> list[LayerProfile]:
    from tidal.planner.stage_profile import profile_model

    return profile_model(model, parts=spec.stage_parts(model), **kwargs)


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name that repeats an earlier parameter, and that earlier name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


# ---------------------------------------------------------------------------------------------
# tidal's GPT


@dataclass(kw_only=True, frozen=True, slots=True)
class GPTSpec:
    """tidal's :class:`~tidal.models.gpt.GPT` of ``config``."""

    config: GPTConfig
    computes_loss: ClassVar[bool] = True
    deferred: ClassVar[bool] = True  # built on the meta device, values streamed by init()

    def build(self, *, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
        return build_gpt(self.config, device=device, seed=seed)

    def init(self, model: nn.Module, seed: int) -> ParameterValues:
        return gpt_init(_gpt(model), seed)

    def stage_parts(self, model: nn.Module) -> StageParts:
        return gpt_stage_parts(_gpt(model))

    def split(
        self, model: nn.Module, block_ranges: Sequence[tuple[int, int]]
    ) -> list[PipelineStage]:
        return _split(self, model, block_ranges)

    def profile(self, model: nn.Module, **kwargs: Any) -> list[LayerProfile]:
        return _profile(self, model, **kwargs)

    def graph(self, *, micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> ModelGraph:
        return measure_gpt(self.config, micro_batch=micro_batch, dtype=dtype)

    def transformer_shape(self) -> TransformerShape:
        """The sizes Megatron-LM's formulas read (tidal/planner/megatron.py)."""
        from tidal.planner.megatron import TransformerShape

        c = self.config
        return TransformerShape(num_layers=c.num_layers, hidden=c.d_model, heads=c.num_heads,
                                ffn=c.ffn_dim, seq_len=c.seq_len, vocab=c.vocab_size,
                                tied=c.tie_embeddings)  # fmt: skip

    def wiring(self, model: nn.Module) -> ModelWiring:
        from tidal.planner.wiring import derive_wiring, structure_graph

        return derive_wiring(structure_graph(model, seq_len=self.config.seq_len))

    def num_params(self, model: nn.Module) -> int:
        return num_params(model)

    def flops_per_token(self, model: nn.Module) -> float:
        return training_flops_per_token(self.config)

    def export_adapter(self, model: nn.Module) -> ExportAdapter:
        return ExportAdapter(
            format="tidal-gpt",
            config=dataclasses.asdict(self.config),
            to_export=dict,
            from_export=dict,
        )


# ---------------------------------------------------------------------------------------------
# Hugging Face decoders


@dataclass(kw_only=True, frozen=True, slots=True)
class HFSpec:
    """A Hugging Face decoder (LLaMA, GPT-2) of ``config`` (its config.json)."""

    config: HFModelConfig
    computes_loss: ClassVar[bool] = False
    deferred: ClassVar[bool] = True

    def build(self, *, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
        return build_hf(self.config, device=device, seed=seed)

    def init(self, model: nn.Module, seed: int) -> ParameterValues:
        return hf_init(model, seed)

    def stage_parts(self, model: nn.Module) -> StageParts:
        return hf_stage_parts(model)

    def split(
        self, model: nn.Module, block_ranges: Sequence[tuple[int, int]]
    ) -> list[PipelineStage]:
        return _split(self, model, block_ranges)

    def profile(self, model: nn.Module, **kwargs: Any) -> list[LayerProfile]:
        return _profile(self, model, **kwargs)

    def graph(self, *, micro_batch: int, dtype: torch.dtype = torch.bfloat16) -> ModelGraph:
        model = self.build().to(dtype)
        from tidal.planner.measure import measure
        from tidal.planner.wiring import example_inputs

        inputs = example_inputs(model, micro_batch=micro_batch, seq_len=self.config.seq_len)
        return measure(model, inputs, name=Path(self.config.path).parent.name or self.config.path)

    def transformer_shape(self) -> TransformerShape:
        """The sizes Megatron-LM's formulas read; LLaMA's MLP is gated (SwiGLU)."""
        from tidal.planner.megatron import TransformerShape

        c, hf = self.config, self.config.pretrained()
        ffn = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None)
        return TransformerShape(num_layers=c.num_layers, hidden=c.hidden_size, heads=c.num_heads,
                                ffn=int(ffn or 4 * c.hidden_size), seq_len=c.seq_len,
                                vocab=c.vocab_size, query_groups=c.num_kv_heads,
                                tied=bool(getattr(hf, "tie_word_embeddings", True)),
                                gated=c.model_type == "llama")  # fmt: skip

    def wiring(self, model: nn.Module) -> ModelWiring:
        from tidal.planner.wiring import derive_wiring, structure_graph

        return derive_wiring(structure_graph(model, seq_len=self.config.seq_len))

    def num_params(self, model: nn.Module) -> int:
        return num_params(model)

    def flops_per_token(self, model: nn.Module) -> float:
        return hf_flops_per_token(self.config, model)

    def export_adapter(self, model: nn.Module) -> ExportAdapter:
        tied = _tied_names(model)

        def to_export(state: Mapping[str, torch.Tensor]) -> StateDict:
            return {k: v for k, v in state.items() if k not in tied}

        def from_export(state: Mapping[str, torch.Tensor]) -> StateDict:
            missing = [source for name, source in tied.items() if source not in state]
            if missing:
                raise ConfigError(
                    "export", f"the exported state lacks {missing}, which tied weights repeat"
                )
            return {**state, **{name: state[source] for name, source in tied.items()}}

        config = json.loads(Path(self.config.path).read_text())
        return ExportAdapter(
            format="hf", config=config, to_export=to_export, from_export=from_export
        )


# ---------------------------------------------------------------------------------------------
# choosing


def spec_for(
    config: ModelConfig | GPTConfig | HFModelConfig | FactoryConfig,
) -> GPTSpec | HFSpec | FactorySpec:
    """The spec of a recipe's ``[model]`` section, or of a resolved config."""
    if isinstance(config, ModelConfig):
        config = config.resolve()
    if isinstance(config, HFModelConfig):
        return HFSpec(config=config)
    if isinstance(config, FactoryConfig):
        return FactorySpec(config=config)
    return GPTSpec(config=config)


def build_stages(
    spec: GPTSpec | HFSpec | FactorySpec,
    model: nn.Module,
    block_ranges: Sequence[tuple[int, int]],
    *,
    mine: Sequence[int],
    device: torch.device,
    seed: int,
) -> list[PipelineStage]:
    """All stages of ``model`` (``spec.build(device="meta")``), those numbered ``mine`` on
    ``device`` with the values ``spec.build(device=device, seed=seed)`` gives their parameters,
    the others on the meta device ([Note: stages from the meta device] in
    tidal/pipeline/stage_init.py)."""
    stages = spec.split(model, block_ranges)
    materialize_stages(stages, mine, spec.init(model, seed), device)
    return stages


def stage_parts(model: nn.Module) -> StageParts:
    """The stage parts of a tidal GPT or a Hugging Face LLaMA / GPT-2, however it was built
    (:class:`ConfigError` naming the supported kinds for any other model)."""
    if isinstance(model, GPT):
        return gpt_stage_parts(model)
    return hf_stage_parts(model)


def split_model(model: nn.Module, block_ranges: Sequence[tuple[int, int]]) -> list[PipelineStage]:
    """Stages of a tidal GPT or a Hugging Face LLaMA / GPT-2 (tidal/pipeline/split.py)."""
    return split_parts(model, stage_parts(model), block_ranges)


def profile_decoder(model: nn.Module, **kwargs: Any) -> list[LayerProfile]:
    """Layer profiles of a tidal GPT or a Hugging Face LLaMA / GPT-2, however it was built;
    ``kwargs``: those of :func:`tidal.planner.stage_profile.profile_model` but ``parts``."""
    from tidal.planner.stage_profile import profile_model

    return profile_model(model, parts=stage_parts(model), **kwargs)


def _gpt(model: nn.Module) -> GPT:
    if not isinstance(model, GPT):
        raise TypeError(f"GPTSpec works on tidal's GPT, got {type(model).__name__}")
    return model
