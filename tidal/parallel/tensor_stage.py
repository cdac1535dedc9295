"""Tensor parallelism inside a pipeline stage: :func:`tensor_parallel_stage` over ``mesh["tp"]``.

[Note: tensor-parallel stages]
Megatron's tensor parallelism, block by block, on a pipeline stage (``parallel.tp > 1``, the
ranks of ``mesh["tp"]`` at one pipeline position of one dp replica): in each transformer block
of the stage's ``layers`` the attention's q, k and v projections and the MLP's first linear
(LLaMA's gate and up) are column-parallel, the attention's output projection and the MLP's last
linear row-parallel (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``).
So a rank holds ``1/t`` of each of those weights, computes the attention of its own ``H/t``
heads (both tidal's GPT and LLaMA count heads from the width they get) and the MLP on its
``F/t`` features, and each row-parallel output is all-reduced: the activations between blocks,
the embeddings, the norms and the head are whole and replicated on every tp rank, and so is
what crosses a stage boundary ([Note: stage boundaries] in tidal/pipeline/split.py), which
each tp rank sends to its own peer of the next stage. No sequence parallelism.

- tidal's GPT fuses q, k and v in one ``qkv`` linear whose outputs are ``[q; k; v]``; its rows
  are reordered (:func:`~tidal.parallel.tensor_axis.projection_rows`, the plan realisation's)
  so that rank ``r``'s contiguous share is ``[q_r; k_r; v_r]`` ([Note: fused qkv under tensor
  parallelism] in plan_apply.py). The order is recorded on the stage (``REORDERED``, by
  parameter name); parameters, gradients and optimizer state keep it, and a checkpoint undoes
  it (:func:`model_order`), so a checkpoint holds the one-process layout and resumes on any
  ``tp`` (:func:`rank_order` redoes it).
- Every tp rank runs the same forward and backward on the same rows: replicated parameters get
  the same gradient on each, a split one each rank's share of it. A stage's squared gradient
  norm (:func:`tensor_grad_squares`) is therefore the split parameters' local squares summed
  over the tp group plus the replicated ones' counted once, the one-process norm; summing
  every rank's whole would count each replicated parameter ``t`` times. The same rule, read
  off each parameter's placements, serves FSDP2's shards over dp and both at once.
- Replicated activations must agree across the tp ranks: they take the same rows (the
  trainer's rows follow the dp coordinate alone) and the same seed, so dropout draws the same
  masks on each (the split attention draws on equal local shapes, keeping the generators in
  step).
- What the transform cannot split is refused in one line naming the fix: a block that is
  neither tidal's GPT's nor LLaMA's (GPT-2's ``Conv1D`` among them), and head counts or widths
  ``t`` does not divide.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from tidal.config import ConfigError
from tidal.parallel.tensor_axis import REORDERED, projection_rows

__all__ = [
    "BLOCK_PLANS",
    "model_order",
    "rank_order",
    "tensor_grad_squares",
    "tensor_parallel_stage",
]

COL, ROW = "colwise", "rowwise"
# A block's linears by path -> how they split; the first plan whose paths a block has is its.
BLOCK_PLANS: dict[str, dict[str, str]] = {
    "tidal's GPT": {"attn.qkv": COL, "attn.proj": ROW, "mlp.fc": COL, "mlp.proj": ROW},
    "LLaMA": {
        "self_attn.q_proj": COL,
        "self_attn.k_proj": COL,
        "self_attn.v_proj": COL,
        "self_attn.o_proj": ROW,
        "mlp.gate_proj": COL,
        "mlp.up_proj": COL,
        "mlp.down_proj": ROW,
    },
}
_FUSED_QKV = "attn.qkv"  # tidal's GPT: [q; k; v] of H heads each


def tensor_parallel_stage(stage: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split each block of ``stage.layers`` over ``tp_mesh`` in place; see [Note:
    tensor-parallel stages]. Every rank of ``tp_mesh`` must hold the same values (each takes
    its share of its own copy, with no communication)."""
    t = tp_mesh.size()
    reordered: dict[str, tuple[int, torch.Tensor]] = {}
    for i, block in enumerate(getattr(stage, "layers", ())):
        family, plan = _block_plan(block)
        _check_divides(block, family, plan, t)
        if _FUSED_QKV in plan:
            rows = _reorder_qkv(block.get_submodule(_FUSED_QKV), t)
            for pname, _ in block.get_submodule(_FUSED_QKV).named_parameters():
                reordered[f"layers.{i}.{_FUSED_QKV}.{pname}"] = (0, rows)
        styles: dict[str, ParallelStyle] = {
            path: ColwiseParallel() if how == COL else RowwiseParallel()
            for path, how in plan.items()
        }
        parallelize_module(block, tp_mesh, styles, src_data_rank=None)
    setattr(stage, REORDERED, reordered)


def _block_plan(block: nn.Module) -> tuple[str, dict[str, str]]:
    for family, plan in BLOCK_PLANS.items():
        if all(isinstance(_find(block, path), nn.Linear) for path in plan):
            return family, plan
    raise ConfigError(
        "parallel.tp",
        f"tensor-parallel stages split the blocks of {' and '.join(BLOCK_PLANS)}, not "
        f"{type(block).__name__}; set parallel.tp = 1 (or train it from a plan: tidal plan)",
    )


def _find(block: nn.Module, path: str) -> nn.Module | None:
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _check_divides(block: nn.Module, family: str, plan: dict[str, str], t: int) -> None:
    """Each attention projection's heads and each MLP linear's split features must split
    evenly over ``t`` ranks."""
    attention = next(iter(plan)).rpartition(".")[0] + "."  # the parent of the first linear
    head_dim = int(getattr(block.get_submodule(attention[:-1]), "head_dim", 1))
    for path, how in plan.items():
        linear = block.get_submodule(path)
        assert isinstance(linear, nn.Linear)
        count, what = linear.out_features if how == COL else linear.in_features, "features"
        if how == COL and path.startswith(attention):
            count, what = count // head_dim // (3 if path == _FUSED_QKV else 1), "heads"
        if count % t:
            raise ConfigError(
                "parallel.tp",
                f"{family}'s {path} has {count} {what}, which {t} tensor-parallel ranks do not "
                f"divide; use a parallel.tp that divides the heads, key/value heads and MLP width",
            )


def _reorder_qkv(qkv: nn.Module, t: int) -> torch.Tensor:
    """Rows of the fused ``[q; k; v]`` in the per-rank order ([Note: tensor-parallel stages])."""
    assert isinstance(qkv, nn.Linear)
    width = qkv.out_features // 3
    rows = projection_rows((width, width, width), t)
    with torch.no_grad():
        for param in qkv.parameters():
            param.copy_(param.index_select(0, rows.to(param.device)))
    return rows


def model_order(stage: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """A whole value of parameter ``name`` of ``stage`` (or of its optimizer state) in the
    one-process layout: the fused qkv's reorder undone; other values (and an optimizer's step
    count, a scalar) as they are."""
    dim, rows = getattr(stage, REORDERED, {}).get(name, (None, None))
    if rows is None or value.dim() == 0:
        return value
    return value.index_select(dim, torch.argsort(rows).to(value.device))


def rank_order(stage: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`model_order`: a one-process value in the stage's row order."""
    dim, rows = getattr(stage, REORDERED, {}).get(name, (None, None))
    if rows is None or value.dim() == 0:
        return value
    return value.index_select(dim, rows.to(value.device))


def tensor_grad_squares(
    named: Iterable[tuple[str, nn.Parameter]], *, skip: frozenset[str] = frozenset()
) -> torch.Tensor:
    """The squared gradient norm of a stage whose parameters may be DTensors on any mesh (tensor
    parallel, FSDP2, both), as one process would compute it: each parameter's local squares
    summed over the mesh dimensions it is sharded along and counted once along those it is
    replicated along ([Note: tensor-parallel stages]); ``skip``'s names left out. Every rank of
    the stage must call it (one all-reduce per sharded mesh dimension). fp32, on the CPU."""
    once = torch.zeros((), dtype=torch.float64)
    sharded: dict[tuple[str, ...], tuple[list[dist.ProcessGroup], torch.Tensor]] = {}
    for name, p in named:
        local = torch.zeros((), dtype=torch.float64)
        if p.grad is not None and name not in skip:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local = grad.double().square().sum().cpu()
        groups = _sharded_along(p)
        if not groups:
            once += local
            continue
        key = tuple(str(g.group_name) for g in groups)  # from the parameters: alike on all ranks
        _, total = sharded.setdefault(key, (groups, torch.zeros((), dtype=torch.float64)))
        total += local
    for key in sorted(sharded):
        groups, total = sharded[key]
        for group in groups:
            on = total.cuda() if dist.get_backend(group) == "nccl" else total
            dist.all_reduce(on, group=group)
            total = on.cpu()
        once += total
    return once.float()


def _sharded_along(p: torch.Tensor) -> list[dist.ProcessGroup]:
    """The groups of the mesh dimensions ``p`` is sharded along (none for a plain tensor).
    Whatever is not replicated: FSDP2 shards a tensor-parallel weight split on the same dim as
    ``_StridedShard``, whose ``is_shard()`` is False."""
    if not isinstance(p, DTensor):
        return []
    return [p.device_mesh.get_group(i) for i, pl in enumerate(p.placements)
            if not pl.is_replicate()]  # fmt: skip
