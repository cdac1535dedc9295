"""``tidal.initialize``: the model one stage, plain replicas (``engine = "reference"``) or sharded
by FSDP2 over the ranks (``parallel.fsdp2``), driven by DeepSpeed's calling convention through
the pipeline's parameter holder and update ([Note: one model on stages] in
tidal/runtime/stage_engine.py). On 2 gloo ranks, each passing its rows, with accumulation and
clipping, it must log the one-process reference engine's (plain PyTorch's) losses and gradient
norms and end at its weights; FSDP2 must hold only its shards and resume from its state dict as
the unbroken run goes on. Tensor parallelism and pipelines are refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tidal
from tidal.config import ConfigError
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig
from tidal.parallel.reference import ReferenceEngine
from tidal.testing import run_on_ranks
from tidal.train.build import build_engine
from tidal.train.job import load_job

WORLD = 2
STEPS = 3
ACCUM = 2
TOL = 1e-5
SHARDED_ATOL = 3e-5  # FSDP2's reduce-scatter sums in another order (test_pipeline_mesh.py)
CONFIG: dict[str, Any] = {
    "training": {"device": "cpu", "grad_accum_steps": ACCUM, "grad_clip_norm": 0.5},
    "optimizer": {"lr": 1e-2, "warmup_steps": 1, "decay_steps": STEPS},
}
SHARDED: dict[str, Any] = {**CONFIG, "parallel": {"fsdp2": True}}


def _model() -> torch.nn.Module:
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=32)
    return build_gpt(config, seed=0)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, 64, (4, 9), generator=torch.Generator().manual_seed(10 * step + micro)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _train(engine: Any, steps: range, rows: slice) -> tuple[list[float], list[float]]:
    """Each step's loss (this process's rows, mean over the micro-batches) and grad norm."""
    losses, norms = [], []
    for step in steps:
        total = 0.0
        for micro in range(ACCUM):
            idx, targets = _batch(step, micro)
            loss = engine(idx[rows], targets[rows])
            engine.backward(loss)
            total += float(loss.detach()) / ACCUM
            engine.step()
        losses.append(total)
        norms.append(engine.last_grad_norm)
    return losses, norms


def _replicas() -> dict[str, Any]:
    engine = tidal.initialize(_model(), CONFIG)  # plain replicas, averaged over the ranks
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    losses, norms = _train(engine, range(STEPS), rows)
    return {"losses": losses, "norms": norms, "weights": engine.model_state_dict(),
            "stats": engine.stats()}  # fmt: skip


def _sharded() -> dict[str, Any]:
    engine = tidal.initialize(_model(), SHARDED)  # joins the group torchrun's variables name
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    assert engine.global_step == 0
    losses, norms = _train(engine, range(2), rows)
    state = engine.state_dict()  # stopped after step 2
    more, more_norms = _train(engine, range(2, STEPS), rows)
    resumed = tidal.initialize(_model(), SHARDED)
    resumed.load_state_dict(state)
    again, _ = _train(resumed, range(2, STEPS), rows)
    with torch.no_grad():  # an evaluation between steps leaves the shards as they were
        idx, targets = _batch(99, 0)
        engine(idx[rows], targets[rows])
    sharded = [p for p in engine.model.parameters() if isinstance(p, DTensor)]
    return {
        "losses": losses + more,
        "norms": norms + more_norms,
        "resumed": again,
        "weights": engine.model_state_dict(),
        "all_sharded": len(sharded) == len(list(engine.model.parameters())) > 0,
        "local_elements": sum(p.to_local().numel() for p in sharded),
        "whole_elements": sum(p.numel() for p in sharded),
        "stats": engine.stats(),
        "replicas": _replicas(),
    }


def test_initialize_equals_the_reference_engine_on_replicas_and_fsdp2() -> None:
    ranks = run_on_ranks(_sharded, world_size=WORLD, backend=None, timeout_s=120)
    engine = build_engine(_model(), load_job(CONFIG))  # plain PyTorch, one process, every row
    assert isinstance(engine, ReferenceEngine)
    losses, norms = _train(engine, range(STEPS), slice(0, 4))
    for rank, out in enumerate(ranks):
        replicas = out["replicas"]
        assert replicas["stats"]["engine"] == "reference", rank
        assert replicas["norms"] == pytest.approx(norms, rel=TOL), (rank, replicas["norms"])
        for name, value in engine.model.state_dict().items():
            # the mean over the ranks sums in another order: Adam moves a near-zero gradient's
            # weight by up to its rate on a rounding difference
            torch.testing.assert_close(replicas["weights"][name], value, rtol=0,
                                       atol=SHARDED_ATOL)  # fmt: skip
        assert out["all_sharded"] and out["local_elements"] * WORLD == out["whole_elements"], rank
        assert out["stats"]["engine"] == "fsdp2 stage" and out["stats"]["global_step"] == STEPS
        assert out["norms"] == pytest.approx(norms, rel=TOL), (rank, out["norms"], norms)
        assert out["resumed"] == out["losses"][2:], (rank, out["resumed"], out["losses"])
        for name, value in engine.model.state_dict().items():
            if name in out["weights"]:
                torch.testing.assert_close(out["weights"][name], value, rtol=0, atol=SHARDED_ATOL)
    for kind in ("fsdp2", "replicas"):
        outs = [r if kind == "fsdp2" else r["replicas"] for r in ranks]
        mean = [sum(o["losses"][s] for o in outs) / WORLD for s in range(STEPS)]
        assert mean == pytest.approx(losses, abs=TOL), (kind, mean, losses)
    assert min(norms) > 0.5  # every step clipped
    start = _model().state_dict()
    assert not torch.equal(ranks[0]["weights"]["ln_f.weight"], start["ln_f.weight"])


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}])
def test_tensor_parallelism_or_a_pipeline_is_refused_in_one_line(parallel: dict[str, int]) -> None:
    (key,) = parallel
    with pytest.raises(ConfigError, match=f"parallel.{key}: {key} = 2 needs the stages"):
        tidal.initialize(_model(), {**CONFIG, "parallel": parallel})
