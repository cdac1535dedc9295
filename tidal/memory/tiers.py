"""Memory tiers: the device and the host, each with a byte budget and exact accounting.

A :class:`Tier` hands out flat 1-D tensors (chunk payloads) and counts every byte it holds and
every byte that crossed into or out of it; :func:`move` copies between tiers and keeps both sets
of books. Without a GPU the "device" tier is a CPU memory pool whose budget only this accounting
enforces, so budgets, traffic and the largest model that fits can be tested on any machine.

[Note: tier accounting]
Earlier systems kept add/subtract counters beside the allocator, and they drifted. A tier keeps
a table of its live allocations (storage -> bytes asked for) and, after every change, asserts

    0 <= held_bytes <= budget_bytes (when set)    and    held_bytes == sum of the table

so a bookkeeping bug fails at the change that caused it, not steps later as an out-of-memory.
``held_bytes`` is a running total only so reads are O(1); the check is O(live allocations),
which stays small because tiers hold chunks (``python -O`` drops it). The table keeps a reference
to each live storage: the memory stays allocated until :meth:`Tier.free`, exactly as
``held_bytes`` says, whatever the garbage collector does, and an allocation is recognised by
storage identity, which also tells 0-byte allocations apart (they all have ``data_ptr() == 0``).
``bytes_in`` and ``bytes_out`` count only moves between tiers, not allocations and frees: they
are the traffic a placement policy tries to keep low.

A device tier also carries a gauge of *non-model* bytes (activations saved for backward; see
[Note: non-model memory] in activations.py): memory the tier did not allocate and cannot refuse,
but which shares the budget. It is part of ``held_bytes`` and of the peak, so "the device never
held more than its budget" covers activations too; whoever sets it must first make room.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from tidal.config import ConfigError, format_bytes, parse_bytes

__all__ = [
    "Tier",
    "TierBudgetError",
    "TierKind",
    "host_budget_named",
    "make_tiers",
    "move",
    "resolve_budget",
]

_GIB = 1024**3


class TierKind(enum.Enum):
    DEVICE = "device"
    HOST = "host"


def _bytes_text(num_bytes: int) -> str:
    return f"{num_bytes:,} bytes ({format_bytes(num_bytes)})"


class TierBudgetError(RuntimeError):
    """An allocation would take a tier over its budget; nothing was allocated."""

    def __init__(
        self, *, kind: TierKind, asked_bytes: int, held_bytes: int, budget_bytes: int
    ) -> None:
        self.kind = kind
        self.asked_bytes = asked_bytes
        self.held_bytes = held_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"{kind.value} tier over budget: asked for {_bytes_text(asked_bytes)} while holding "
            f"{_bytes_text(held_bytes)} of a budget of {_bytes_text(budget_bytes)}"
        )


@contextlib.contextmanager
def host_budget_named(need_bytes: int | None) -> Iterator[None]:
    """The host tier over its budget as the user's error, one line: ``need_bytes`` (all the model
    data the host may have to hold) is a budget that trains, ``memory.nvme_dir`` the other way.
    None: a disk tier planned the host's room, and its error is the one to see."""
    try:
        yield
    except TierBudgetError as err:
        if err.kind is not TierKind.HOST or need_bytes is None:
            raise
        raise ConfigError(
            "memory.host_budget",
            f"{_bytes_text(err.budget_bytes)} is too small: the host needed "
            f"{_bytes_text(err.held_bytes + err.asked_bytes)} here. Raise it to at least "
            f"{need_bytes:,} bytes ({format_bytes(need_bytes)}: the parameters, gradients, "
            f"master weights and optimizer state of the whole model, all the host may have to "
            f"hold), or set memory.nvme_dir to a folder on a fast disk to keep there what does "
            f"not fit",
        ) from None


class _Allocation(NamedTuple):
    storage: torch.UntypedStorage
    num_bytes: int


class Tier:
    """One memory tier: allocations, a budget, and counters (see [Note: tier accounting]).

    ``pin_memory`` asks for page-locked host memory, which lets copies to and from a GPU run
    asynchronously; it applies only to a tier in CPU memory and only when CUDA is available, and
    is silently ignored otherwise (``pinned`` says what the tier actually does).
    """

    def __init__(
        self,
        kind: TierKind,
        device: torch.device,
        *,
        budget_bytes: int | None,
        pin_memory: bool = False,
        non_model_cap_bytes: int | None = None,
    ) -> None:
        device = torch.device(device)
        if kind is TierKind.HOST and device.type != "cpu":
            raise ValueError(f"a host tier lives in CPU memory, got device {device}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.kind = kind
        self.device = device
        self.budget_bytes = budget_bytes
        # the most non-model bytes the budget sets aside: above it they go over the budget and
        # leave the chunks' room alone ([Note: non-model memory] in activations.py); None: all
        self.non_model_cap_bytes = non_model_cap_bytes
        self.pinned = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self._live: dict[int, _Allocation] = {}  # id(storage) -> allocation
        self._held_bytes = 0
        self._non_model_bytes = 0
        self._peak_bytes = 0
        self._bytes_in = 0
        self._bytes_out = 0

    def __repr__(self) -> str:
        budget = "unlimited" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"Tier({self.kind.value} on {self.device}, holds {format_bytes(self._held_bytes)} "
            f"of {budget} in {self.num_allocations} allocations)"
        )

    # -- counters ------------------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    @property
    def non_model_bytes(self) -> int:
        return self._non_model_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the tier's own allocations (``held_bytes`` less the non-model gauge)."""
        return self._held_bytes - self._non_model_bytes

    @property
    def bytes_in(self) -> int:
        return self._bytes_in

    @property
    def bytes_out(self) -> int:
        return self._bytes_out

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    @property
    def free_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self._held_bytes

    def can_fit(self, num_bytes: int) -> bool:
        assert num_bytes >= 0, num_bytes
        return self.budget_bytes is None or self._held_bytes + num_bytes <= self.budget_bytes

    def reset_peak(self) -> None:
        self._peak_bytes = self._held_bytes

    def stats(self) -> dict[str, int | None]:
        return {
            "held_bytes": self._held_bytes,
            "peak_bytes": self._peak_bytes,
            "non_model_bytes": self._non_model_bytes,
            "in_bytes": self._bytes_in,
            "out_bytes": self._bytes_out,
            "num_allocations": self.num_allocations,
            "budget_bytes": self.budget_bytes,
            "free_bytes": self.free_bytes,
        }

    # -- allocations ---------------------------------------------------------------------------

    def allocate(self, numel: int, dtype: torch.dtype, *, own_mapping: bool = True) -> torch.Tensor:
        """A new uninitialised 1-D tensor; TierBudgetError (and no allocation) if over budget."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        num_bytes = numel * dtype.itemsize
        self._admit(num_bytes)
        with self._own_mapping(num_bytes if own_mapping else 0):
            tensor = torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)
        self._track(tensor.untyped_storage(), num_bytes)
        return tensor

    def _own_mapping(self, num_bytes: int) -> contextlib.AbstractContextManager[bool]:
        if self.device.type == "cpu" and not self.pinned:
            return mapped_on_its_own(num_bytes)
        return contextlib.nullcontext(False)

    def _admit(self, num_bytes: int) -> None:
        """Raise TierBudgetError, before anything changes, if ``num_bytes`` more would not fit."""
        if not self.can_fit(num_bytes):
            assert self.budget_bytes is not None
            raise TierBudgetError(
                kind=self.kind,
                asked_bytes=num_bytes,
                held_bytes=self._held_bytes,
                budget_bytes=self.budget_bytes,
            )

    def _track(self, storage: torch.UntypedStorage, num_bytes: int) -> None:
        self._live[id(storage)] = _Allocation(storage, num_bytes)
        self._held_bytes += num_bytes
        self._peak_bytes = max(self._peak_bytes, self._held_bytes)
        self._check_invariant()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or a view of it) is a live allocation of this tier."""
        storage = tensor.untyped_storage()
        entry = self._live.get(id(storage))
        return entry is not None and entry.storage is storage

    def allocation_bytes(self, tensor: torch.Tensor) -> int:
        """The bytes accounted for ``tensor``'s allocation; asserts this tier made it."""
        assert self.holds(tensor), f"{self!r}: tensor was not allocated here, or already freed"
        return self._live[id(tensor.untyped_storage())].num_bytes

    def free(self, tensor: torch.Tensor) -> None:
        """Give back an allocation of this tier; its memory goes once the caller drops it."""
        num_bytes = self.allocation_bytes(tensor)
        del self._live[id(tensor.untyped_storage())]
        self._held_bytes -= num_bytes
        self._check_invariant()

    def set_non_model_bytes(self, num_bytes: int) -> None:
        """Set the non-model gauge; TierBudgetError (and no change) if it would not fit."""
        assert num_bytes >= 0, num_bytes
        growth_bytes = num_bytes - self._non_model_bytes
        if growth_bytes > 0:
            self._admit(growth_bytes)
        self._held_bytes += growth_bytes
        self._non_model_bytes = num_bytes
        self._peak_bytes = max(self._peak_bytes, self._held_bytes)
        self._check_invariant(table_changed=False)

    def record_move(self, *, in_bytes: int = 0, out_bytes: int = 0) -> None:
        """Count bytes that crossed into or out of this tier (see [Note: tier accounting])."""
        assert in_bytes >= 0 and out_bytes >= 0, (in_bytes, out_bytes)
        self._bytes_in += in_bytes
        self._bytes_out += out_bytes

    # -- persistent buffers ---------------------------------------------------------------------
    # [Note: persistent buffers]
    # Parameters are views into a chunk's device buffer, and autograd keeps saved references to
    # them across a whole forward and backward. If eviction freed that buffer and a fetch made a
    # new one, every view and saved tensor would point at dead memory. So a device buffer is one
    # tensor object for the chunk's whole life: eviction resizes its storage to 0 bytes (a use
    # while evicted raises instead of reading garbage) and a fetch resizes it back. The tier
    # accounts the bytes while the storage is grown, exactly like an allocation.

    def regrow(self, tensor: torch.Tensor, *, own_mapping: bool = True) -> None:
        """Give a 0-byte buffer its storage back; TierBudgetError (and no change) if over budget."""
        storage = tensor.untyped_storage()
        assert storage.nbytes() == 0 and not self.holds(tensor), "regrow of a live buffer"
        num_bytes = tensor.numel() * tensor.element_size()
        self._admit(num_bytes)
        with self._own_mapping(num_bytes if own_mapping else 0):
            storage.resize_(num_bytes)
        self._track(storage, num_bytes)

    def release_storage(self, tensor: torch.Tensor) -> None:
        """Free a grown buffer's bytes but keep the tensor object (and its views) for regrow."""
        self.free(tensor)
        tensor.untyped_storage().resize_(0)

    def _check_invariant(self, *, table_changed: bool = True) -> None:
        """See [Note: tier accounting]. The table is summed only when it changed: the non-model
        gauge moves with every tensor autograd saves, far more often than allocations do."""
        assert self._held_bytes >= 0, self
        assert self.budget_bytes is None or self._held_bytes <= self.budget_bytes, self
        assert not table_changed or self._held_bytes == self._non_model_bytes + sum(
            a.num_bytes for a in self._live.values()
        ), self


def _copy_can_overlap(source: torch.Tensor, target: torch.Tensor) -> bool:
    # Only a copy between a GPU and pinned host memory is truly asynchronous; a non_blocking copy
    # into pageable host memory may be read before it lands.
    if {source.device.type, target.device.type} != {"cpu", "cuda"}:
        return False
    host = source if source.device.type == "cpu" else target
    return host.is_pinned()


def move(tensor: torch.Tensor, src: Tier, dst: Tier, *, non_blocking: bool = False) -> torch.Tensor:
    """Move an allocation of ``src`` to ``dst`` and count the bytes on both; returns the copy.

    A TierBudgetError from ``dst`` leaves both tiers and ``tensor`` as they were. The copy is
    synchronous unless ``non_blocking`` and one side is pinned host memory with the other on
    CUDA; then it is ordered on the current stream, and the host must synchronise before reading
    a copy that landed in host memory. Freeing the source right away is safe in both directions:
    the CUDA caching allocator reuses a block only after work already queued on its stream, and
    the pinned-memory allocator holds a block until the copies that used it have finished.
    """
    assert src is not dst, f"move within one tier: {src!r}"
    num_bytes = src.allocation_bytes(tensor)
    assert tensor.numel() * tensor.element_size() == num_bytes, "move takes whole allocations"
    moved = dst.allocate(tensor.numel(), tensor.dtype).view(tensor.shape)
    try:
        moved.copy_(tensor, non_blocking=non_blocking and _copy_can_overlap(tensor, moved))
    except BaseException:
        dst.free(moved)
        raise
    src.free(tensor)
    src.record_move(out_bytes=num_bytes)
    dst.record_move(in_bytes=num_bytes)
    return moved


# ---------------------------------------------------------------------------------------------
# budgets

# What "auto" leaves unbudgeted, as max(floor, fraction of the total). On a GPU the reserve holds
# what is not model data yet shares the memory: the CUDA context and library workspaces (outside
# the allocator, hundreds of MiB), the caching allocator's fragmentation, and activations and
# temporaries. On the host it holds the OS, the page cache, this process and data loaders. The
# fraction scales with big machines, the floor protects small ones. It is a starting point, not
# a tuned ratio: write an explicit size to override it.
_RESERVE_FRACTION = 0.10
_CUDA_RESERVE_FLOOR_BYTES = 1 * _GIB
_HOST_RESERVE_FLOOR_BYTES = 2 * _GIB


def _physical_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _auto_budget_bytes(*, kind: TierKind, device: torch.device, key: str) -> int:
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(key, f"'auto' is not supported for device {device}; write a size")
    on_gpu = device.type == "cuda" and kind is TierKind.DEVICE
    what = str(device) if on_gpu else "host RAM"
    total_bytes = torch.cuda.mem_get_info(device)[1] if on_gpu else _physical_ram_bytes()
    floor_bytes = _CUDA_RESERVE_FLOOR_BYTES if on_gpu else _HOST_RESERVE_FLOOR_BYTES
    reserve_bytes = max(floor_bytes, int(total_bytes * _RESERVE_FRACTION))
    usable_bytes = total_bytes - reserve_bytes
    if usable_bytes <= 0:
        raise ConfigError(
            key,
            f"'auto' leaves nothing: {what} has {_bytes_text(total_bytes)} and the reserve is "
            f"{_bytes_text(reserve_bytes)}; write an explicit size",
        )
    # Training on a CPU, the device tier is a pool in the host's RAM: the tiers split it.
    return usable_bytes if device.type == "cuda" else usable_bytes // 2


def resolve_budget(
    value: int | str | None, *, kind: TierKind, device: torch.device, key: str = ""
) -> int | None:
    """A tier's budget in bytes from a config value; ``None`` means unlimited.

    ``value`` is ``None``, a positive number of bytes, a size such as ``"512MiB"``, or ``"auto"``.
    ``device`` is the training device, for both kinds. ``"auto"`` is what the hardware has minus
    a reserve of ``max(floor, 10%)`` (see the comment above ``_RESERVE_FRACTION``):

    - the device tier on CUDA: the GPU's total memory minus ``max(1 GiB, 10%)``;
    - the host tier: physical RAM minus ``max(2 GiB, 10%)``;
    - training on a CPU, the device tier is a pool in the same RAM as the host tier, so each
      tier's ``"auto"`` is half of what is left after the reserve.
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return _auto_budget_bytes(kind=kind, device=torch.device(device), key=key)
    wrong = ConfigError(
        key,
        f"expected a number of bytes, a size such as '512MiB' or '2GB' (units: B, KB, MB, GB, "
        f"TB, KiB, MiB, GiB, TiB), or 'auto', got {value!r}",
    )
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise wrong
    try:
        num_bytes = parse_bytes(value, key=key)
    except ConfigError:
        raise wrong from None
    if num_bytes <= 0:
        raise ConfigError(key, f"a budget must be > 0 bytes, got {value!r}")
    return num_bytes


# [Note: host memory returned on free]
# On a CPU both tiers come from the same malloc. glibc serves a large request from its heap once a
# block of that size has been freed (the mmap threshold adapts upwards, to 32 MiB), and freed heap
# blocks stay in the process: every chunk that moved between the tiers then leaves a hole, and
# the process's peak resident memory grows to about twice the model data (measured on gpt2-small:
# 3.95 GiB against 2.74 GiB for plain PyTorch). So a CPU tier makes each payload of at least
# 64 KiB its own mapping, returned to the system when freed: it lowers glibc's mmap threshold to
# the payload's size for that one allocation and then sets it to 4 MiB, and the trim threshold to
# 64 MiB (setting either at all ends glibc's adaptation). Activations of 4 MiB and more then get
# mappings of their own too, returned when freed: with the mmap threshold at glibc's 32 MiB
# ceiling the heap kept gpt2-small's (seq 1024) freed activations resident, peak RSS 3.56 GiB
# against 3.19 GiB for plain PyTorch; at 4 MiB 3.30 GiB. The trim threshold trades the other way:
# at 8 MiB the peak was 3.17 GiB, but the heap top went back to the system after every
# micro-batch and was faulted in again, and the demo's step took 1.23x plain PyTorch's instead
# of 1.02x (bench offload, 3 rounds each). Everything else,
# activations above all, keeps coming from the heap and reusing its pages, without a page fault
# per allocation. Only where glibc is present; with CUDA the host tier is pinned memory from
# torch's caching host allocator, which does not go through malloc. A payload that comes and goes
# every step at the same size (a gradient chunk) asks for ``own_mapping=False``: the heap block
# freed at one step is reused at the next, while a fresh mapping would cost a page fault per
# page each step (about 20 ms of the demo's 0.35 s step).
_MIN_MAPPED_BYTES = 64 << 10
_RESET_THRESHOLD_BYTES = 4 << 20
_MAX_THRESHOLD_BYTES = 32 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
_M_TRIM_THRESHOLD = -1


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None


@contextlib.contextmanager
def mapped_on_its_own(num_bytes: int) -> Iterator[bool]:
    """Allocations of ``num_bytes`` made inside get a mapping of their own (see [Note: host
    memory returned on free]); yields whether the allocator took the setting."""
    mallopt = _mallopt()
    if mallopt is None or num_bytes < _MIN_MAPPED_BYTES:
        yield False
        return
    taken = bool(mallopt(_M_MMAP_THRESHOLD, min(num_bytes, _MAX_THRESHOLD_BYTES)))
    try:
        yield taken
    finally:
        if taken:
            mallopt(_M_MMAP_THRESHOLD, _RESET_THRESHOLD_BYTES)
            mallopt(_M_TRIM_THRESHOLD, 2 * _MAX_THRESHOLD_BYTES)


def make_tiers(
    *,
    device: torch.device,
    device_budget: int | str | None,
    host_budget: int | str | None,
    non_model_budget: int | None = None,
) -> tuple[Tier, Tier]:
    """The (device tier, host tier) pair for training on ``device``; budgets as resolve_budget,
    ``non_model_budget`` the device budget's share set aside for non-model bytes at most.

    The host tier is pinned when the device is CUDA, so moves between the two can overlap.
    """
    device = torch.device(device)
    device_bytes = resolve_budget(
        device_budget, kind=TierKind.DEVICE, device=device, key="memory.device_budget"
    )
    host_bytes = resolve_budget(
        host_budget, kind=TierKind.HOST, device=device, key="memory.host_budget"
    )
    pinned = device.type == "cuda"
    return (
        Tier(
            TierKind.DEVICE, device, budget_bytes=device_bytes, non_model_cap_bytes=non_model_budget
        ),  # fmt: skip
        Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=host_bytes, pin_memory=pinned),
    )
