"""A stage's optimizer with part of its update on the host: :class:`HostStepped`.

[Note: the optimizer on the host]
A plan may keep a fraction ``f`` of each device's optimizer, the fp32 masters and the state of
the parameter shares it updates, on the host and update them there (ZeRO-Offload), and a
fraction ``h`` of that on the node's NVMe (ZeRO-Infinity's optimizer tier); [Note: model data
offload] in tidal/planner/strategies.py prices both. Here:

- which parameters: :func:`host_share` takes, of the stage's trainable parameters, those whose
  local bytes come nearest ``f`` of the rank's total (the largest first, each that still fits:
  the bytes taken fall short by less than the smallest share left out), and the NVMe share is
  taken from those alike, ``h`` of theirs. Each rank decides from its own shares, the same on
  every rank of a data-parallel group, so no collective is needed;
- each such parameter gets a host master and the optimizer's state over that master, made by
  the same optimizer class with the same groups and hyperparameters, so its update is torch's
  own arithmetic on the same numbers. The parameters are fp32 on the device (a plan run's
  precision is autocast's), so the device's share is the weight and the master is staged
  from it at each step and freed after: between steps the host keeps the state alone. Where
  FSDP2 already keeps a group's shares on the host (a plan's ``params`` fraction: FSDP2's CPU
  offload of the groups nearest it, marked :data:`~tidal.memory.share.ON_HOST`), those
  parameters are updated there as their own masters and the share is made up beside them;
- a step copies each gradient share down (into a host buffer of the step's, pinned beside a
  GPU), stages the master, updates it on the host and copies it up into the parameter's
  share, one parameter at a time; the device optimizer updates the rest. A parameter without
  a gradient is left alone, as torch leaves it;
- the NVMe share's masters and state live in :class:`~tidal.memory.nvme.NvmeTier` files
  between steps: a step reads them in, updates and writes them back, and frees their host
  memory, one parameter at a time, so the host holds one parameter's worth of it at once;
- a checkpoint is torch's state dict over the module's parameters, in the order of its
  groups, with the host state in the parameters' own layout (a DTensor share on the device,
  made for the checkpoint only), so the one checkpoint format ([Note: checkpoint keys] in
  tidal/train/checkpoint.py) does not know where the state lived and resumes on any mesh;
  loading puts each share back where this run keeps it.

The gradient of an offloaded share stays on the device until the step and goes down then (the
plan prices it on the host from ZeRO-2 on, moved down each micro-batch): during the backward
the device holds it, which the plan does not count.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tidal.config import require
from tidal.memory.nvme import NvmeTier
from tidal.memory.share import ON_HOST, host_share

__all__ = ["HostOptimizerConfig", "HostStepped"]


@dataclass(frozen=True, kw_only=True)
class HostOptimizerConfig:
    """What of a stage's optimizer is on the host; see [Note: the optimizer on the host]."""

    fraction: float  # of the rank's optimizer (masters and state), updated on the host
    nvme_fraction: float = 0.0  # of that, on NVMe between steps
    nvme_dir: str | None = None  # the NVMe tier's folder, where nvme_fraction > 0

    def __post_init__(self) -> None:
        for name in ("fraction", "nvme_fraction"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"offload.{name}", f"must be in [0, 1], got {value}")
        require(
            not self.nvme_fraction or self.nvme_dir is not None,
            "memory.nvme_dir",
            f"the plan keeps {self.nvme_fraction:.0%} of the host's optimizer state on NVMe: "
            "set memory.nvme_dir to a folder on the node's NVMe drive",
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _share_bytes(p: torch.Tensor) -> int:
    local = _local(p)
    return local.numel() * local.element_size()


class HostStepped(torch.optim.Optimizer):
    """``optimizer`` with a share of its update on the host; see [Note: the optimizer on the
    host]. Its groups are ``optimizer``'s, over the same parameters in the same order, and its
    :meth:`state_dict` is the one ``optimizer`` would give."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: HostOptimizerConfig) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert not optimizer.state, "offload an optimizer before its first step"
        # those FSDP2 keeps on the host are updated there, the rest of the share chosen beside
        held = [p for p in params if getattr(p, ON_HOST, False)]
        rest = [p for p in params if not getattr(p, ON_HOST, False)]
        sizes = [_share_bytes(p) for p in rest]
        wanted = config.fraction * sum(map(_share_bytes, params)) - sum(map(_share_bytes, held))
        chosen = host_share(sizes, min(1.0, max(0.0, wanted / sum(sizes))) if sizes else 0.0)
        on_host = held + [p for i, p in enumerate(rest) if i in chosen]
        chosen = host_share([_share_bytes(p) for p in on_host], config.nvme_fraction)
        on_nvme = [p for i, p in enumerate(on_host) if i in chosen]
        self.config = config
        self.device = optimizer
        # the groups as the caller knows them: rates set on them reach both optimizers at step
        groups = [dict(group) for group in optimizer.param_groups]
        masters: dict[int, nn.Parameter] = {}
        for p in on_host:
            masters[id(p)] = p if getattr(p, ON_HOST, False) else nn.Parameter(
                torch.empty_like(_local(p), device="cpu"), requires_grad=True)  # fmt: skip
        self._masters = masters
        host_groups = []
        for group in optimizer.param_groups:
            host_groups.append({**group, "params": [masters[id(p)] for p in group["params"]
                                                    if id(p) in masters]})  # fmt: skip
            group["params"] = [p for p in group["params"] if id(p) not in masters]
        taken = inspect.signature(type(optimizer)).parameters  # defaults hold derived keys too
        self.host = type(optimizer)(host_groups, **{k: v for k, v in optimizer.defaults.items()
                                                    if k in taken})  # fmt: skip
        self._pairs = [(p, masters[id(p)]) for p in on_host]
        self._group_of = {id(m): i for i, group in enumerate(host_groups) for m in group["params"]}
        self._nvme_ids = {id(p) for p in on_nvme}
        self._grads: dict[int, torch.Tensor] = {}  # id(param) -> its host gradient buffer
        self.nvme = (NvmeTier(config.nvme_dir, budget_bytes=None) if on_nvme and config.nvme_dir
                     else None)  # fmt: skip
        self._away: set[int] = set()  # ids of parameters whose state is in the NVMe tier now
        # (id(master), state key) -> the local shape, dtype and DTensor layout (mesh,
        # placements, shape, stride; None: plain) of state the NVMe tier holds
        self._shapes: dict[tuple[int, str], tuple[torch.Size, torch.dtype, Any]] = {}
        for p, master in self._pairs:
            if master is not p:
                master.data.untyped_storage().resize_(0)  # staged at each step only
        super().__init__(groups, optimizer.defaults)
        self._share_state()

    # -- what is where -------------------------------------------------------------------------

    @property
    def on_host(self) -> list[nn.Parameter]:
        """The parameters whose update runs on the host, in order."""
        return [p for p, _ in self._pairs]

    def host_bytes(self) -> dict[str, int]:
        """Bytes the host holds now: masters and gradient buffers (a step's: none between
        steps), optimizer state, and what the NVMe tier holds."""
        masters = sum(m.untyped_storage().nbytes() for p, m in self._pairs if m is not p)
        state = sum(
            _local(t).numel() * t.element_size()
            for _, m in self._pairs
            for t in self.host.state.get(m, {}).values()
            if isinstance(t, torch.Tensor)
        )  # fmt: skip (the step counts too)
        grads = sum(g.numel() * g.element_size() for g in self._grads.values())
        nvme = 0 if self.nvme is None else self.nvme.held_bytes
        return {"masters": masters, "grads": grads, "state": state, "nvme": nvme}

    def _share_state(self) -> None:
        """``self.state``: each parameter's state dict, wherever it lives (the same dicts)."""
        self.state.clear()
        for group in self.device.param_groups:
            for p in group["params"]:
                if p in self.device.state:
                    self.state[p] = self.device.state[p]
        for p, master in self._pairs:
            if master in self.host.state:
                self.state[p] = self.host.state[master]

    # -- the update ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "a closure's forward would run on the device's half only"
        for mine, device_group, host_group in zip(self.param_groups, self.device.param_groups,
                                                  self.host.param_groups, strict=True):  # fmt: skip
            for key, value in mine.items():
                if key != "params":
                    device_group[key] = host_group[key] = value
        self.device.step()
        for p, master in self._pairs:
            if p.grad is None:
                continue  # torch leaves a parameter without a gradient alone
            if master is not p:
                master.grad = self._grad_buffer(p)
                master.grad.copy_(_local(p.grad), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the copies down, before the host reads
        for p, master in self._pairs:
            if p.grad is None:
                continue
            if master is not p:  # the device's share is the weight: staged down, not kept
                master.data.untyped_storage().resize_(_share_bytes(p))
                master.data.copy_(_local(p.detach()))
            if id(p) in self._away:
                self._bring_back(p, master)
            self._step_one(master)
            if master is not p:
                _local(p.detach()).copy_(master.detach())
                master.grad = None
                master.data.untyped_storage().resize_(0)
            if id(p) in self._nvme_ids:
                self._put_away(p, master)
        self._grads.clear()  # gradients are a step's, on the host as on the device
        self._share_state()

    def _step_one(self, master: nn.Parameter) -> None:
        """The host optimizer's update of ``master`` alone (its group's settings)."""
        others = [group["params"] for group in self.host.param_groups]
        mine = self._group_of[id(master)]
        for index, group in enumerate(self.host.param_groups):
            group["params"] = [master] if index == mine else []
        try:
            self.host.step()
        finally:
            for group, params in zip(self.host.param_groups, others, strict=True):
                group["params"] = params

    def _grad_buffer(self, p: nn.Parameter) -> torch.Tensor:
        if id(p) not in self._grads:
            local = _local(p)
            self._grads[id(p)] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                             pin_memory=torch.cuda.is_available())  # fmt: skip
        return self._grads[id(p)]

    # -- the NVMe share ------------------------------------------------------------------------

    def _tensors(self, master: nn.Parameter) -> Iterator[tuple[str, torch.Tensor]]:
        """The optimizer's state tensors of ``master`` (local shares), by their state key."""
        for key, value in self.host.state.get(master, {}).items():
            if isinstance(value, torch.Tensor) and value.dim():
                yield key, _local(value)

    def _put_away(self, p: nn.Parameter, master: nn.Parameter) -> None:
        """Write ``master``'s state to the NVMe tier and drop it from host memory (a tier's
        write pins a tensor's storage, so the state tensors are replaced, not resized)."""
        assert self.nvme is not None
        state = self.host.state.get(master, {})
        tensors = list(self._tensors(master))
        pending = [self.nvme.write(f"{id(master)}-{key}", local) for key, local in tensors]
        for done in pending:
            done.result()
        for key, local in tensors:
            value = state[key]
            spec = ((value.device_mesh, value.placements, value.shape, value.stride())
                    if isinstance(value, DTensor) else None)  # fmt: skip
            self._shapes[(id(master), key)] = (local.shape, local.dtype, spec)
            state[key] = torch.empty(0, dtype=local.dtype)
        self._away.add(id(p))

    def _bring_back(self, p: nn.Parameter, master: nn.Parameter) -> None:
        assert self.nvme is not None
        state = self.host.state.get(master, {})
        pending = []
        for key in list(state):
            if (id(master), key) not in self._shapes:
                continue
            shape, dtype, spec = self._shapes.pop((id(master), key))
            local = torch.empty(shape, dtype=dtype)
            pending.append(self.nvme.read(f"{id(master)}-{key}", local))
            if spec is None:
                state[key] = local
            else:
                mesh, placements, whole_shape, stride = spec
                state[key] = DTensor.from_local(local, mesh, placements, shape=whole_shape,
                                                stride=stride)  # fmt: skip
        for done in pending:
            done.result()
        self._away.discard(id(p))

    def close(self) -> None:
        """Remove the NVMe tier's files."""
        if self.nvme is not None:
            self.nvme.close()

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict over the module's parameters; host state in their layout (made
        for the checkpoint: [Note: the optimizer on the host])."""
        away = [(p, m) for p, m in self._pairs if id(p) in self._away]
        for p, master in away:
            self._bring_back(p, master)
        try:
            saved = super().state_dict()
            index = {id(p): i for i, p in enumerate(self._flat())}
            for p, master in self._pairs:  # copies: the NVMe share's storage is freed below
                if index[id(p)] in saved["state"]:
                    saved["state"][index[id(p)]] = {
                        k: (v.clone() if master is p else _like(p, v))
                        if isinstance(v, torch.Tensor) and v.dim() else v
                        for k, v in saved["state"][index[id(p)]].items()
                    }  # fmt: skip
            return saved
        finally:
            for p, master in away:
                self._put_away(p, master)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`state_dict`'s (or the device optimizer's) output, each share put back where
        this run keeps it."""
        flat = self._flat()
        device_index = {id(p): i for i, p in enumerate(
            q for group in self.device.param_groups for q in group["params"])}  # fmt: skip
        host_index = {id(m): i for i, m in enumerate(
            q for group in self.host.param_groups for q in group["params"])}  # fmt: skip
        device_state: dict[int, Any] = {}
        host_state: dict[int, Any] = {}
        for i, saved in state_dict["state"].items():
            p = flat[int(i)]
            if id(p) in device_index:
                device_state[device_index[id(p)]] = saved
                continue
            master = self._masters[id(p)]
            host_state[host_index[id(master)]] = saved if master is p else {
                k: _local(v).detach().to("cpu", copy=True)
                if isinstance(v, torch.Tensor) and v.dim() else v for k, v in saved.items()
            }  # fmt: skip
        self.device.load_state_dict({"state": device_state,
                                     "param_groups": self.device.state_dict()["param_groups"]})  # fmt: skip
        self.host.load_state_dict({"state": host_state,
                                   "param_groups": self.host.state_dict()["param_groups"]})  # fmt: skip
        for mine, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            mine.update({k: v for k, v in saved_group.items() if k != "params"})
        self._away.clear()
        if self.nvme is not None:
            for p, master in self._pairs:
                if id(p) in self._nvme_ids:
                    self._put_away(p, master)
        self._share_state()

    def _flat(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, a local share on the host, as ``param``'s (a DTensor share on its device)."""
    if isinstance(param, DTensor):
        local = value.to(param.to_local().device, copy=True)
        return DTensor.from_local(local, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride())  # fmt: skip
    return value.to(param.device, copy=True)
