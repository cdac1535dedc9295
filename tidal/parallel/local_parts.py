"""The chunk engine's parts on one process: whole chunks, pinned optimizer state, relayout,
gradients in parameter chunks, and checkpoints of whole tensors ([Note: chunk engine
construction] in chunk_engine.py says when each step runs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.memory.optim import ChunkOptimizer, make_master_chunks
from tidal.memory.optim_rules import make_rule
from tidal.memory.pinning import choose_pinned
from tidal.memory.relayout import relayout
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier
from tidal.parallel.config import OptimizerConfig, TrainingConfig
from tidal.parallel.flat_state import (
    flat_optimizer_state,
    model_layout,
    model_tensors,
    read_whole,
    unflatten_optimizer_state,
)
from tidal.parallel.parts import PartsHost
from tidal.parallel.protocol import CheckpointTensors, LoadTensors, Phase

__all__ = ["LocalParts", "checkpoint_meta", "largest_module_bytes", "persistent_buffers"]


class LocalParts:
    """One process: the chunk engine's ``parts`` (the ``ChunkParts`` protocol)."""

    rank = 0
    world_size = 1
    gathers = False

    def __init__(self) -> None:
        self._placed = False  # whether the optimizer's state is placed by the pinned chunks
        self._relayout_pending = False  # see before_step

    def agree_budgets(self, device_tier: Tier, host_tier: Tier) -> None:
        """One process agrees with itself."""

    def make_masters(self, engine: PartsHost, param_dtype: torch.dtype) -> Any:
        if param_dtype == torch.float32:
            return None
        return make_master_chunks(engine.model, engine.layout, engine.host_tier, engine.values())

    def make_store(self, engine: PartsHost, dtype: torch.dtype, chunk: ChunkConfig) -> Any:
        store = ChunkStore(engine.model, layout=engine.layout, device_tier=engine.device_tier,
                           host_tier=engine.host_tier, dtype=dtype, policy=chunk.policy,
                           prefetch=chunk.prefetch, values=engine.values())  # fmt: skip
        self._relayout_pending = store.keep_trace_params = chunk.relayout is not False
        return store

    def minimum_budget(self, engine: PartsHost) -> tuple[int, str]:
        return largest_module_bytes(engine.model, engine.store)

    def make_optimizer(self, engine: PartsHost, optimizer: OptimizerConfig,
                       training: TrainingConfig, chunk: ChunkConfig, masters: Any) -> Any:  # fmt: skip
        made = ChunkOptimizer(
            engine.store,
            names={id(p): n for n, p in engine.model.named_parameters()},
            rule=make_rule(optimizer),
            weight_decay=optimizer.weight_decay,
            decays=optimizer.decays,
            fused=optimizer.use_fused(engine.device.type),
            masters=masters,
            # [Note: gradients in parameter chunks] in tidal/memory/optim.py
            grads_in_params=(
                chunk.grads_in_params is not False
                and masters is not None
                and training.grad_accum_steps == 1
            ),
        )
        engine.store.on_unpin = lambda: self._unplace_optimizer(made)
        return made

    def read_parameter(self, engine: PartsHost, param: nn.Parameter) -> torch.Tensor:
        """``param``'s weights at full precision (its fp32 master where it has one)."""
        engine.store.wait_for_copies()
        return engine.optimizer.weight(param).detach().to(torch.float32, copy=True)

    def write_parameter(self, engine: PartsHost, param: nn.Parameter, value: torch.Tensor) -> None:  # fmt: skip
        """Into ``param``'s slot (on either tier) and its fp32 master: both are what the next
        forward and step read."""
        store = engine.store
        if id(param) in store.grads_in_slots:  # it would be overwritten: lost without a word
            raise RuntimeError(
                f"writing {store.names_of([param])[0]} between backward() and step(): the "
                "gradients live in the parameters' storage (chunk.grads_in_params); call step() "
                "or zero_grad() first"
            )
        index, slot = store.slot_of[id(param)]
        store.wait_for_copies()  # no queued copy may land on what is written here
        engine.optimizer.weight(param).copy_(value)
        store.chunks[index].view(slot).copy_(value)

    def before_backward(self, engine: PartsHost) -> None:
        """Nothing to drop: chunks are whole on one process."""

    def after_backward(self, engine: PartsHost) -> None:
        """Nothing to wait for: gradients are complete when the backward returns."""

    def before_step(self, engine: PartsHost) -> None:
        """Until the optimizer is placed: relayout (once), then pin what fits."""
        if not self._placed:
            self._relayout(engine)
            self._place_optimizer(engine)

    def _relayout(self, engine: PartsHost) -> None:
        """Re-pack the chunks in first-use order, once, at the first step with a trace and no
        iteration open; see [Note: relayout] in tidal/memory/relayout.py."""
        if (
            not self._relayout_pending
            or engine.store.trace is None
            or engine.phase is Phase.FORWARD
        ):
            return
        self._relayout_pending = False
        done = relayout(engine.model, engine.store, engine.optimizer)
        engine.store.keep_trace_params = False  # relayout's translation was their only reader
        if done is None:
            return
        engine.layout = engine.store.layout
        engine.min_budget_bytes, engine.largest_module = self.minimum_budget(engine)
        engine.check_minimum_budget()  # relayout checked it would fit: this only asserts it

    def _place_optimizer(self, engine: PartsHost) -> None:
        """Pin the chunks whose optimizer state fits the margin; see [Note: optimizer placement]
        in tidal/memory/pinning.py."""
        pinned = choose_pinned(engine.store, engine.optimizer, engine.device_tier.budget_bytes)
        if pinned is None:
            return  # no trace yet: decide at the next step
        engine.store.pin(pinned)
        engine.optimizer.place_on_device(pinned)
        self._placed = True

    def _unplace_optimizer(self, optimizer: ChunkOptimizer) -> None:
        """The store gave up its pinned chunks: state to the host, choose again at the step."""
        optimizer.place_on_host()
        self._placed = False

    def stats(self, engine: PartsHost, stats: dict[str, Any]) -> dict[str, Any]:
        return stats

    # -- state: whole tensors ------------------------------------------------------------------

    def model_state_dict(self, engine: PartsHost) -> dict[str, torch.Tensor]:
        engine.store.wait_for_copies()
        state = {}
        for name, param in engine.model.named_parameters(remove_duplicate=False):
            # fp32 throughout, frozen parameters included (they have no fp32 master to read).
            state[name] = engine.optimizer.weight(param).detach().to(torch.float32, copy=True)
        for name, buffer in persistent_buffers(engine.model):
            state[name] = buffer.detach().clone()
        return {k: state[k] for k in engine.model.state_dict(keep_vars=True)}

    def load_state_dict(self, engine: PartsHost, state: dict[str, Any]) -> None:
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        buffers = dict(persistent_buffers(engine.model))
        for name, value in state["model"].items():
            if name in params:
                engine.write_parameter(params[name], value)
            else:
                buffers[name].copy_(value)
        engine.optimizer.load_state_dict(state["optimizer"])

    def checkpoint_state(self, engine: PartsHost) -> CheckpointTensors:
        state = engine.state_dict()
        model_state = state.pop("model")
        meta = model_layout(engine.model, {n: t.shape for n, t in model_state.items()})
        tensors, steps = flat_optimizer_state(state.pop("optimizer"))
        tensors.update(model_tensors(model_state, meta))
        meta["numels"] = {key: int(t.numel()) for key, t in tensors.items()}
        return CheckpointTensors(tensors=tensors, extras={**state, "optimizer_steps": steps},
                                 meta=meta)  # fmt: skip

    def restore_checkpoint(self, engine: PartsHost, load: LoadTensors, extras: dict[str, Any],
                           meta: dict[str, Any]) -> None:  # fmt: skip
        model, flat = read_whole(load, meta)
        optimizer = unflatten_optimizer_state(flat, extras["optimizer_steps"],
                                              meta["model_shapes"])  # fmt: skip
        rest = {k: v for k, v in extras.items() if k != "optimizer_steps"}
        engine.load_state_dict({"model": model, "optimizer": optimizer, **rest})


def checkpoint_meta(engine: PartsHost, tensors: dict[str, Any]) -> dict[str, Any]:
    """What ``meta.json`` records of a chunk engine's model: each state-dict name's key and
    shape ([Note: checkpoint keys]); ``numels``: of ``tensors``, the checkpoint's keys."""
    model_state = engine.model.state_dict(keep_vars=True)
    meta = model_layout(engine.model, {n: t.shape for n, t in model_state.items()})
    return {"numels": {key: int(t.size()[0]) for key, t in tensors.items()}, **meta}


def largest_module_bytes(model: nn.Module, store: ChunkStore) -> tuple[int, str]:
    """The bytes of chunks the hungriest module needs at once, and its name.

    A module runs inside its ancestors' forward and backward, whose own chunks stay in use
    (COMPUTE) meanwhile, so a module needs its chunks and those of every ancestor that owns
    parameters.
    """
    need, owner = 0, ""

    def visit(module: nn.Module, name: str, held: frozenset[int]) -> None:
        nonlocal need, owner
        held = held | store.chunks_of(module.parameters(recurse=False))
        num_bytes = sum(store.chunks[i].num_bytes for i in held)
        if num_bytes > need:
            need, owner = num_bytes, name or "<root>"
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, held)

    visit(model, "", frozenset())
    return need, owner


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer
