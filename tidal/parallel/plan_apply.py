"""Carry out a :class:`~tidal.planner.plan.Plan` on a model: DTensor on ``tp``, FSDP2 on ``dp``.

``apply(model, plan, make_mesh(plan, "cuda"))`` changes the model in place: tidal's GPT, or a
Hugging Face LLaMA- or GPT-2-style decoder, whose wiring comes from its measured graph
(tidal/planner/wiring.py), not from a table per model. Training then needs
nothing special: the loss comes back plain and whole, hooks reduce the gradients FSDP does not
own, and :func:`full_state_dict` gives the single-device parameters back. Plans that do not fit
the model, or that DTensor cannot carry out, raise ``ValueError`` (:func:`check_plan`).

[Note: plan realisation]
Between modules an activation travels as a plain local tensor in one layout of [Note: plan
layouts], its *wire* layout. A module unit's pre-hook wraps its input as a DTensor in that
layout and redistributes it to what the module computes on; its forward hook redistributes the
output to its own wire layout and unwraps it. A unit's wire layout is, for a segment (code in a
forward, which no hook can convert), its ``out_layout``, but whole for positions (position
ids, which an embedding slices like token ids; rotary tables, which an attention core takes
whole); for a module feeding a segment, that segment's ``in_layout`` (so
rowwise partial sums reach the residual adds reduced: ``P -> R`` all-reduce, ``P -> S(seq)``
reduce-scatter); for a module giving ``P``, its consumers' common ``in_layout``; else its
``out_layout``, converted by each consumer; for the model's output (a Hugging Face model's
logits), ``R``: the caller takes its loss on whole logits. So segments must get their
``in_layout``; plans where they do not are rejected. A block's input, which feeds ln_1 and the
add ``blocks.*[0]``, is converted to the add's layout by the block's pre-hook, and ln_1 converts
from there (with a warning when that is a detour the plan did not count). Units that must take
or hand whole tensors because positions are counted from them are [Note: positions count whole
sequences] in wiring.py's. Consumers come from the model's structure (its measured graph), not
``plan.edges``; a dropout unit the plan leaves out (the planner does at ``p = 0``) passes on
what it gets. A loss unit (tidal's GPT's ``[2]``) takes ``R`` logits, ``S(hid)`` ones under
``loss_parallel()``, or ``S(seq)`` ones with targets split alike (tensor_axis._ModelOutputs).

With ``tp > 1`` every parameter is a DTensor on the tensor axis (``Replicate`` unless its
strategy splits it), so FSDP sees one kind. A whole weight used on split tokens gets a
``Partial`` gradient, which a post-accumulate hook reduces (FSDP does it for its own). Dropout
draws from each rank's own generator: seed a tensor axis's ranks alike, as replicated
activations need equal masks.

[Note: fused qkv under tensor parallelism]
A fused projection's outputs are ``[q; k; v]`` (``H``, ``G`` and ``G`` heads of ``K``: tidal's
GPT's qkv, GPT-2's c_attn, whose Conv1D keeps them as columns), so a contiguous split would give
rank 0 all of q and part of k. apply reorders the outputs (and the bias) so that rank r's block
is ``[q_r; k_r; v_r]`` for its ``H/t`` heads; the attention core splits its share in three
([Note: attention heads per rank] in tensor_axis.py). Parameters, gradients and optimizer state
keep that order; :func:`full_state_dict` undoes it. So a fused projection is ``colwise``
exactly when its core is ``heads``. Separate q, k and v projections (LLaMA's) need nothing:
their outputs are contiguous heads already.

[Note: colwise inputs kept sharded]
A colwise linear fed ``S(seq)`` all-gathers its input, and autograd would keep the gathered
input. As in Megatron's sequence parallelism (and the cost model), saved-tensor hooks keep this
rank's ``1/t`` of each replicated DTensor the module saves and all-gather it in backward; not in
fully recomputed blocks, whose checkpoint keeps nothing inside anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tidal.activations.apply import apply_savers
from tidal.activations.costs import Saver
from tidal.memory.share import ON_HOST, host_share
from tidal.memory.tiers import Tier, TierKind
from tidal.parallel.tensor_axis import REORDERED, parallelize_tensor_axis
from tidal.planner.block_savers import host_children
from tidal.planner.check import RECOMPUTE_CORE, PlanWiring, check_plan, sent_layout, wire_plan
from tidal.planner.measure import ModelGraph
from tidal.planner.plan import Layout, Plan, Recompute

# the model's HostSwap (its counters) where the plan swaps blocks' saved tensors to the host
HOST_SWAP = "_tidal_host_swap"

__all__ = [
    "HOST_SWAP",
    "apply",
    "apply_to_stage",
    "check_plan",
    "full_state_dict",
    "make_mesh",
    "set_accumulating",
    "stage_layouts",
]


def make_mesh(plan: Plan, device_type: str) -> DeviceMesh | None:
    """The ``(dp, tp)`` mesh ``plan`` runs on, over the default process group; none for a plan
    of one device that keeps its parameters there (its choices are recomputation alone, which
    needs no process group). One that keeps some on the host runs FSDP2 on a mesh of one."""
    if plan.dp * plan.tp == 1 and not plan.offload.params:
        return None
    if not dist.is_initialized():
        raise ValueError(
            f"the plan keeps {plan.offload.describe()}, which FSDP2 holds on a mesh of one: "
            f"join a process group first (tidal.distributed.join_alone, as tidal train does)"
        )
    if dist.get_world_size() != plan.dp * plan.tp:
        raise ValueError(
            f"the plan's mesh is dp {plan.dp} x tp {plan.tp}, but {dist.get_world_size()} ranks "
            f"are running: launch {plan.dp * plan.tp} or plan for {dist.get_world_size()}"
        )
    return init_device_mesh(device_type, (plan.dp, plan.tp), mesh_dim_names=("dp", "tp"))


def apply(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None,
    *,
    graph: ModelGraph | None = None,
    handed: Layout | None = None,
) -> nn.Module:
    """Realise ``plan`` on ``model`` in place and return it; see [Note: plan realisation].

    ``model`` must be the same on every rank (built from one seed). ``graph``: its
    :func:`~tidal.planner.wiring.structure_graph`, traced here when not given. ``handed``: the
    layout its first block's input arrives in (:func:`apply_to_stage`). The order is
    torchtitan's: the tensor axis, then recomputation, then FSDP, which must see the tensor
    axis's DTensors.
    """
    _apply(model, plan, mesh, wire_plan(model, plan, graph=graph, handed=handed))
    return model


def _apply(model: nn.Module, plan: Plan, mesh: DeviceMesh | None, wiring: PlanWiring) -> None:
    """:func:`apply` of a plan already wired."""
    if mesh is None and plan.dp * plan.tp > 1:
        raise ValueError(f"a plan of dp {plan.dp} x tp {plan.tp} needs its mesh: make_mesh(plan)")
    if mesh is not None and (
        mesh.mesh_dim_names != ("dp", "tp") or tuple(mesh.shape) != (plan.dp, plan.tp)
    ):
        raise ValueError(
            f"the plan needs a mesh ('dp', 'tp') of shape ({plan.dp}, {plan.tp}), not "
            f"{mesh.mesh_dim_names} of shape {tuple(mesh.shape)}: make it with make_mesh(plan)"
        )
    modes = {p: Recompute(plan.recompute.get(p, Recompute.NONE)) for p in wiring.model.blocks}
    if plan.tp > 1:
        full = {p for p, mode in modes.items() if mode is Recompute.FULL}
        assert mesh is not None
        parallelize_tensor_axis(model, wiring, mesh["tp"], full)
    _recompute(model, wiring, modes)
    if plan.chunks is not None:  # the stage's chunks shard and reduce its model data themselves
        return  # ([Note: chunk stages in plans] in tidal/planner/model_data.py)
    dp_group = None
    if plan.dp > 1 or plan.offload.params:  # one device's parameters on the host: FSDP2 too
        assert mesh is not None
        # check_plan's: a ZeRO-3 plan's parameters on the host are FSDP2's CPU offload of the
        # groups nearest its fraction (the optimizer's share on the host is the stage's
        # optimizer's: host_optimizer.py)
        _shard_data_axis(model, wiring, mesh["dp"], params_on_host=plan.offload.params)
        dp_group = mesh.get_group("dp")
    for param in {id(p): p for p in model.parameters()}.values():
        axes = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
        if "dp" in (axes or ()) or (dp_group is None and axes is None):
            continue  # FSDP reduces its own; a plain parameter on one data rank needs nothing
        param.register_post_accumulate_grad_hook(functools.partial(_reduce_grad, group=dp_group))


def _recompute(model: nn.Module, wiring: PlanWiring, modes: dict[str, Recompute]) -> None:
    """Full: each block checkpointed whole; selective: attention cores that can recompute
    alone ([Note: selective recomputation contract] in check.py; check_plan refuses others);
    swap: what each block saves goes to the host after its forward and comes back for its
    backward (MPress's host swap, the activation savers' ``HOST``: [Note: savers in place] in
    tidal/activations/apply.py), or what the child modules of a class save ([Note: savers per
    tensor class] in tidal/planner/block_savers.py)."""
    swapped: dict[str, Saver] = {}
    for prefix, mode in modes.items():
        children = host_children(wiring.model, prefix, mode)
        if children == ():
            continue
        for i in range(wiring.model.blocks[prefix].count):
            path = prefix.replace("*", str(i))
            paths = [path] if children is None else [f"{path}.{c}" for c in children]
            swapped.update(dict.fromkeys(paths, Saver.HOST))
    if swapped:
        cuda = any(p.device.type == "cuda" for p in model.parameters())
        host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None, pin_memory=cuda)
        setattr(model, HOST_SWAP, apply_savers(model, swapped, host=host).host)
    for prefix, mode in modes.items():
        block = wiring.model.blocks[prefix]
        cores = [n for n in block.units if n in wiring.model.attention]
        for i in range(block.count):
            if mode is Recompute.FULL:
                checkpoint(model.get_submodule(prefix.replace("*", str(i))))  # keeps names
            for core in cores:
                module = model.get_submodule(wiring.model.module_path(core, i))
                if hasattr(module, RECOMPUTE_CORE):
                    setattr(module, RECOMPUTE_CORE,
                            mode in (Recompute.SELECTIVE, Recompute.SELECTIVE_SWAP_MLP))  # fmt: skip


def full_state_dict(model: nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """The model's state, whole and in the single-device layout ([Note: fused qkv under tensor
    parallelism]), on every rank: a collective, which every rank must call."""
    state = {
        name: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        for name, value in model.state_dict().items()
    }
    for name, (dim, rows) in getattr(model, REORDERED, {}).items():
        state[name] = state[name].index_select(dim, torch.argsort(rows).to(state[name].device))
    return state


def _reduce_grad(param: nn.Parameter, *, group: dist.ProcessGroup | None) -> None:
    """Finish a gradient FSDP does not own: tensor-axis partial sums, then the data-axis mean."""
    grad = param.grad
    assert grad is not None, "a gradient hook fired for a parameter without a gradient"
    placements = param.placements if isinstance(param, DTensor) else None
    if isinstance(grad, DTensor) and grad.placements != placements:
        param.grad = grad = grad.redistribute(grad.device_mesh, placements)
    if group is not None:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)  # gloo has no average
        local.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------------------------
# the data axis


def _shard_data_axis(model: nn.Module, wiring: PlanWiring, mesh: DeviceMesh, *,
                     params_on_host: float = 0.0) -> None:  # fmt: skip
    """FSDP2 per block and on the root at the plan's ZeRO levels; with ``params_on_host``,
    FSDP2's CPU offload on the groups whose parameters come nearest that fraction of them
    (:func:`~tidal.memory.share.host_share`), their parameters marked :data:`ON_HOST`.

    ZeRO-3 reshards parameters after forward; ZeRO-1 and -2 do not (FSDP2 has no optimizer-only
    sharding). ZeRO-1 groups are tagged for :func:`set_accumulating`, which keeps their whole
    gradients until a step's last micro-batch; see [Note: ZeRO as executed] in strategies.py.
    ZeRO-0 parameters are FSDP's ``ignored_params``; hooks all-reduce their gradients. Units of
    one block (or of the root) at different levels get FSDP groups of their own.
    """
    ignored: set[nn.Parameter] = set()
    groups = [
        (model.get_submodule(prefix.replace("*", str(i))), members)
        for prefix, block in wiring.model.blocks.items()
        for i in range(block.count)
        if (members := _members(model, wiring, prefix, i))
    ]
    root_members = _members(model, wiring, None, 0)
    sizes = [_bytes(members) for _, members in [*groups, (model, root_members)]]
    offloaded = host_share(sizes, params_on_host)

    def policy(group: int) -> dict[str, Any]:
        if group not in offloaded:
            return {}
        return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}

    sharded = [_shard_group(owner, members, mesh, ignored, **policy(g))
               for g, (owner, members) in enumerate(groups)]  # fmt: skip
    root = policy(len(groups))
    levels = {zero for zero, _ in root_members}
    if len(levels) == 1 and levels != {0}:  # the root's own group holds them
        fully_shard(model, mesh=mesh, reshard_after_forward=levels == {3}, ignored_params=ignored,
                    **root)  # fmt: skip
    elif _shard_group(None, root_members, mesh, ignored, **root) or any(sharded):
        fully_shard(model, mesh=mesh, ignored_params=ignored, **root)  # the groups' root
    for g, (_, members) in enumerate([*groups, (model, root_members)]):
        if g in offloaded:  # FSDP2's own parameters now: the host optimizer's masters
            for param in (p for _, modules in members for m in modules for p in m.parameters()):
                setattr(param, ON_HOST, True)


def _bytes(members: list[tuple[int, list[nn.Module]]]) -> int:
    """The bytes of the parameters of ``members`` that FSDP2 shards (ZeRO > 0)."""
    params = {id(p): p for zero, modules in members if zero for m in modules
              for p in m.parameters()}  # fmt: skip
    return sum(p.numel() * p.element_size() for p in params.values())


def set_accumulating(model: nn.Module, accumulating: bool) -> None:
    """Say whether the coming backward is a step's last micro-batch (``False``) or not.

    ZeRO-1 units keep their gathered weights and accumulate whole gradients over the step's
    micro-batches, and reduce-scatter once, in the last backward ([Note: ZeRO as executed] in
    strategies.py). Without this call they reduce every micro-batch, like ZeRO-2: the same
    result, more traffic."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if getattr(module, "_tidal_zero1", False) and isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(not accumulating, recurse=False)
            module.set_reshard_after_backward(not accumulating, recurse=False)


def _members(
    model: nn.Module, wiring: PlanWiring, block: str | None, index: int
) -> list[tuple[int, list[nn.Module]]]:
    """(ZeRO level, modules) of each unit with parameters in repetition ``index`` of ``block``,
    or outside the blocks (``block=None``). Tied units come as one, at the first's level: the
    planner gives the others no parameters of their own, hence no level."""
    found: dict[int, tuple[int, list[nn.Module]]] = {}
    for name, unit in wiring.units.items():
        if name not in wiring.model.owns_params or wiring.model.block_of.get(name) != block:
            continue
        module = model.get_submodule(wiring.model.module_path(name, index))
        for param in list(module.parameters())[:1]:
            found.setdefault(id(param), (unit.zero, []))[1].append(module)
    return list(found.values())


def _shard_group(owner: nn.Module | None, members: list, mesh: DeviceMesh, ignored: set,
                 **policy: Any) -> bool:  # fmt: skip
    """Shard ``owner`` as one group if its units agree on a level, else each unit; say if any."""
    levels = {zero for zero, _ in members}
    if owner is not None and len(levels) == 1 and levels != {0}:
        fully_shard(owner, mesh=mesh, reshard_after_forward=levels == {3}, **policy)
        if levels == {1}:
            setattr(owner, "_tidal_zero1", True)  # noqa: B010 (a marker attribute nn.Module lacks)
        return True
    for zero, modules in members:
        if zero == 0:
            ignored.update(p for m in modules for p in m.parameters())
        else:
            group = modules[0] if len(modules) == 1 else modules
            fully_shard(group, mesh=mesh, reshard_after_forward=zero == 3, **policy)
            if zero == 1:
                for module in modules:
                    module._tidal_zero1 = True
    return any(zero for zero, _ in members)


# ---------------------------------------------------------------------------------------------
# pipeline stages


def apply_to_stage(stage: nn.Module, model: nn.Module, plan: Plan, graph: ModelGraph,
                   mesh: DeviceMesh | None, *, handed: Layout | None) -> None:  # fmt: skip
    """Realise a stage's ``plan`` on ``stage``, a pipeline stage built around ``model``'s own
    modules, in place; ``graph``: the stage's part of ``model``'s structure graph
    (:func:`~tidal.planner.pipelines.stage_graph`), named as in ``model``; ``handed``: the
    layout the stage before sends (None for the first stage). The plan's and the graph's module
    paths are renamed to the stage's ([Note: planned pipeline stages] in
    tidal/train/plan_stage.py), so the stage is laid out as a model of its own."""
    paths = _stage_paths(stage, model, graph)
    renamed_graph = dataclasses.replace(
        graph,
        units=[dataclasses.replace(u, module=paths[u.module]) for u in graph.units],
        blocks={paths[p]: n for p, n in graph.blocks.items()},
        shape_reads={paths.get(m, m): u for m, u in graph.shape_reads.items()},
    )
    renamed_plan = dataclasses.replace(
        plan,
        units=[dataclasses.replace(u, module=paths[u.module]) for u in plan.units],
        recompute={paths[p]: mode for p, mode in plan.recompute.items()},
    )
    wiring = wire_plan(stage, renamed_plan, graph=renamed_graph, handed=handed)
    _apply(stage, renamed_plan, mesh, wiring)
    (block,) = wiring.block_in.values()
    block_inputs = getattr(stage, "block_inputs", None)
    if block_inputs is not None and block[0] is Layout.SEQ:
        assert mesh is not None
        block_inputs.register_forward_pre_hook(functools.partial(_whole_sequence,
                                                                 ranks=mesh["tp"].size()))  # fmt: skip


def _whole_sequence(module: nn.Module, args: tuple[Any, ...], *, ranks: int) -> tuple[Any, ...]:
    """What a stage's blocks take besides the stream (LLaMA's positions and rotary tables)
    counts whole sequences ([Note: positions count whole sequences] in wiring.py), from the
    stream's shape alone: a stream split along the sequence stands in as a whole one (an
    expanded zero, no storage)."""
    x = args[0]
    whole = (x.shape[0], x.shape[1] * ranks, *x.shape[2:])
    return (x.new_zeros(()).expand(whole), *args[1:])


def stage_layouts(plan: Plan, graph: ModelGraph) -> list[tuple[Plan, ModelGraph, Layout | None]]:
    """Each stage of a pipelined ``plan`` for the model of structure ``graph``: the flat plan it
    realises, its part of the graph, and the layout it is handed (None for the first)."""
    from tidal.planner.pipelines import stage_graph

    layout = plan.pipeline
    assert layout is not None, "a pipelined plan"
    found: list[tuple[Plan, ModelGraph, Layout | None]] = []
    last = layout.num_stages - 1
    for s, (start, end) in enumerate(layout.block_ranges):
        mine = stage_graph(graph, blocks=end - start, first=s == 0, last=s == last)
        handed = sent_layout(*found[-1][:2], handed=found[-1][2]) if found else None
        found.append((plan.stage_plan(s), mine, handed))
    return found


def _stage_paths(stage: nn.Module, model: nn.Module, graph: ModelGraph) -> dict[str, str]:
    """Each module path of ``graph`` (``*`` for a block's index) as the stage names it: the
    same module, found by identity; a block pattern by the stage's first block."""
    in_stage = {id(m): name for name, m in stage.named_modules()}
    in_model = dict(model.named_modules())
    (prefix,) = graph.blocks
    first = min(int(n.removeprefix(prefix[:-1]).split(".")[0]) for n in in_model
                if n.startswith(prefix[:-1]) and id(in_model[n]) in in_stage
                and n.removeprefix(prefix[:-1]).split(".")[0].isdigit())  # fmt: skip
    block = in_stage[id(in_model[prefix.replace("*", str(first))])]
    # the stage's blocks are numbered from 0: its first block's index there is the pattern's
    assert block.endswith(".0"), f"{block}: a stage's blocks are numbered from 0"
    stage_prefix = block[:-1] + "*"
    paths = {"": ""}
    for unit in graph.units:
        path = unit.module
        if path == prefix or path.startswith(prefix + "."):
            paths[path] = stage_prefix + path[len(prefix) :]
        elif id(in_model[path]) in in_stage:
            paths[path] = in_stage[id(in_model[path])]
        else:  # code of a module the stage does not hold (the stage's own forward runs it)
            assert unit.segment is not None, f"{path}: a module the stage does not hold"
            paths[path] = ""
    paths[prefix] = stage_prefix
    return paths
