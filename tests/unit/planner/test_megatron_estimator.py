"""Megatron-LM's own memory estimator, run beside tidal's formulas where a copy of its source is
at hand (``MEGATRON_LM=/path/to/Megatron-LM``; it needs nothing of Megatron's but that file).

Its ``megatron/training/theoretical_memory_usage.py`` imports two helpers from
``megatron.training.utils``, which would pull in all of Megatron; they are stood in for by a
package of two names, and the file itself is loaded unchanged."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from tidal.planner.megatron import MegatronConfig, TransformerShape, megatron_memory
from tidal.planner.plan import Recompute

_SOURCE = "megatron/training/theoretical_memory_usage.py"


def _estimator() -> types.ModuleType:
    root = Path(os.environ.get("MEGATRON_LM", ""))
    path = root / _SOURCE
    if not os.environ.get("MEGATRON_LM") or not path.is_file():
        pytest.skip(f"set MEGATRON_LM to a Megatron-LM checkout holding {_SOURCE}")
    utils = types.ModuleType("megatron.training.utils")
    utils.is_hybrid_model = lambda args: False  # type: ignore[attr-defined]
    utils.print_rank_0 = lambda *a, **k: None  # type: ignore[attr-defined]
    for name in ("megatron", "megatron.training"):
        package = types.ModuleType(name)
        package.__path__ = []  # type: ignore[attr-defined]
        sys.modules.setdefault(name, package)
    sys.modules["megatron.training.utils"] = utils
    spec = importlib.util.spec_from_file_location(
        "megatron.training.theoretical_memory_usage", path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(shape: TransformerShape, c: MegatronConfig) -> types.SimpleNamespace:
    """The command-line arguments the estimator reads, for a dense GPT with LayerNorm."""
    return types.SimpleNamespace(
        kv_channels=shape.hidden // shape.heads, num_attention_heads=shape.heads,
        hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_layers=shape.num_layers,
        group_query_attention=shape.query_groups is not None,
        num_query_groups=shape.query_groups, swiglu=shape.gated, normalization="LayerNorm",
        padded_vocab_size=shape.padded_vocab(c.tp),
        untie_embeddings_and_output_weights=not shape.tied, seq_length=shape.seq_len,
        num_experts=None, moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
        moe_ffn_hidden_size=None, moe_latent_size=None, moe_router_topk=1, mtp_num_layers=None,
        multi_latent_attention=False, add_bias_linear=True, expert_tensor_parallel_size=1,
        expert_model_parallel_size=1, tensor_model_parallel_size=c.tp,
        pipeline_model_parallel_size=c.pp, data_parallel_size=c.dp,
        world_size=c.tp * c.pp * c.dp, micro_batch_size=c.micro_batch,
        virtual_pipeline_model_parallel_size=c.vp if c.vp > 1 else None,
        use_distributed_optimizer=c.distributed_optimizer, sequence_parallel=c.sequence_parallel,
        recompute_granularity="selective",
    )  # fmt: skip


GPT3_175B = TransformerShape(num_layers=96, hidden=12288, heads=96, ffn=4 * 12288, seq_len=2048,
                             vocab=50257)  # fmt: skip
BASE = MegatronConfig(tp=8, pp=8, dp=4, micro_batch=2, num_microbatches=4)
CASES = {
    "t8 p8 d4, m < p": BASE,
    "interleaved v3": dataclasses.replace(BASE, num_microbatches=8, vp=3),
    "one stage": dataclasses.replace(BASE, pp=1, dp=32, num_microbatches=1),
    "plain data parallel": dataclasses.replace(
        BASE, dp=1, num_microbatches=64, distributed_optimizer=False
    ),  # fmt: skip
    "t4 p16 v6": MegatronConfig(
        tp=4, pp=16, dp=1, micro_batch=1, num_microbatches=64, vp=6, distributed_optimizer=False
    ),  # fmt: skip
    "no sequence parallelism": dataclasses.replace(BASE, sequence_parallel=False),
    "no sp, interleaved": dataclasses.replace(
        BASE, sequence_parallel=False, num_microbatches=8, vp=3
    ),  # fmt: skip
    "no sp, one stage": dataclasses.replace(
        BASE, sequence_parallel=False, pp=1, dp=32, num_microbatches=1
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tied", [True, False])
def test_memory_equals_megatrons_own_estimator(name: str, tied: bool) -> None:
    """Selective recompute (the estimator has no full recompute): weights and optimizer, and
    activations, each equal to what the estimator returns within a relative 1e-12."""
    estimator = _estimator()
    c = CASES[name]
    shape = dataclasses.replace(GPT3_175B, tied=tied)
    assert c.recompute is Recompute.SELECTIVE
    args = _args(shape, c)
    ours = megatron_memory(shape, c)
    weights = estimator.compute_weight_and_optimizer_memory(args)
    if c.sequence_parallel:
        activations = estimator.compute_activation_memory(args, c.num_microbatches)
    else:
        activations = estimator.compute_activation_memory_without_sp(args, c.num_microbatches)
    assert ours.weights_and_optimizer == pytest.approx(weights, rel=1e-12)
    assert ours.activations == pytest.approx(activations, rel=1e-12)
