"""Measuring an iteration that ran short of the device budget.

[Note: the least budget]
What a run needs is known only once an iteration has run, so a budget that is too small is
found inside one, when nothing more can be evicted. Raising there would name what that moment
needs, not the iteration: a user who raised the budget to it would fail a few moments later,
a few hundred bytes further on. So the store *measures* instead: at the first shortfall of an
iteration it notes where it happened, lifts the device tier's budget, and lets the iteration
finish; at its end (after the backward, before any optimizer step) it evicts back under the
budget, restores it and raises :class:`DeviceBudgetTooSmall` with the least budget the whole
iteration needs, ``AccessTrace.min_device_bytes`` of the trace just recorded (on a GPU the
lifted budget stops at what ``"auto"`` would give: past that a shortfall raises where it
happens, with what that moment needs). A budget of
that figure runs the iteration: the runtime never keeps on the device more than the chunks a
moment holds plus the non-model bytes ([Note: placement] in policy.py), and release moments
charge every non-model byte to a moment holding only what must be held then. The store keeps
the largest such figure over every iteration it has seen (:attr:`ChunkStore.least_budget_bytes`):
after a long sequence and a short one it is the long one's. Outside an iteration (pinning, a
step's buffers) a shortfall raises at once. Under ZeRO-3 the ranks agree whether any of them
ran short ([Note: ranks decide alike] in tidal/sharding/store.py), and all raise: one rank
stepping while another raised would wait for it for ever.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.config import format_bytes
from tidal.memory.chunk import Chunk
from tidal.memory.tiers import Tier, TierKind, resolve_budget
from tidal.memory.trace import AccessTrace

__all__ = [
    "DeviceBudgetTooSmall",
    "Shortfall",
    "another_rank_short",
    "chunk_size_advice",
    "moment_too_small",
]


class DeviceBudgetTooSmall(ValueError):
    """The device budget cannot hold what a moment or an iteration needs; ``moment_label``
    says where."""

    def __init__(self, moment_label: str, message: str) -> None:
        super().__init__(message)
        self.moment_label = moment_label


def chunk_size_advice(chunks: Sequence[Chunk]) -> str:
    """The end of a budget error about ``chunk.size``: to what lowering it would help, or
    nothing where it cannot (every chunk holds one parameter already, or is one's own)."""
    regular = [c.spec for c in chunks if not c.spec.is_oversize]
    if all(len(spec.slots) <= 1 for spec in regular):
        return ""
    size = max(spec.capacity for spec in regular)
    numel, name = max((info.numel, info.names[0]) for spec in regular for info in spec.slots)
    return (
        f", or lower chunk.size from {size:,} elements toward {numel:,} (the largest parameter "
        f"in a shared chunk, '{name}'): a moment holds whole chunks, and at that size a chunk "
        f"holds about one parameter"
    )


def moment_too_small(
    label: str,
    tier: Tier,
    *,
    chunks: Sequence[Chunk],
    needed: frozenset[int],
    stuck: Sequence[Chunk],
    non_model_bytes: int | None,
) -> DeviceBudgetTooSmall:
    """What a moment cannot fit, by kind: the ``needed`` chunks, those enclosing modules hold
    or pinned (``stuck``), optimizer state and the like, and the non-model bytes (the tier's
    gauge unless given)."""
    budget_bytes = tier.budget_bytes or 0
    need_bytes = sum(chunks[i].num_bytes for i in needed)
    stuck_bytes = sum(c.num_bytes for c in stuck)
    other_bytes = tier.allocated_bytes - sum(c.num_bytes for c in chunks if c.on_device)
    live_bytes = tier.non_model_bytes if non_model_bytes is None else non_model_bytes
    total_bytes = need_bytes + stuck_bytes + other_bytes + live_bytes
    return DeviceBudgetTooSmall(
        label,
        f"memory.device_budget: {budget_bytes:,} bytes ({format_bytes(budget_bytes)}) is too "
        f"small: during or just after {label} the device must hold at least {total_bytes:,} "
        f"bytes ({format_bytes(total_bytes)}): {need_bytes:,} of parameter chunks this moment "
        f"needs, {stuck_bytes:,} of chunks in use by enclosing modules or pinned, "
        f"{other_bytes:,} of optimizer state and {live_bytes:,} of activations. Raise the "
        f"budget above that (a step on a larger budget reports the exact minimum as "
        f"min_device_bytes), or lower training.batch_size (activations)"
        f"{chunk_size_advice(chunks)}",
    )


class Shortfall:
    """The device tier's budget while an iteration that ran short is measured: lifted at the
    first shortfall, restored at the end; see [Note: the least budget]."""

    def __init__(self, tier: Tier, *, advice: str = "") -> None:
        assert tier.kind is TierKind.DEVICE, tier
        self.tier = tier
        self.advice = advice  # chunk_size_advice of the store's chunks
        self._first: DeviceBudgetTooSmall | None = None
        self._budget_bytes: int | None = None  # the budget that was lifted

    @property
    def measuring(self) -> bool:
        return self._first is not None

    def begin(self, error: DeviceBudgetTooSmall) -> None:
        """A shortfall inside an iteration: lift the budget to measure the rest of it, or
        raise ``error`` where the budget cannot go higher (the GPU's own memory)."""
        ceiling = _ceiling_bytes(self.tier)
        assert self.tier.budget_bytes is not None
        if ceiling is not None and self.tier.budget_bytes >= ceiling:
            raise error  # the iteration is abandoned, which restores a lifted budget
        if self._first is None:
            self._first, self._budget_bytes = error, self.tier.budget_bytes
        self.tier.budget_bytes = ceiling

    def fits(self) -> bool:
        """Whether what the tier holds now fits the budget that was lifted."""
        assert self._budget_bytes is not None
        return self.tier.held_bytes <= self._budget_bytes

    def end(self, recorded: AccessTrace | None) -> DeviceBudgetTooSmall:
        """Restore the budget (the caller made room first); the error to raise, naming the
        least budget ``recorded`` needs (None: the iteration was abandoned)."""
        assert self._first is not None and self._budget_bytes is not None
        first, budget_bytes = self._first, self._budget_bytes
        self._first = self._budget_bytes = None
        self.tier.budget_bytes = budget_bytes
        if recorded is None or not recorded.moments:
            return first
        need_bytes = recorded.min_device_bytes()
        worst = max(recorded.moments, key=lambda m: recorded.moment_device_bytes(m.index))
        return DeviceBudgetTooSmall(
            worst.label,
            f"memory.device_budget: {budget_bytes:,} bytes ({format_bytes(budget_bytes)}) is "
            f"too small: this iteration needs at least {need_bytes:,} bytes "
            f"({format_bytes(need_bytes)}) on the device, at {worst.label} "
            f"({recorded.bytes_of(worst.chunks):,} of parameter chunks held then and "
            f"{worst.non_model_bytes:,} of activations and other non-model data). It first ran "
            f"short at {first.moment_label}; it was finished over the budget to measure this, "
            f"and the optimizer has not stepped on it. Raise the budget to at least "
            f"{need_bytes:,} (inputs of other shapes may need more), or lower "
            f"training.batch_size (activations){self.advice}",
        )


def another_rank_short(recorded: AccessTrace, tier: Tier, advice: str) -> DeviceBudgetTooSmall:
    """What a rank that fit raises when another ran short: the least budget of ``recorded``,
    the iteration with every rank's non-model figures (see [Note: the least budget])."""
    need_bytes = recorded.min_device_bytes()
    budget_bytes = tier.budget_bytes or 0
    worst = max(recorded.moments, key=lambda m: recorded.moment_device_bytes(m.index))
    return DeviceBudgetTooSmall(
        worst.label,
        f"memory.device_budget: {budget_bytes:,} bytes ({format_bytes(budget_bytes)}) is too "
        f"small on another rank: with the largest activations of any rank this iteration needs "
        f"at least {need_bytes:,} bytes ({format_bytes(need_bytes)}) on the device, at "
        f"{worst.label}, and every rank must place chunks alike under ZeRO-3. The optimizer has "
        f"not stepped on it. Raise the budget to at least {need_bytes:,}, or lower "
        f"training.batch_size (activations){advice}",
    )


def _ceiling_bytes(tier: Tier) -> int | None:
    """How far a measured iteration may go over the budget: on a CPU the device tier is an
    accounting, so without limit; on a GPU up to what ``"auto"`` gives (its memory less the
    reserve), so measuring never takes memory the GPU lacks."""
    if tier.device.type == "cpu":
        return None
    return resolve_budget("auto", kind=TierKind.DEVICE, device=tier.device)
