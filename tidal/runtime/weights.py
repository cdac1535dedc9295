"""One pipeline stage's weights under asynchronous schedules: versions, delays, and the
saved-tensor redirection that lets the optimizer step in place between a microbatch's F and B.

Import from :mod:`tidal.runtime.pipemare`, which re-exports everything here and holds the
PipeMare math ([Note: weight delay tau], [Note: PipeMare rules]); a stage's settings
(:class:`AsyncConfig`, :class:`WeightMode`) and PipeMare's per-update factors are in
async_config.py.

[Note: saved-tensor redirection]
An in-place ``optimizer.step()`` between a microbatch's forward and backward makes autograd raise
("modified by an inplace operation"); an out-of-place step silently keeps every old weight alive
through autograd's saved tensors, which is PipeDream's stashing memory by accident. Instead, while
``forward(mb)`` is active, a ``saved_tensors_hooks`` pack hook replaces each saved tensor that
aliases one of the stage's parameters (same storage, same dtype, its elements inside the
parameter's) by a small token: (parameter index, size, stride, offset relative to the parameter,
forward version, microbatch). No weight is referenced, so nothing is stashed and the in-place
update is legal. Unpacking a token in backward rebuilds the view with ``as_strided`` on the
*backward weights* of that microbatch ([Note: backward weights]), so views such as the
``weight.t()`` that ``addmm`` saves come back with their own size, stride and offset.
- Saved tensors that do not alias a parameter are kept as detached references (returning the
  tensor itself would make a reference cycle through its ``grad_fn`` that never frees), with
  their version recorded: unpacking raises if it changed, the check autograd itself skips once
  hooks are installed.
- Hooks already installed when ``forward`` is entered (a memory meter, ``save_on_cpu``) still get
  every non-parameter tensor: the pack hook hands them on and unpacks through them.
- Derived tensors cannot be redirected: a dtype cast under autocast, or a fused kernel's private
  copy, is a new storage computed from the forward's weights, so autograd keeps it (a stashed
  copy of sorts) and the backward uses the forward's weights for it. A saved floating-point
  tensor with a weight matrix's shape (or transposed shape) and another dtype is counted in
  ``num_unredirected_saves`` and warned about once (a heuristic: an activation of exactly that
  shape and dtype would be counted too).
- With no update between F and B the tokens rebuild exactly the tensors autograd would have
  used, so gradients are bit-for-bit those of plain autograd.
- Limits: non-reentrant activation checkpointing installs its own hooks inside its region, whose
  recompute runs with the live weights; ``create_graph=True`` does not differentiate through
  redirected weights.

[Note: backward weights]
- ``CURRENT``: the live parameter (no copy). With correction: ``w - tau * delta``, built once per
  parameter and backward call and freed when the call ends; tau = 0 uses the live parameter.
  With prediction the backward uses the live parameter too, and it is the *forward* that runs on
  other weights: a transient predicted copy swapped into ``.data`` for the forward's duration,
  like 2BW's stash ([Note: weight prediction] in pipemare.py).
- ``STASH`` (PipeDream): the forward's version. Forward always runs on the live weights; ``step``
  copies the current weights before updating them in place if an in-flight microbatch (forward
  done, backward not yet finished) used them, and a copy is dropped once no in-flight microbatch
  uses it: the copies held are (versions in flight - 1).
- ``TWO_VERSIONS`` (PipeDream-2BW, W_{t+1} = W_t - lr * grad f(W_{t-1})): like ``STASH``, but
  the forward version is refreshed only at the first microbatch of each batch of m
  (``microbatch % m == 0``) to the stage's current version, and every microbatch of the batch
  runs its forward *and* backward on it; the same rule as the 2bw schedule generator
  ([Note: weight versions in generated schedules] in schedules.py), whose versions the executor
  passes explicitly. The batch's later microbatches, after an update, run on the stashed copy:
  ``forward`` swaps each parameter's ``.data`` with the copy for the duration of the forward
  (O(1); the parameter objects and the optimizer's state stay the same) and back. The batch's
  version is kept until the next batch starts, so at most one copy is held; a schedule that
  would need two (fewer microbatches per update than in flight) raises.

[Note: stashes on the host]
PipeDream's stashed versions are read only by the backward (and a recompute inside it) of the
microbatches that ran on them, so between an update and those backwards they can wait in the
host tier (``stash_to``, MPress's host swap for weight versions: the saver planner chooses it
per stage, [Note: pipeline memory] in tidal/train/pipeline_memory.py). Each copy is allocated
there with the parameter's strides (byte-budgeted: past the budget the tier raises before
anything is copied) and given back when no microbatch in flight needs its version. On the CPU
the host tier is the device's memory, so the backward reads the copy in place; on CUDA it
copies the version it needs to the device for the duration of its backward (one at a time:
a stage runs one backward at once) and drops it after. The values are the same bytes, so the
gradients are bit for bit those of a stash kept on the device.

[Note: stashes on a peer]
MPress's peer swap for PipeDream's weight versions (updating after every microbatch,
``microbatches = 1``, stage s holds p - s of them). ``lend_with`` hands each forward's
parameters to the stage's lending ([Note: lending] in tidal/pipeline/lending.py): their bytes
join what the microbatch lends and leave with the ``LO`` right after its forward, before any
update (the forward's version exactly), and come back with the ``LI`` before its backward,
which reads them in place of a stash. An update keeps
no copy of a version that only lent microbatches need, so the stage holds no stashed version,
only the one that came back, for its backward. The lender holds a copy per microbatch in
flight, one more than a stash would (the newest version is still the live one when it leaves):
``Saved.copies_lent``. Where a version serves several microbatches (an update every ``m > 1``)
each sends its own copy: the planner prices that (a copy per microbatch in flight on the
lender, a send and a fetch per microbatch), so it lends them only where that pays.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tidal.config import require
from tidal.parallel.reference import autocast
from tidal.parallel.stage_params import (
    all_reduce_mean,
    like,
    plain_grad_squares,
    plain_scale_grads,
    whole,
)
from tidal.pipeline.async_config import AsyncConfig, WeightMode, correction_gamma, update_rate
from tidal.runtime.lookahead import next_update
from tidal.runtime.precision import PRECISIONS
from tidal.runtime.redirect import Packer, ParamToken, clone_like, storage_ptr

if TYPE_CHECKING:
    from tidal.memory.tiers import Tier

__all__ = ["Lend", "StageWeights"]

# given a stage's parameters at a forward, sends their bytes with the microbatch's lent ones and
# returns what reads them back in its backward ([Note: stashes on a peer])
Lend = Callable[[list[nn.Parameter]], Callable[[], list[torch.Tensor]]]


class StageWeights:
    """Versions, delays and backward weights of one pipeline stage; see the module notes."""

    version: int  # updates applied so far
    delays: dict[int, int]  # microbatch -> measured tau ([Note: weight delay tau])
    sharded_by_fsdp2 = False  # the parameters are FSDP2's shards (fsdp_stage.py)

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: AsyncConfig,
        *,
        dp_group: dist.ProcessGroup | None = None,
        precision: str = "fp32",
        own_rates: bool = False,
    ) -> None:
        """``dp_group``: the replicas of this stage whose gradients :meth:`reduce_gradients`
        averages (None: no data parallelism). ``precision``: bf16 or fp16 run each forward
        under autocast on the fp32 parameters ([Note: pipeline mixed precision] in
        precision.py). ``own_rates``: ``optimizer`` is yours and keeps its own learning rates
        (or your scheduler's): :meth:`step` ignores the rate it is given ([Note: your
        optimizer] in tidal/train/user_optim.py)."""
        require(precision in PRECISIONS, "training.precision",
                f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")  # fmt: skip
        assert not (own_rates and config.lr_rescheduling), "a rescheduled rate is PipeMare's"
        self.own_rates = own_rates
        self.module = module
        self.precision = precision
        self.optimizer = optimizer
        self.config = config
        self.dp_group = dp_group
        # Frozen parameters never change, so only trainable ones are versioned and redirected.
        self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self.version = 0
        self.delays = {}
        self.version_at_forward: dict[int, int] = {}  # microbatches in flight
        self.last_lr: float | None = None
        self.last_delay = 0.0  # mean tau of the last update's microbatches
        self.num_unredirected_saves = 0
        self._pending: list[int] = []  # backward done since the last update
        self._stashes: dict[int, list[torch.Tensor]] = {}  # version -> copies of every param
        self._delta: list[torch.Tensor] | None = None
        if config.correction or config.prediction:
            self._delta = [
                torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params
            ]
        self._active: int | None = None  # microbatch whose backward is running
        self._corrected: dict[int, torch.Tensor] = {}  # param index -> w - tau * delta
        self._forward_copy: list[torch.Tensor] = []  # the predicted weights during a forward
        self._warned = False
        self._unredirected: set[int] = set()  # microbatches in flight with unredirected saves
        self._batch_version = 0  # 2BW: the version the current batch's forwards use
        self._stash_tier: Tier | None = None  # [Note: stashes on the host]
        self._fetched: tuple[int, list[torch.Tensor]] | None = None  # a host stash on the device
        self._lend: Lend | None = None  # [Note: stashes on a peer]
        self._lent: dict[int, Callable[[], list[torch.Tensor]]] = {}  # microbatch -> its version

    @property
    def stashed_bytes(self) -> int:
        """Bytes of the weight versions held besides the live one (PipeDream, 2BW)."""
        return sum(t.numel() * t.element_size() for copy in self._stashes.values() for t in copy)

    def is_stashed(self, storage_key: int) -> bool:
        """Whether a storage (``untyped_storage()._cdata``) is a stashed weight version's: a
        forward on a stashed version (2BW) saves views of it, which are model data."""
        return any(t.untyped_storage()._cdata == storage_key
                   for copy in self._stashes.values() for t in copy)  # fmt: skip

    # -----------------------------------------------------------------------------------------
    # forward

    def _forward_version(self, microbatch: int, version: int | None) -> int:
        if version is None:
            if self.config.weights is not WeightMode.TWO_VERSIONS:
                return self.version
            m = self.config.microbatches_per_update
            if m == 0:
                raise ValueError(
                    "weights='2bw' needs the forward's version: set "
                    "AsyncConfig.microbatches_per_update or pass forward(mb, version=...)"
                )
            return self.version if microbatch % m == 0 else self._batch_version
        if self.config.weights is WeightMode.CURRENT and version != self.version:
            raise ValueError(
                f"weights='current' runs the forward on the live version {self.version}, "
                f"got version={version}; use weights='stash' or '2bw' to run older versions"
            )
        return version

    @contextlib.contextmanager
    def forward(self, microbatch: int, *, version: int | None = None) -> Iterator[None]:
        """Wrap the stage's forward of ``microbatch``; see [Note: saved-tensor redirection]."""
        if microbatch in self.version_at_forward:
            raise ValueError(f"microbatch {microbatch} is already in flight on this stage")
        fwd_version = self._forward_version(microbatch, version)
        if fwd_version > self.version:
            raise RuntimeError(
                f"microbatch {microbatch} needs weight version {fwd_version} but the stage is at "
                f"{self.version}: with weights='2bw' an update needs at least as many microbatches "
                "as are in flight (m >= number of stages)"
            )
        stash = None if fwd_version == self.version else self._usable(fwd_version)
        self.version_at_forward[microbatch] = fwd_version
        if self._lend is not None:
            self._lent[microbatch] = self._lend(self.params)
        self._batch_version = fwd_version
        self._release()  # a 2BW batch's first forward frees the previous batch's copy
        if stash is None and self.config.prediction:
            stash = self._predicted(microbatch)
            self._forward_copy = stash or []
        live = None if stash is None else self._swap_in(stash)
        packer = Packer(self, microbatch, fwd_version)
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack),
                autocast(self.precision, self._device()),
            ):
                yield
        except BaseException:
            del self.version_at_forward[microbatch]
            self._lent.pop(microbatch, None)
            raise
        finally:
            if live is not None:
                self._swap_in(live)
            self._forward_copy = []

    def expected_delay(self, microbatch: int) -> float:
        """``tau_hat``: the delay ``microbatch`` will likely have ([Note: weight prediction])."""
        m = self.config.microbatches_per_update
        if not m:
            return self.last_delay
        # The same slot of the latest step whose backward has run (up to p are in flight). A
        # runtime numbers each program's microbatches from 0, so an entry may come from the
        # previous program: its same slot, which had the same delay.
        for earlier in range(microbatch - m, -1, -m):
            if earlier in self.delays:
                return float(self.delays[earlier])
        # A program's first step sees no update between its forwards and backwards.
        return 0.0 if microbatch < m else self.last_delay

    def _predicted(self, microbatch: int) -> list[torch.Tensor] | None:
        # [Note: weight prediction] in pipemare.py: the optimizer's next update, then delta.
        tau_hat = self.expected_delay(microbatch)
        if self._delta is None or tau_hat <= 0:
            return None
        m = self.config.microbatches_per_update
        fraction_done = min(1.0, len(self._pending) / m) if m else 0.0
        with torch.no_grad():
            first = next_update(self.optimizer, self.params, fraction_done=fraction_done)
            later = tau_hat - 1.0 if first is not None else tau_hat
            predicted = []
            for index, p in enumerate(self.params):
                w = clone_like(p)
                if first is not None:
                    w.add_(first[index])
                if later > 0:
                    w.add_(self._delta[index], alpha=later)
                predicted.append(w)
        return predicted

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _swap_in(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        previous = [p.data for p in self.params]
        for p, t in zip(self.params, tensors, strict=True):
            p.data = t
        return previous

    def _stash(self, version: int) -> list[torch.Tensor]:
        stash = self._stashes.get(version)
        if stash is None:
            raise RuntimeError(
                f"weight version {version} is not held (stage at {self.version}, held "
                f"{sorted(self._stashes)}): with weights={self.config.weights.value!r} only "
                "versions used by in-flight microbatches are kept"
            )
        return stash

    def stash_to(self, tier: Tier) -> None:
        """Keep PipeDream's stashed versions in ``tier`` (the host's) from now on: [Note:
        stashes on the host]."""
        if self.config.weights is not WeightMode.STASH:
            raise ValueError(
                f"only PipeDream's stashed versions wait on the host (weights='stash'), not "
                f"weights={self.config.weights.value!r}: 2BW runs its forwards on its copy"
            )
        self._stash_tier = tier
        for version, copies in list(self._stashes.items()):  # a resumed stage's
            self._stashes[version] = [self._stash_copy(t) for t in copies]

    def lend_with(self, lend: Lend) -> None:
        """Send each forward's version to a peer with the microbatch's lent bytes, and read it
        from there in its backward: [Note: stashes on a peer]."""
        if self.config.weights is not WeightMode.STASH:
            raise ValueError(
                f"only PipeDream's stashed versions go to a peer (weights='stash'), not "
                f"weights={self.config.weights.value!r}"
            )
        assert not self.version_at_forward, "lending starts with no microbatch in flight"
        self._lend = lend

    def _stash_copy(self, p: torch.Tensor) -> torch.Tensor:
        if self._stash_tier is None:
            return clone_like(p)
        span = 1 + sum((n - 1) * s for n, s in zip(p.size(), p.stride(), strict=True))
        flat = self._stash_tier.allocate(span if p.numel() else 0, p.dtype)
        return flat.as_strided(p.size(), p.stride()).copy_(p.detach())

    def _drop(self, version: int) -> None:
        for copy in self._stashes.pop(version):
            if self._stash_tier is not None and self._stash_tier.holds(copy):
                self._stash_tier.free(copy)

    def _usable(self, version: int) -> list[torch.Tensor]:
        """The stash of ``version`` where the parameters are (a copy of a host stash on CUDA,
        kept until the backward ends)."""
        active = self._active
        lent = None if active is None else self._lent.get(active)
        if lent is not None and active is not None and self.version_at_forward[active] == version:
            if self._fetched is None or self._fetched[0] != version:
                self._fetched = (version, lent())  # views of the bytes the peer sent back
            return self._fetched[1]
        stash = self._stash(version)
        device = self.params[0].device if self.params else None
        if not stash or stash[0].device == device:
            return stash
        if self._fetched is None or self._fetched[0] != version:
            fetched = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                       .copy_(t) for t in stash]  # fmt: skip
            self._fetched = (version, fetched)
        return self._fetched[1]

    def note_unredirected(self, microbatch: int) -> None:
        self.num_unredirected_saves += 1
        if self.precision == "fp32":  # an autocast of the caller's: warn now
            self._warn_unredirected(stacklevel=5)
        else:  # the stage's own: it matters only if the weights change before the backward
            self._unredirected.add(microbatch)

    def _warn_unredirected(self, *, stacklevel: int) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "a saved tensor with a parameter's shape but another dtype (an autocast cast?) "
                "cannot be redirected: autograd keeps it, so its backward uses the forward's "
                "weights and it costs a weight copy per microbatch in flight",
                stacklevel=stacklevel,
            )

    # -----------------------------------------------------------------------------------------
    # backward

    def delay(self, microbatch: int) -> int:
        """Current version minus the version ``microbatch``'s forward used."""
        return self.version - self.version_at_forward[microbatch]

    @contextlib.contextmanager
    def backward(self, microbatch: int, *, last: bool = True) -> Iterator[None]:
        """Wrap ``torch.autograd.backward`` of ``microbatch``; see [Note: backward weights].

        ``last=False`` keeps the microbatch in flight (a zero-bubble ``B`` before its ``W``).
        """
        if microbatch not in self.version_at_forward:
            raise ValueError(f"microbatch {microbatch} has no forward in flight on this stage")
        tau = self.delay(microbatch)
        self.delays[microbatch] = tau
        if microbatch in self._unredirected:
            self._unredirected.discard(microbatch)
            if tau and self.config.weights is WeightMode.CURRENT:
                self._warn_unredirected(stacklevel=4)
        self._active = microbatch
        try:
            yield
        finally:
            self._active = None
            self._corrected.clear()
            self._fetched = None
        if microbatch not in self._pending:
            self._pending.append(microbatch)
        if last:
            del self.version_at_forward[microbatch]
            self._lent.pop(microbatch, None)
            self._release()

    @contextlib.contextmanager
    def forward_weights(self) -> Iterator[None]:
        """Inside :meth:`backward`: the weights its microbatch's forward ran on, swapped into the
        parameters for a recompute of part of that forward, and the live ones back after."""
        if self._active is None:
            raise RuntimeError("forward_weights is for a recompute inside a stage's backward")
        version = self.version_at_forward[self._active]
        if version == self.version and not self.config.prediction:
            yield
            return
        if self.config.weights is WeightMode.CURRENT:
            raise RuntimeError(
                f"microbatch {self._active}'s forward ran on version {version} (or a predicted "
                f"copy), which weights='current' does not keep: a recompute would run on other "
                "weights; recompute only under synchronous or stashing schedules"
            )
        live = self._swap_in(self._usable(version))
        try:
            yield
        finally:
            self._swap_in(live)

    def _backward_base(self, index: int, microbatch: int, version: int) -> torch.Tensor:
        live = self.params[index].detach()
        mode = self.config.weights
        if mode is not WeightMode.CURRENT:
            return live if version == self.version else self._usable(version)[index]
        tau = self.version - version
        if self._delta is None or tau == 0 or not self.config.correction:
            return live
        if microbatch == self._active and index in self._corrected:
            return self._corrected[index]
        corrected = clone_like(live).sub_(self._delta[index], alpha=tau)
        if microbatch == self._active:
            self._corrected[index] = corrected
        return corrected

    def backward_view(self, token: ParamToken) -> torch.Tensor:
        base = self._backward_base(token.index, token.microbatch, token.version)
        offset = base.storage_offset() + token.rel_offset
        return base.as_strided(token.size, token.stride, offset)

    # -----------------------------------------------------------------------------------------
    # gradients ([Note: the stage-parameter protocol] in stage_params.py)

    def _named(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    def reduce_gradients(self) -> None:
        all_reduce_mean(self.params, self.dp_group)

    def grad_squares(self, *, skip: frozenset[str] = frozenset()) -> torch.Tensor:
        return plain_grad_squares(self._named(), skip=skip)

    def scale_grads(self, factor: torch.Tensor) -> None:
        plain_scale_grads(self.params, factor)

    def gradient(self, name: str) -> torch.Tensor | None:
        return dict(self.module.named_parameters())[name].grad

    def set_gradient(self, name: str, value: torch.Tensor) -> None:
        grad = self.gradient(name)
        assert grad is not None, f"{name} has no gradient to replace"
        grad.copy_(value)

    def value(self, name: str) -> torch.Tensor:
        return whole(self._param(name).detach()).to(torch.float32, copy=True)

    def set_value(self, name: str, value: torch.Tensor) -> None:
        """The live weights become ``value``; with a delta buffer (correction, prediction) the
        change joins it as the last update's own change did, so the delta follows the weights
        whoever moved them."""
        param = self._param(name)
        new = like(param, value.to(param.dtype))
        with torch.no_grad():
            if self._delta is not None:
                index = next(i for i, p in enumerate(self.params) if p is param)
                gamma = correction_gamma(self.last_delay, self.config.correction_decay)
                self._delta[index].add_(new - param.detach(), alpha=1.0 - gamma)
            param.copy_(new)

    def drop_gradient(self, name: str) -> None:
        self._param(name).grad = None  # torch's optimizers skip it: no update, no new state

    def _param(self, name: str) -> nn.Parameter:
        return dict(self.module.named_parameters())[name]

    # -----------------------------------------------------------------------------------------
    # update

    def step(self, *, lr: float, step: int) -> float:
        """Apply one in-place optimizer update to the accumulated ``.grad``; returns the lr used.

        The delay used for LR rescheduling and for the correction's gamma is the mean measured
        tau of the microbatches whose backward ran since the previous update ([Note: PipeMare
        rules]).
        """
        base = float(self.optimizer.param_groups[0]["lr"]) if self.own_rates else lr
        lr_used, tau = update_rate(self.config, [self.delays[mb] for mb in self._pending], base,
                                   step)  # fmt: skip
        if not self.own_rates:
            for group in self.optimizer.param_groups:
                group["lr"] = lr_used
        self._stash_before_update()  # also drops copies no longer needed after this update
        # A transient copy of the old weights: w_new - w_old in one subtraction is exact enough
        # for tiny updates, where folding w_old into delta first would lose them to rounding.
        old = [clone_like(p) for p in self.params] if self._delta is not None else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._delta is not None and old is not None:
            gamma = correction_gamma(tau, self.config.correction_decay)
            with torch.no_grad():
                for d, p, w_old in zip(self._delta, self.params, old, strict=True):
                    d.mul_(gamma).add_(p.detach() - w_old, alpha=1.0 - gamma)
            del old
        self._pending.clear()
        self.version += 1
        self.last_lr, self.last_delay = lr_used, tau
        self._release()
        return lr_used

    def _needed_versions(self) -> set[int]:
        """The versions a stash must keep: those of microbatches in flight whose copy is not on
        a peer."""
        needed = {v for mb, v in self.version_at_forward.items() if mb not in self._lent}
        if self.config.weights is WeightMode.TWO_VERSIONS:
            needed.add(self._batch_version)  # the current batch's forwards still to come
        return needed

    def _stash_before_update(self) -> None:
        if self.config.weights is WeightMode.CURRENT:
            return
        # Dropping the copies this update makes useless first keeps 2BW at one copy throughout.
        needed = self._needed_versions()
        for version in [v for v in self._stashes if v not in needed]:
            self._drop(version)
        if self.version in needed and self.version not in self._stashes:
            self._stashes[self.version] = [self._stash_copy(p) for p in self.params]

    def _release(self) -> None:
        needed = self._needed_versions()
        for version in [v for v in self._stashes if v not in needed]:
            self._drop(version)
        if self.config.weights is WeightMode.TWO_VERSIONS and len(self._stashes) > 1:
            raise RuntimeError(
                f"weights='2bw' would hold versions {sorted(self._stashes)} besides the live "
                f"{self.version}: update every m >= (microbatches in flight) microbatches"
            )

    def skip_step(self) -> None:
        """Drop the gradients without an update; the version advances as :meth:`step`'s."""
        self._stash_before_update()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending.clear()
        self.version += 1
        self._release()

    # -----------------------------------------------------------------------------------------
    # memory and checkpoints

    def held_weight_bytes(self) -> int:
        """Bytes of the distinct storages held beyond the live parameters."""
        tensors = [t for stash in self._stashes.values() for t in stash]
        tensors += self._delta or []
        tensors += list(self._corrected.values())
        tensors += self._forward_copy
        storages = {storage_ptr(t): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def held_weight_copies(self) -> int:
        """Weight-sized copies held now beyond the live parameters (stashes + delta)."""
        param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        return round(self.held_weight_bytes() / param_bytes) if param_bytes else 0

    def state_dict(self) -> dict[str, Any]:
        """Version, delta, stashes and measured delays, for checkpoints (tensors not copied)."""
        assert not self._lent, "a checkpoint is a flush point: no version is away on a peer"
        return {
            "version": self.version,
            "delta": None if self._delta is None else list(self._delta),
            "stashes": {v: list(ts) for v, ts in self._stashes.items()},
            "version_at_forward": dict(self.version_at_forward),
            "delays": dict(self.delays),
            "pending": list(self._pending),
            "batch_version": self._batch_version,
            "last_delay": self.last_delay,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; tensors are copied into fresh buffers."""
        delta = state["delta"]
        if (delta is None) != (self._delta is None):
            raise ValueError(
                "the checkpoint's delta buffer (discrepancy correction or weight prediction) "
                "does not match this stage's AsyncConfig; resume with the same setting"
            )
        self.version = int(state["version"])
        if delta is not None:
            self._delta = [clone_like(d) for d in delta]
        for version in list(self._stashes):
            self._drop(version)
        self._stashes = {int(v): [self._stash_copy(t) for t in ts]
                         for v, ts in state["stashes"].items()}  # fmt: skip
        self.version_at_forward = {int(k): int(v) for k, v in state["version_at_forward"].items()}
        self.delays = {int(k): int(v) for k, v in state["delays"].items()}
        self._pending = [int(mb) for mb in state["pending"]]
        self._batch_version = int(state.get("batch_version", self.version))
        self.last_delay = float(state.get("last_delay", 0.0))
