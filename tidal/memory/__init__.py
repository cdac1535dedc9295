"""Chunked model data across memory tiers: tiers and budgets, chunks, layouts, placement.

Everything here is either a pure function over plain values (layout, trace, policy) or a small
runtime object whose every byte is accounted (tiers, chunks), so the whole layer is tested on a
CPU: the "device" tier of a machine without a GPU is a CPU pool whose budget is enforced.
"""

from tidal.memory.chunk import Chunk, ChunkKind, ChunkState, TensorState
from tidal.memory.layout import (
    ChunkLayout,
    ChunkSizeChoice,
    ChunkSpec,
    ParamRef,
    TensorSlot,
    default_chunk_size,
    plan_layout,
    search_chunk_size,
    unique_parameters,
)
from tidal.memory.policy import (
    Move,
    SimulationResult,
    optimal_traffic,
    plan_moment,
    simulate,
    static_offload_traffic,
    traffic_lower_bound,
)
from tidal.memory.tiers import (
    Tier,
    TierBudgetError,
    TierKind,
    make_tiers,
    move,
    resolve_budget,
)
from tidal.memory.trace import AccessTrace, Moment, TraceRecorder

__all__ = [
    "AccessTrace",
    "Chunk",
    "ChunkKind",
    "ChunkLayout",
    "ChunkSizeChoice",
    "ChunkSpec",
    "ChunkState",
    "Moment",
    "Move",
    "ParamRef",
    "SimulationResult",
    "TensorSlot",
    "TensorState",
    "Tier",
    "TierBudgetError",
    "TierKind",
    "TraceRecorder",
    "default_chunk_size",
    "make_tiers",
    "move",
    "optimal_traffic",
    "plan_layout",
    "plan_moment",
    "resolve_budget",
    "search_chunk_size",
    "simulate",
    "static_offload_traffic",
    "traffic_lower_bound",
    "unique_parameters",
]
