"""AdamW over chunks: gradients, moments and the update, mirroring the parameter chunks.

Gradient and moment chunks have the parameter chunks' layout (same index, same offsets), so a
parameter's gradient and state are found by its parameter slot. Each chunk index is updated
where its parameter chunk is at step time: the indices the engine pinned to the device
(:meth:`ChunkAdamW.place_on_device`, chosen from the margin the trace leaves) keep gradients and
moments there and never move; every other parameter chunk goes to the host before the step, where
its gradients and moments live.

The update itself is torch's functional AdamW (fused where available) over the slot views, so
its arithmetic is the reference engine's, element for element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from tidal.memory.chunk import Chunk, ChunkKind
from tidal.memory.layout import ChunkLayout
from tidal.memory.store import ChunkStore
from tidal.memory.tiers import Tier

__all__ = ["ChunkAdamW", "MissingGradientError", "make_master_chunks"]


def make_master_chunks(model: nn.Module, layout: ChunkLayout, host_tier: Tier) -> list[Chunk]:
    """fp32 copies of the parameters, laid out like the parameter chunks, on the host.

    Call it before the chunk store converts the parameters to a lower precision: the masters
    must start from the full-precision weights.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    masters = []
    for spec in layout.chunks:
        chunk = Chunk(spec, kind=ChunkKind.MASTER, dtype=torch.float32)
        chunk.allocate(host_tier)
        for slot, info in enumerate(spec.slots):
            chunk.write(slot, params[info.names[0]].detach().float())
        chunk.fill_free_slots(0.0)  # padding between slots
        masters.append(chunk)
    return masters


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


class MissingGradientError(RuntimeError):
    """A trainable parameter received no gradient in an accumulation window."""


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    param: nn.Parameter
    chunk: int
    slot: int
    decay: bool


class ChunkAdamW:
    """AdamW whose state lives in chunks; call ``collect`` from the grad hook, then ``step``."""

    def __init__(
        self,
        store: ChunkStore,
        *,
        names: dict[int, str],
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: bool | None,
        decays: Callable[[nn.Parameter], bool] = lambda p: p.dim() >= 2,
        masters: list[Chunk] | None = None,
    ) -> None:
        self.store = store
        # fp32 master weights when the parameter chunks hold a lower precision (see
        # make_master_chunks); the update runs on them and is copied into the parameter chunks.
        self.masters = masters
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.fused = True if fused is None else fused
        self._entries = [
            _Entry(names[pid], param, *store.slot_of[pid], decay=decays(param))
            for pid, param in store.params.items()
            if param.requires_grad
        ]
        self.grads = self._mirror(ChunkKind.GRAD)
        self.exp_avgs = self._mirror(ChunkKind.EXP_AVG)
        self.exp_avg_sqs = self._mirror(ChunkKind.EXP_AVG_SQ)
        # One step counter per parameter, as torch.optim.AdamW keeps them (float32 scalars).
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self._entries]
        self._fresh = {id(e.param): True for e in self._entries}
        self.on_device: frozenset[int] = frozenset()

    def place_on_device(self, indices: frozenset[int]) -> None:
        """Keep the gradients and moments of ``indices`` on the device tier from now on."""
        device_tier = self.store.device_tier
        for index in sorted(indices - self.on_device):
            for chunks in self.state_chunks:
                chunks[index].move_to(device_tier)
        for i, entry in enumerate(self._entries):
            if entry.chunk in indices:
                self.steps[i] = self.steps[i].to(device_tier.device)
        self.on_device |= indices

    def _mirror(self, kind: ChunkKind) -> list[Chunk]:
        chunks = [Chunk(c.spec, kind=kind, dtype=torch.float32) for c in self.store.chunks]
        for chunk in chunks:
            chunk.allocate(self.store.host_tier)
            chunk.fill_free_slots(0.0)
        return chunks

    @property
    def state_chunks(self) -> list[list[Chunk]]:
        """Every per-index chunk list besides the parameters: gradients, moments, masters."""
        lists = [self.grads, self.exp_avgs, self.exp_avg_sqs]
        return lists + [self.masters] if self.masters is not None else lists

    def state_bytes_of(self, index: int) -> int:
        return sum(chunks[index].num_bytes for chunks in self.state_chunks)

    @property
    def state_bytes(self) -> int:
        chunks = self.exp_avgs + self.exp_avg_sqs + (self.masters or [])
        return sum(c.num_bytes for c in chunks) + 4 * len(self.steps)

    @property
    def grad_bytes(self) -> int:
        return sum(c.num_bytes for c in self.grads)

    # -- gradients -------------------------------------------------------------------------------

    def collect(self, param: nn.Parameter) -> None:
        """Move ``param.grad`` into its gradient slot (summing within an accumulation window)."""
        grad = param.grad
        assert grad is not None
        index, slot = self.store.slot_of[id(param)]
        target = self.grads[index].view(slot)
        if self._fresh[id(param)]:
            target.copy_(grad)
            self._fresh[id(param)] = False
        else:
            target.add_(grad)
        if not self.grads[index].on_device:
            num_bytes = grad.numel() * grad.element_size()
            self.store.device_tier.record_move(out_bytes=num_bytes)
            self.store.host_tier.record_move(in_bytes=num_bytes)
        param.grad = None

    def zero_grad(self) -> None:
        for chunk in self.grads:
            chunk.payload.zero_()
        self._fresh = dict.fromkeys(self._fresh, True)

    def _check_coverage(self) -> None:
        missing = [e.name for e in self._entries if self._fresh[id(e.param)]]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise MissingGradientError(
                f"no gradient reached {shown} since the last step: the chunk engine needs every "
                f"trainable parameter to take part in each backward (set requires_grad=False on "
                f"parameters the model does not use)"
            )

    # -- the step --------------------------------------------------------------------------------

    def step(self, *, lr: float, max_grad_norm: float, loss_scale: float = 1.0) -> float | None:
        """Unscale, clip to ``max_grad_norm`` (0: off), update in place.

        Returns the (unscaled) gradient norm, or None when a gradient was not finite: then
        nothing is updated and the gradients are dropped (fp16 overflow; the caller lowers the
        loss scale).
        """
        self._check_coverage()
        self.store.evict_unpinned()
        grads = [self.grads[e.chunk].view(e.slot) for e in self._entries]
        norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(norm):
            self.zero_grad()
            return None
        if loss_scale != 1.0:
            norm = norm / loss_scale
        coefficient = None
        if max_grad_norm > 0:
            # The reference's clip_grad_norm_ formula, so clipped gradients agree bit for bit.
            coefficient = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        if loss_scale != 1.0:  # unscaling folded into the same multiply
            coefficient = (1.0 if coefficient is None else coefficient) / loss_scale
        if coefficient is not None:
            coefficient = torch.as_tensor(coefficient)
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, coefficient.to(device))
        for decay in (True, False):
            for on_device in (True, False):
                picked = [
                    i
                    for i, e in enumerate(self._entries)
                    if e.decay == decay and (e.chunk in self.on_device) == on_device
                ]
                self._update(picked, lr, decay)
        if self.masters is not None:
            for index in {e.chunk for e in self._entries}:
                self.store.chunks[index].payload.copy_(self.masters[index].payload)
        self.zero_grad()
        return float(norm)

    def _update(self, picked: list[int], lr: float, decay: bool) -> None:
        if not picked:
            return
        entries = [self._entries[i] for i in picked]
        weights = self.masters if self.masters is not None else self.store.chunks
        adamw(
            [weights[e.chunk].view(e.slot) for e in entries],
            [self.grads[e.chunk].view(e.slot) for e in entries],
            [self.exp_avgs[e.chunk].view(e.slot) for e in entries],
            [self.exp_avg_sqs[e.chunk].view(e.slot) for e in entries],
            [],
            [self.steps[i] for i in picked],
            fused=self.fused,
            amsgrad=False,
            beta1=self.betas[0],
            beta2=self.betas[1],
            lr=lr,
            weight_decay=self.weight_decay if decay else 0.0,
            eps=self.eps,
            maximize=False,
        )

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per parameter name: step, exp_avg, exp_avg_sq (copies)."""
        return {
            e.name: {
                "step": self.steps[i].clone(),
                "exp_avg": self.exp_avgs[e.chunk].view(e.slot).clone(),
                "exp_avg_sq": self.exp_avg_sqs[e.chunk].view(e.slot).clone(),
            }
            for i, e in enumerate(self._entries)
        }

    def weight(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's full-precision value: its master slot, or its parameter slot."""
        index, slot = self.store.slot_of[id(param)]
        chunks = self.masters if self.masters is not None else self.store.chunks
        return chunks[index].view(slot)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, e in enumerate(self._entries):
            saved = state[e.name]
            self.steps[i].copy_(saved["step"])
            self.exp_avgs[e.chunk].view(e.slot).copy_(saved["exp_avg"])
            self.exp_avg_sqs[e.chunk].view(e.slot).copy_(saved["exp_avg_sq"])
