"""A GPT-2 style decoder-only transformer, its presets, and its parameter and FLOP counts.

The model is pre-LayerNorm (LN before attention and before the MLP, plus a final LN), with
learned position embeddings and an LM head that by default shares the token embedding matrix.
:func:`build_gpt` constructs it on the meta device first so that a huge preset costs no memory
until it is materialised, and so that initialisation is one explicit, deterministic pass.
"""

# Shape suffixes: B batch, T sequence, D d_model, H heads, K head dim (D/H), F d_ff, V vocab.

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tidal.activations.costs import TensorClass
from tidal.config.configurable import ConfigError, require
from tidal.models.factory import FactoryConfig
from tidal.models.hf import HFModelConfig
from tidal.pipeline.partition import LayerProfile
from tidal.pipeline.split import (
    NormHead,
    PipelineStage,
    StageParts,
    TokenAndPositionEmbed,
    split_parts,
)

if TYPE_CHECKING:
    from tidal.planner.measure import ModelGraph

__all__ = [
    "gpt_saved_shares",
    "GPT",
    "PRESETS",
    "Block",
    "GPTConfig",
    "ModelConfig",
    "build_gpt",
    "closed_form_num_params",
    "gpt_stage_parts",
    "measure_gpt",
    "num_params",
    "preset",
    "profile_gpt",
    "split_gpt",
    "training_flops_per_token",
]

INIT_STD = 0.02


@dataclass(kw_only=True, frozen=True, slots=True)
class GPTConfig:
    """The architecture of a :class:`GPT`. ``d_ff=None`` means the usual ``4 * d_model``."""

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    d_ff: int | None = None
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            if value is not None:
                require(value >= 1, name, f"must be >= 1, got {value}")
        require(
            self.d_model % self.num_heads == 0,
            "num_heads",
            f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(
            self.layer_norm_eps > 0, "layer_norm_eps", f"must be > 0, got {self.layer_norm_eps}"
        )

    @property
    def ffn_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


def _gpt2(num_layers: int, num_heads: int, d_model: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=50257, seq_len=1024, num_layers=num_layers, num_heads=num_heads, d_model=d_model
    )


def _gpt3(num_layers: int, num_heads: int, d_model: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=50257, seq_len=2048, num_layers=num_layers, num_heads=num_heads, d_model=d_model
    )


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, d_model=64),
    "demo": GPTConfig(vocab_size=256, seq_len=256, num_layers=4, num_heads=4, d_model=256),
    "gpt2-small": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024),
    "gpt2-large": _gpt2(36, 20, 1280),
    "gpt2-xl": _gpt2(48, 25, 1600),
    # The GPT-3 paper (Brown et al. 2020, Table 2.1) lists 24 heads of 128 for 1.3B, which does
    # not multiply out to d_model 2048; 16 heads of 128 does.
    "gpt3-1.3b": _gpt3(24, 16, 2048),
    "gpt3-2.7b": _gpt3(32, 32, 2560),
    "gpt3-6.7b": _gpt3(32, 32, 4096),
    # The paper prints d_model 5140, which 40 heads do not divide; Megatron-LM and later
    # reproductions use 5120 = 40 heads of 128.
    "gpt3-13b": _gpt3(40, 40, 5120),
    "gpt3-175b": _gpt3(96, 96, 12288),
}


def preset(name: str) -> GPTConfig:
    """The named architecture from :data:`PRESETS`."""
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The ``[model]`` section of a recipe: a preset name plus optional overrides of its fields,
    or ``hf_config``, the path of a Hugging Face ``config.json`` (or of a folder holding one;
    relative to the working directory) with ``seq_len`` the length to train on.

    Attributes:
        preset: one of ``tidal models``' GPT presets (tiny, demo, gpt2-small, ...).
        vocab_size: tokens in the vocabulary; unset keeps the preset's.
        seq_len: tokens per training sequence; unset keeps the preset's (required with hf_config).
        num_layers: transformer blocks; unset keeps the preset's.
        num_heads: attention heads per block; unset keeps the preset's.
        d_model: the residual stream's width; unset keeps the preset's.
        d_ff: the MLP's hidden width; unset keeps the preset's.
        tie_embeddings: whether the LM head shares the token embedding; unset keeps the preset's.
        dropout: dropout probability in training; unset keeps the preset's.
        hf_config: a Hugging Face config.json (or its folder) to build instead of a preset.
        factory: "package.module:function" returning your own nn.Module (token ids to logits)
            to train instead of a preset; needs seq_len ([Note: factory models] in factory.py).
    """

    preset: str = "tiny"
    vocab_size: int | None = None
    seq_len: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    d_model: int | None = None
    d_ff: int | None = None
    tie_embeddings: bool | None = None
    dropout: float | None = None
    hf_config: str | None = None
    factory: str | None = None

    def __post_init__(self) -> None:
        preset(self.preset)
        if self.factory is not None:
            require(self.hf_config is None, "factory", "give model.factory or model.hf_config")
            for name in _GPT_ONLY:
                require(
                    name == "vocab_size" or getattr(self, name) is None,
                    name,
                    f"shapes tidal's GPT presets; your model ({self.factory}) has its own shape: "
                    f"drop model.{name}",
                )
            require(
                self.seq_len is not None,
                "seq_len",
                "a factory model needs the sequence length to train on: set model.seq_len",
            )
        if self.hf_config is not None:
            for name in _GPT_ONLY:
                require(
                    getattr(self, name) is None,
                    name,
                    f"shapes tidal's GPT presets; a Hugging Face model (hf_config) takes its "
                    f"shape from {self.hf_config}: drop model.{name}",
                )
            require(
                self.seq_len is not None,
                "seq_len",
                "a Hugging Face model (hf_config) needs the sequence length to train on: set "
                "model.seq_len",
            )
        self.resolve()  # an invalid combination raises GPTConfig's ConfigError, keyed by field

    def resolve(self) -> GPTConfig | HFModelConfig | FactoryConfig:
        if self.factory is not None:
            assert self.seq_len is not None, "checked in __post_init__"
            # The stdlib corpus is bytes: 256 tokens unless the recipe says otherwise.
            return FactoryConfig(factory=self.factory, seq_len=self.seq_len,
                                 vocab_size=self.vocab_size or 256)  # fmt: skip
        if self.hf_config is not None:
            return HFModelConfig.load(self.hf_config, seq_len=self.seq_len, key="hf_config")
        overrides = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("preset", "hf_config", "factory")
            and getattr(self, f.name) is not None
        }
        return dataclasses.replace(preset(self.preset), **overrides)

    def resolve_structured(self) -> GPTConfig | HFModelConfig:
        """:meth:`resolve` for what needs a structure tidal knows (pipelines, plans, export)."""
        config = self.resolve()
        if isinstance(config, FactoryConfig):
            raise ConfigError(
                "model.factory",
                "pipelines, plans and export need tidal's GPT or a Hugging Face decoder "
                "(model.hf_config); a factory model trains on the reference and chunk engines",
            )
        return config

    def resolve_gpt(self) -> GPTConfig:
        """:meth:`resolve` for what only tidal's GPT supports; a clear error for the others."""
        config = self.resolve()
        if not isinstance(config, GPTConfig):
            raise ConfigError(
                "model.hf_config", "this needs one of tidal's GPT presets; drop model.hf_config"
            )
        return config


_GPT_ONLY = (
    "vocab_size",
    "num_layers",
    "num_heads",
    "d_model",
    "d_ff",
    "tie_embeddings",
    "dropout",
)


# ---------------------------------------------------------------------------------------------
# the model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.head_dim = d // config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        self.proj = nn.Linear(d, d, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)
        # Recompute the attention core in backward instead of keeping its activations
        # (Megatron's selective recomputation); set by tidal.parallel.plan_apply ([Note: selective
        # recomputation contract] in tidal/planner/check.py).
        self.recompute_core = False

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        qkv_BT3D = self.qkv(x_BTD)
        if self.recompute_core:
            y_BTD = checkpoint(self.core, qkv_BT3D, use_reentrant=False)
        else:
            y_BTD = self.core(qkv_BT3D)
        return self.resid_drop(self.proj(y_BTD))

    def core(self, qkv_BT3D: torch.Tensor) -> torch.Tensor:
        """Attention from the stacked ``[q; k; v]`` projections to the heads' outputs, side by side.

        Head counts come from the width, not the config, so a tensor-parallel rank whose ``qkv``
        gives ``[q; k; v]`` of its own heads only runs this unchanged on its share (``D`` and
        ``H`` are then that rank's; see [Note: fused qkv under tensor parallelism] in
        tidal/parallel/plan_apply.py).
        """
        B, T, _ = qkv_BT3D.shape
        q_BTD, k_BTD, v_BTD = qkv_BT3D.chunk(3, dim=-1)
        q_BHTK, k_BHTK, v_BHTK = (
            t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK, k_BHTK, v_BHTK, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return y_BHTK.transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ffn_dim, bias=config.bias)
        self.proj = nn.Linear(config.ffn_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTF = F.gelu(self.fc(x_BTD), approximate="tanh")
        return self.drop(self.proj(h_BTF))


class Block(nn.Module):
    """One pre-LN transformer layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.ln_1 = nn.LayerNorm(d, eps=eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(d, eps=eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.mlp(self.ln_2(x_BTD))


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` without its own N(0, 1) draw: ``init_weights`` sets every value, and
    that draw on the meta device (:func:`build_gpt`) goes through torch's Python reference of
    ``normal_``, whose first call imports ``torch._dynamo``: about 3 s in every process and rank
    that builds a GPT, for values thrown away."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class GPT(nn.Module):
    """Decoder-only language model. Build it with :func:`build_gpt`, which also initialises it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_embed = _embedding(config.vocab_size, d)
        self.pos_embed = _embedding(config.seq_len, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(d, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the LM head; ``to_empty`` and friends break the tie."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]``, or with ``targets_BT`` the mean next-token cross-entropy."""
        if idx_BT.shape[1] > self.config.seq_len:
            raise ValueError(
                f"sequence length {idx_BT.shape[1]} is longer than the model's "
                f"seq_len {self.config.seq_len}"
            )
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.drop(self.tok_embed(idx_BT) + self.pos_embed(pos_T))
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        if targets_BT is None:
            return logits_BTV
        # Softmax over a large vocabulary in bf16/fp16 loses too much; the loss is taken in fp32.
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())

    # [Note: deterministic init]
    # ``init_weights(seed)`` must give the same parameters for a seed on every device, so runs on
    # CPU, on a GPU and after a restart all start from the same point. Hence every random value
    # is drawn from one CPU ``torch.Generator`` seeded with ``seed``, parameter by parameter in
    # ``named_parameters()`` order (a tied matrix appears, and is drawn, once), then copied into
    # the parameter. Constant-initialised parameters draw nothing, so the sequence of draws
    # depends only on the architecture, never on where the parameters live.

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 initialisation; see [Note: deterministic init]."""
        for name, value in self.parameter_values(seed):
            self.get_parameter(name).copy_(value)

    def parameter_values(self, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """What :meth:`init_weights` gives each parameter, one fp32 CPU tensor at a time, made
        when asked for; a model on the meta device can be trained from it without ever being
        whole ([Note: deferred construction] in tidal/memory/materialize.py)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            is_random, value = self.init_rule(name)
            if is_random:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                yield name, noise.mul_(value)
            else:
                yield name, torch.full(param.shape, value, dtype=torch.float32)

    def init_rule(self, name: str) -> tuple[bool, float]:
        """GPT-2's rule for parameter ``name``: ``(True, std)`` for a normal draw, ``(False, c)``
        for the constant ``c`` (what :meth:`parameter_values` draws from; a sharded peer applies it
        to its shards in ``tidal bench compose``)."""
        owner = self.get_submodule(name.rpartition(".")[0])
        if name.endswith(".bias"):
            return False, 0.0
        if isinstance(owner, nn.LayerNorm):
            return False, 1.0
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            # Each layer adds two residual branches; scaling keeps the residual stream's variance
            # from growing with depth (GPT-2 paper, section 2.3).
            return True, INIT_STD / math.sqrt(2 * self.config.num_layers)
        return True, INIT_STD


def gpt_init(model: GPT, seed: int = 0) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """The init source of ``build_gpt(config, device="meta")`` for ``tidal.initialize(...,
    init=)``: the values ``build_gpt(config, seed=seed)`` would have."""
    return functools.partial(model.parameter_values, seed)


def build_gpt(config: GPTConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> GPT:
    """A GPT on ``device`` initialised from ``seed``; ``device="meta"`` allocates nothing."""
    with torch.device("meta"):
        model = GPT(config)
    if torch.device(device).type == "meta":
        return model
    # What ``model.to_empty(device=device)`` does, with ``torch.empty`` for its ``empty_like``:
    # that of a meta tensor runs torch's Python reference, which imports sympy (about a second
    # in every process that builds a GPT). The parameters are contiguous, so nothing differs.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    model.init_weights(seed)
    return model


def gpt_stage_parts(model: GPT) -> StageParts:
    """Where a :class:`GPT` keeps what pipeline stages hold (tidal/pipeline/split.py)."""
    return StageParts(
        embed=TokenAndPositionEmbed(model.tok_embed, model.pos_embed, model.drop),
        blocks=model.blocks,
        head=NormHead(model.ln_f, model.lm_head),
        container="blocks",
    )


def split_gpt(model: GPT, block_ranges: Sequence[tuple[int, int]]) -> list[PipelineStage]:
    """Stages of a :class:`GPT`; ``block_ranges[s] = (start, end)`` are stage ``s``'s blocks."""
    return split_parts(model, gpt_stage_parts(model), block_ranges)


def measure_gpt(
    config: GPTConfig, *, micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16
) -> ModelGraph:
    """The planner's :class:`ModelGraph` of ``GPT(config)`` at ``micro_batch`` sequences of
    ``config.seq_len`` tokens, with ``dtype`` weights and activations (traced on the meta
    device: nothing is allocated)."""
    from tidal.planner.measure import measure  # the planner (scipy) loads only when used

    model = build_gpt(config, device="meta").to(dtype)
    shape = (micro_batch, config.seq_len)
    idx = torch.empty(shape, dtype=torch.long, device="meta")
    return measure(model, (idx, torch.empty(shape, dtype=torch.long, device="meta")))


def gpt_saved_shares(config: GPTConfig, *, seq_len: int) -> dict[TensorClass, float]:
    """How a GPT block's saved activations split between the saver planner's classes, as
    fractions: Megatron's per-layer count (Korthikanti et al. 2022, in units of s*b*h bytes at
    16 bits: 34 + 5*a*s/h) cut as the block input (2), attention (11 + 5*a*s/h), MLP (19) and
    the second norm's input (2). The planner scales them to the traced bytes of each block."""
    scores = config.num_heads * seq_len / config.d_model
    parts = {TensorClass.BLOCK_INPUT: 2.0, TensorClass.ATTENTION: 11.0 + 5.0 * scores,
             TensorClass.MLP: 19.0, TensorClass.NORM: 2.0}  # fmt: skip
    total = sum(parts.values())
    return {cls: share / total for cls, share in parts.items()}


def profile_gpt(
    config: GPTConfig,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    flops_per_s: float | None = None,
    memory_bytes_per_s: float | None = None,
) -> list[LayerProfile]:
    """Analytic profiles ``embed, blocks.0, ..., head`` of ``GPT(config)`` for one microbatch of
    ``micro_batch`` sequences of ``seq_len`` tokens, traced on the meta device (nothing is
    allocated); ``flops_per_s`` and ``memory_bytes_per_s``: the rates of
    :func:`tidal.planner.stage_profile.profile_model` (its defaults when None)."""
    from tidal.planner import stage_profile  # the planner (scipy) loads only when used

    require(
        1 <= seq_len <= config.seq_len,
        "seq_len",
        f"must be in [1, {config.seq_len}] (the model's positions), got {seq_len}",
    )
    model = build_gpt(config, device="meta").to(dtype)
    parts = gpt_stage_parts(model)
    return stage_profile.profile_model(
        model, parts=parts, micro_batch=micro_batch, seq_len=seq_len,
        flops_per_s=stage_profile.DEFAULT_FLOPS_PER_S if flops_per_s is None else flops_per_s,
        memory_bytes_per_s=(stage_profile.DEFAULT_MEMORY_BYTES_PER_S
                            if memory_bytes_per_s is None else memory_bytes_per_s),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# counting


def num_params(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) tensor counted once."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())


def _block_num_params(config: GPTConfig) -> int:
    d, f = config.d_model, config.ffn_dim
    matrices = 3 * d * d + d * d + 2 * d * f  # qkv, attn proj, fc, mlp proj
    biases = 3 * d + d + f + d if config.bias else 0
    norms = 2 * (2 * d if config.bias else d)
    return matrices + biases + norms


def closed_form_num_params(config: GPTConfig) -> int:
    """The parameter count of ``GPT(config)`` from its shape alone.

    With ``d = d_model``, ``f = ffn_dim``, ``L = num_layers``, ``V = vocab_size``, ``T = seq_len``
    and ``b = 1`` if ``bias`` else ``0``, one block holds::

        4d^2 + 2df          qkv (3d^2), attention proj (d^2), fc (df), mlp proj (fd)
        + b(5d + f)         their biases (3d + d + f + d)
        + 2(1 + b)d         ln_1 and ln_2

    which for ``f = 4d`` with biases is the familiar ``12d^2 + 13d``. The whole model is
    ``L * block + V*d + T*d + (1 + b)d`` (embeddings and ln_f), plus another ``V*d`` when the
    LM head is not tied to the token embedding.
    """
    d = config.d_model
    embeddings = config.vocab_size * d + config.seq_len * d
    final_norm = 2 * d if config.bias else d
    head = 0 if config.tie_embeddings else config.vocab_size * d
    return config.num_layers * _block_num_params(config) + embeddings + final_norm + head


def training_flops_per_token(config: GPTConfig) -> float:
    """Matmul FLOPs of one forward and backward pass, per token.

    ``6 * N + 12 * L * T * d``, the convention of the PaLM paper (Chowdhery et al. 2022,
    appendix B) also used by nanoGPT's MFU estimate: each matmul parameter costs 2 FLOPs forward
    and 4 backward, and attention's ``QK^T`` and ``AV`` add ``2 * 2 * T * d`` per layer forward
    (the full ``T x T`` score matrix, ignoring the causal mask), times 3 with backward. ``N``
    counts the parameters that take part in matmuls: every transformer-block parameter plus the
    ``V x d`` LM head matrix; position embeddings and an untied input embedding are lookups.
    """
    n_matmul = config.num_layers * _block_num_params(config) + config.vocab_size * config.d_model
    attention = 12 * config.num_layers * config.seq_len * config.d_model
    return float(6 * n_matmul + attention)
