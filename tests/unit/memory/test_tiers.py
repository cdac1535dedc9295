"""Memory tiers: byte accounting, budgets, moves between tiers, and budget resolution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.config import ConfigError
from tidal.memory import tiers
from tidal.memory.tiers import Tier, TierBudgetError, TierKind, make_tiers, move, resolve_budget

CPU = torch.device("cpu")
GIB = 1024**3


def _device_tier(budget_bytes: int | None = None) -> Tier:
    return Tier(TierKind.DEVICE, CPU, budget_bytes=budget_bytes)


def _host_tier(budget_bytes: int | None = None) -> Tier:
    return Tier(TierKind.HOST, CPU, budget_bytes=budget_bytes)


# -- allocation accounting -----------------------------------------------------------------------


def test_allocate_counts_bytes_and_peak() -> None:
    tier = _device_tier()
    a = tier.allocate(100, torch.float32)
    b = tier.allocate(10, torch.bfloat16)
    assert a.shape == (100,) and a.dtype == torch.float32 and a.device == CPU
    assert tier.held_bytes == tier.peak_bytes == 420 and tier.num_allocations == 2
    tier.free(a)
    assert tier.held_bytes == 20 and tier.peak_bytes == 420 and tier.num_allocations == 1
    tier.reset_peak()
    assert tier.peak_bytes == 20
    tier.free(b)
    assert tier.held_bytes == 0 and tier.peak_bytes == 20
    assert tier.bytes_in == tier.bytes_out == 0  # allocations are not traffic


def test_stats_names_every_counter() -> None:
    tier = _host_tier(budget_bytes=1000)
    tier.allocate(25, torch.float64)
    assert tier.stats() == {
        "held_bytes": 200,
        "peak_bytes": 200,
        "non_model_bytes": 0,
        "in_bytes": 0,
        "out_bytes": 0,
        "num_allocations": 1,
        "budget_bytes": 1000,
        "free_bytes": 800,
    }
    assert _host_tier().free_bytes is None


def test_non_model_gauge_shares_the_budget() -> None:
    tier = _device_tier(budget_bytes=1000)
    tier.allocate(100, torch.float32)  # 400 bytes
    tier.set_non_model_bytes(500)
    assert (tier.held_bytes, tier.allocated_bytes, tier.peak_bytes) == (900, 400, 900)
    assert not tier.can_fit(101)
    with pytest.raises(TierBudgetError):
        tier.set_non_model_bytes(601)
    assert tier.non_model_bytes == 500  # refused: nothing changed
    tier.set_non_model_bytes(100)
    assert (tier.held_bytes, tier.peak_bytes) == (500, 900)


def test_zero_byte_allocations_are_tracked_apart() -> None:
    tier = _device_tier(budget_bytes=0)
    a = tier.allocate(0, torch.float32)
    b = tier.allocate(0, torch.float32)
    assert tier.num_allocations == 2 and tier.held_bytes == 0
    tier.free(a)
    with pytest.raises(AssertionError, match="already freed"):
        tier.free(a)
    tier.free(b)
    assert tier.num_allocations == 0


def test_budget_exactly_met_is_fine_one_more_byte_is_not() -> None:
    tier = _device_tier(budget_bytes=1024)
    first = tier.allocate(1000, torch.uint8)
    tier.allocate(24, torch.uint8)
    assert tier.held_bytes == 1024 and tier.free_bytes == 0 and tier.can_fit(0)
    assert not tier.can_fit(1)
    before = tier.stats()
    with pytest.raises(TierBudgetError) as info:
        tier.allocate(1, torch.uint8)
    message = str(info.value)
    assert "device tier" in message and "1 bytes" in message
    assert "1,024 bytes (1.00KiB)" in message  # held and budget, in bytes and human units
    assert tier.stats() == before
    tier.free(first)
    tier.allocate(250, torch.float32)  # room again after a free
    assert tier.held_bytes == 1024


def test_free_of_a_foreign_tensor_asserts() -> None:
    tier, other = _device_tier(), _device_tier()
    mine = tier.allocate(8, torch.float32)
    with pytest.raises(AssertionError, match="not allocated here"):
        tier.free(torch.empty(8))
    with pytest.raises(AssertionError, match="not allocated here"):
        tier.free(other.allocate(8, torch.float32))
    assert tier.held_bytes == 32 and other.held_bytes == 32
    tier.free(mine.view(2, 4))  # a view of an allocation is that allocation
    with pytest.raises(AssertionError, match="already freed"):
        tier.free(mine)
    assert tier.held_bytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_pin_memory_without_cuda_is_a_no_op() -> None:
    tier = Tier(TierKind.HOST, CPU, budget_bytes=None, pin_memory=True)
    assert not tier.pinned
    assert tier.allocate(4, torch.float32).device == CPU


def test_a_host_tier_lives_in_cpu_memory() -> None:
    with pytest.raises(ValueError, match="CPU memory"):
        Tier(TierKind.HOST, torch.device("cuda"), budget_bytes=None)


# -- moves ---------------------------------------------------------------------------------------


def test_move_counts_traffic_and_keeps_contents() -> None:
    device, host = _device_tier(), _host_tier()
    payload = device.allocate(64, torch.float32)
    payload.copy_(torch.arange(64, dtype=torch.float32))
    on_host = move(payload, device, host)
    assert host.holds(on_host) and not device.holds(payload)
    assert torch.equal(on_host, torch.arange(64, dtype=torch.float32))
    assert device.held_bytes == 0 and host.held_bytes == 256
    assert device.bytes_out == host.bytes_in == 256
    back = move(on_host, host, device)
    assert torch.equal(back, torch.arange(64, dtype=torch.float32))
    assert device.bytes_in == host.bytes_out == 256 and device.held_bytes == 256
    assert host.num_allocations == 0


def test_move_into_a_full_tier_raises_and_keeps_the_source() -> None:
    device, host = _device_tier(budget_bytes=255), _host_tier()
    payload = host.allocate(64, torch.float32)
    payload.fill_(7.0)
    device_before, host_before = device.stats(), host.stats()
    with pytest.raises(TierBudgetError, match="256 bytes"):
        move(payload, host, device)
    assert device.stats() == device_before and host.stats() == host_before
    assert host.holds(payload) and torch.all(payload == 7.0)


def test_move_of_a_foreign_tensor_asserts_before_allocating() -> None:
    device, host = _device_tier(), _host_tier()
    with pytest.raises(AssertionError, match="not allocated here"):
        move(torch.ones(4), host, device)
    assert device.num_allocations == 0


# -- budgets -------------------------------------------------------------------------------------


@pytest.fixture
def ram_64gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers, "_physical_ram_bytes", lambda: 64 * GIB)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (4096, 4096), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9)],
)
def test_resolve_budget_values(value: int | str | None, expected: int | None) -> None:
    assert resolve_budget(value, kind=TierKind.DEVICE, device=CPU) == expected


@pytest.mark.usefixtures("ram_64gib")
def test_auto_on_cpu_splits_ram_between_device_and_host() -> None:
    usable = 64 * GIB - int(6.4 * GIB)  # the reserve is 10% here, more than the 2 GiB floor
    device = resolve_budget("auto", kind=TierKind.DEVICE, device=CPU)
    host = resolve_budget("AUTO", kind=TierKind.HOST, device=CPU)
    assert device == host == usable // 2


def test_auto_host_reserve_has_a_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers, "_physical_ram_bytes", lambda: 8 * GIB)
    cuda = torch.device("cuda")
    assert resolve_budget("auto", kind=TierKind.HOST, device=cuda) == 6 * GIB
    monkeypatch.setattr(tiers, "_physical_ram_bytes", lambda: 2 * GIB)
    with pytest.raises(ConfigError, match="leaves nothing"):
        resolve_budget("auto", kind=TierKind.HOST, device=cuda, key="memory.host_budget")


def test_auto_on_cuda_uses_total_memory_minus_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        seen.append(device)
        return 3 * GIB, 80 * GIB  # (free, total): the budget is taken from the total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cuda = torch.device("cuda", 0)
    assert resolve_budget("auto", kind=TierKind.DEVICE, device=cuda) == 80 * GIB - 8 * GIB
    assert seen == [cuda]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (GIB, 4 * GIB))
    assert resolve_budget("auto", kind=TierKind.DEVICE, device=cuda) == 3 * GIB  # 1 GiB floor


@pytest.mark.parametrize("value", ["lots", "12 parsecs", "-5MiB", "0", "", 0, -1, True, 1.5])
def test_bad_budgets_name_the_key(value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_budget(value, kind=TierKind.HOST, device=CPU, key="memory.host_budget")
    assert info.value.key == "memory.host_budget"


def test_a_malformed_size_says_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"'512MiB'.*'auto', got 'lots'"):
        resolve_budget("lots", kind=TierKind.DEVICE, device=CPU)


@pytest.mark.usefixtures("ram_64gib")
def test_make_tiers_builds_the_pair() -> None:
    device, host = make_tiers(device=CPU, device_budget="1MiB", host_budget="auto")
    assert (device.kind, host.kind) == (TierKind.DEVICE, TierKind.HOST)
    assert device.budget_bytes == 2**20 and host.budget_bytes == (64 * GIB - int(6.4 * GIB)) // 2
    assert not host.pinned and host.device == CPU


def test_make_tiers_pins_the_host_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing is allocated here
    device, host = make_tiers(device=torch.device("cuda"), device_budget=None, host_budget=None)
    assert host.pinned and not device.pinned and device.device.type == "cuda"
    _, host = make_tiers(device=CPU, device_budget=None, host_budget=None)
    assert not host.pinned


# -- property: the budget and the books hold under any sequence of operations ---------------------

_DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 300), st.sampled_from(_DTYPES)),
        st.tuples(st.just("free"), st.integers(0, 1000), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(budget_bytes=st.one_of(st.none(), st.integers(0, 2000)), ops=_OPS)
def test_random_operations_keep_the_books(budget_bytes: int | None, ops: list) -> None:
    tier = _device_tier(budget_bytes)
    live: list[torch.Tensor] = []
    peak_bytes = 0
    for op, number, dtype in ops:
        if op == "allocate":
            num_bytes = number * dtype.itemsize
            fits = budget_bytes is None or tier.held_bytes + num_bytes <= budget_bytes
            try:
                live.append(tier.allocate(number, dtype))
                assert fits
            except TierBudgetError:
                assert not fits
        elif live:
            tier.free(live.pop(number % len(live)))
        held_bytes = sum(t.numel() * t.element_size() for t in live)
        peak_bytes = max(peak_bytes, held_bytes)
        assert tier.held_bytes == held_bytes and tier.num_allocations == len(live)
        assert tier.peak_bytes == peak_bytes
        assert budget_bytes is None or tier.held_bytes <= budget_bytes


# What a fresh process's host tier gives back when it frees chunk payloads: run in a process of
# its own, as a training run is (a test worker that has run hundreds of tests before has a
# malloc state of its own: there the payloads stayed resident once).
_GIVEN_BACK = """
import ctypes, ctypes.util, mmap, sys
import torch
from tidal.memory import tiers
from tidal.memory.tiers import Tier, TierKind

def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE

with tiers.mapped_on_its_own(4 << 20) as taken:
    pass
if not taken:  # not glibc: nothing to check
    print("not glibc")
    sys.exit(0)
# Where 4 MiB blocks would come from the heap (glibc's own threshold can be anywhere from
# 128 KiB to 32 MiB by now): only the tier's setting can give them mappings of their own.
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
assert libc.mallopt(tiers._M_MMAP_THRESHOLD, 32 << 20)
assert libc.mallopt(tiers._M_TRIM_THRESHOLD, 64 << 20)  # the heap keeps what it frees
tier = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
payloads = [tier.allocate(1 << 20, torch.float32) for _ in range(8)]  # 8 x 4 MiB
for payload in payloads:
    payload.fill_(1.0)  # touch every page
before = rss_bytes()
for payload in payloads:
    tier.free(payload)
del payloads, payload
print(before - rss_bytes())
"""


def test_chunk_payloads_are_mapped_on_their_own_and_given_back() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _GIVEN_BACK], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "not glibc":
        return
    # Each payload was its own mapping: freeing it gave its 4 MiB back to the system at once. On
    # the heap they would stay resident (32 MiB is below the trim threshold); the margin is for
    # whatever else the process allocates or frees meanwhile: half of them must come back; on
    # the heap none would.
    assert int(done.stdout) >= 16 << 20
