"""Which chunk indices stay on the device for good, with their optimizer state.

[Note: optimizer placement]
A chunk index whose parameter, gradient, optimizer-state (and master) chunks all stay on the
device never moves: its update runs there and costs no traffic. Pinning is not free, though:
the pinned bytes (with AdamW, the parameter chunk included: four times the parameter chunk in
fp32, nine in bf16, seven with gradients in the parameter chunks; fewer with SGD) leave less
room for the chunks that stream, which may then be fetched more often. So pinned indices P are
chosen once, from the first iteration's trace, greedily in order of how often the trace uses
a chunk, and an index joins P only if

  1. it fits: bytes(gradients, moments, masters of P) + max over moments m of
     (bytes(P + chunks of m) + non-model bytes of m) <= device budget, and with gradients in
     the parameter chunks (no gradient chunks) the step's transient fp32 buffer of one chunk
     fits beside P's chunks: bytes(P) + its state + the buffer <= device budget, and
  2. it pays: the per-step traffic of the other chunks, replayed by policy.simulate (Belady,
     starting from an empty device as after each step), does not grow. Every chunk fetched in
     a step goes back to the host before the next one, so traffic is twice the fetched bytes.

An unlimited budget pins everything: the engine then moves nothing, like plain PyTorch. When a
later iteration needs more room than the choice left (a longer sequence's activations), the
store gives up every pinned chunk rather than fail (their state goes to the host), and the
next step chooses again from that iteration's trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tidal.memory.policy import simulate
from tidal.memory.trace import AccessTrace, Moment

if TYPE_CHECKING:
    from tidal.memory.optim import ChunkOptimizer
    from tidal.memory.store import ChunkStore

__all__ = ["choose_pinned", "pinned_indices"]


def choose_pinned(
    store: ChunkStore, optimizer: ChunkOptimizer, budget_bytes: int | None
) -> frozenset[int] | None:
    """The chunk indices to keep on the device for good; None before there is a trace."""
    num_chunks = len(store.chunks)
    if budget_bytes is None:
        return frozenset(range(num_chunks))
    if store.trace is None:
        return None
    return pinned_indices(
        store.trace,
        state_bytes=[optimizer.state_bytes_of(i) for i in range(num_chunks)],
        step_buffer_bytes=optimizer.step_buffer_bytes,
        budget_bytes=budget_bytes,
    )


def pinned_indices(
    trace: AccessTrace,
    *,
    state_bytes: Sequence[int],
    step_buffer_bytes: Callable[[frozenset[int]], int],
    budget_bytes: int,
) -> frozenset[int]:
    """The pure choice of [Note: optimizer placement] from figures: ``state_bytes[i]`` is what
    chunk index ``i`` brings besides its parameter chunk, ``step_buffer_bytes(P)`` the step's
    transient buffer beside the pinned set ``P``."""
    pinned: frozenset[int] = frozenset()
    cost = _streaming_bytes(trace, pinned, budget_bytes)
    for index in sorted(range(trace.num_chunks), key=lambda i: (-len(trace.uses(i)), i)):
        candidate = pinned | {index}
        room = budget_bytes - sum(state_bytes[i] for i in candidate)
        peak = max(trace.bytes_of(candidate | m.chunks) + m.non_model_bytes for m in trace.moments)
        at_step = trace.bytes_of(candidate) + step_buffer_bytes(candidate)
        if max(peak, at_step) > room:
            continue
        candidate_cost = _streaming_bytes(trace, candidate, room)
        if candidate_cost <= cost:
            pinned, cost = candidate, candidate_cost
    return pinned


def _streaming_bytes(trace: AccessTrace, pinned: frozenset[int], room_bytes: int) -> int:
    """Bytes moved per step by the chunks outside ``pinned`` (see [Note: optimizer placement])."""
    streamed = AccessTrace(
        moments=tuple(
            Moment(index=m.index, chunks=m.chunks - pinned, non_model_bytes=m.non_model_bytes,
                   label=m.label)
            for m in trace.moments
        ),
        chunk_bytes=trace.chunk_bytes,
    )  # fmt: skip
    budget = room_bytes - trace.bytes_of(pinned)
    result = simulate(streamed, device_budget_bytes=budget, policy="belady", prefetch_depth=0,
                      iterations=1)  # fmt: skip
    return 2 * result.total_fetched_bytes
