"""The access trace: which chunks each moment of an iteration needs, and how much else it holds.

A *moment* is one point of an iteration at which a known set of chunks must be on the device: just
before a module's forward or backward runs, or the optimizer step. The first iteration is recorded
(:class:`TraceRecorder`) and later iterations are planned from the record
(:mod:`tidal.memory.policy`), which needs the order of moments, their chunk sets and the non-model
bytes (activations, workspaces) each moment holds on the device.

[Note: trace validity]
A trace describes one access sequence, and a plan made from it is only right while later
iterations repeat that sequence. PatrickStar and Gemini assume they do and nothing checks it:
control flow, a skipped module (an MoE expert with no tokens) or a changed batch size leave them
evicting by next-use keys from a sequence that no longer happens, silently. Here a trace has a
:meth:`AccessTrace.signature` over labels and chunk sets only (byte figures drift with the
allocator and are not part of the sequence), and the runtime keeps a :class:`TraceRecorder`
running in every iteration: after each ``record`` it asks ``matches(stored)``; on the first
``False`` it must stop planning from the stored trace for the rest of the iteration (fall back to
on-demand moves) and plan from the newly finished trace afterwards. ``matches(stored,
complete=True)`` at the end of an iteration also catches a sequence that stopped early. A trace is
never used for a sequence it was not recorded from.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = ["AccessTrace", "Moment", "TraceRecorder"]

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Moment:
    index: int
    chunks: frozenset[int]
    non_model_bytes: int
    label: str

    def __post_init__(self) -> None:
        # Callers pass sets and lists; the stored field is always a frozenset so moments hash.
        object.__setattr__(self, "chunks", frozenset(self.chunks))
        if self.index < 0:
            raise ValueError(f"moment index must be >= 0, got {self.index}")
        if self.non_model_bytes < 0:
            raise ValueError(f"moment {self.label!r}: non_model_bytes must be >= 0")
        if any(chunk < 0 for chunk in self.chunks):
            raise ValueError(f"moment {self.label!r}: chunk ids must be >= 0, got {self.chunks}")


@dataclass(frozen=True)
class AccessTrace:
    moments: tuple[Moment, ...]
    chunk_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "moments", tuple(self.moments))
        object.__setattr__(self, "chunk_bytes", tuple(self.chunk_bytes))
        if any(size < 0 for size in self.chunk_bytes):
            raise ValueError(f"chunk bytes must be >= 0, got {self.chunk_bytes}")
        for position, moment in enumerate(self.moments):
            if moment.index != position:
                raise ValueError(
                    f"moment {moment.label!r} has index {moment.index}, expected {position}"
                )
            unknown = sorted(c for c in moment.chunks if c >= len(self.chunk_bytes))
            if unknown:
                raise ValueError(
                    f"moment {moment.label!r} uses chunks {unknown}, but the trace has "
                    f"{len(self.chunk_bytes)} chunks"
                )

    def __len__(self) -> int:
        return len(self.moments)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_bytes)

    def bytes_of(self, chunks: Iterable[int]) -> int:
        return sum(self.chunk_bytes[chunk] for chunk in chunks)

    def signature(self) -> str:
        """A digest of the access sequence (labels and chunk sets, not byte figures)."""
        sequence = [[moment.label, sorted(moment.chunks)] for moment in self.moments]
        return hashlib.sha256(json.dumps(sequence).encode()).hexdigest()

    def differs_from(self, other: AccessTrace) -> bool:
        """Another sequence, or the same one with other non-model figures (a longer input
        through the same modules): a store adopts such a trace ([Note: chunk store])."""
        if self.signature() != other.signature():
            return True
        pairs = zip(self.moments, other.moments, strict=True)  # same signature: same length
        return any(a.non_model_bytes != b.non_model_bytes for a, b in pairs)

    @cached_property
    def _uses(self) -> tuple[tuple[int, ...], ...]:
        uses: list[list[int]] = [[] for _ in self.chunk_bytes]
        for moment in self.moments:
            for chunk in moment.chunks:
                uses[chunk].append(moment.index)
        return tuple(tuple(indices) for indices in uses)

    def uses(self, chunk: int) -> tuple[int, ...]:
        """Indices of the moments that use ``chunk``, in order."""
        return self._uses[chunk]

    def next_use(self, chunk: int, after: int) -> int | None:
        """The index of the next moment after ``after`` that uses ``chunk``.

        Iterations repeat, so a chunk used only at or before ``after`` is next used in the next
        iteration, at ``len(self) + its first use``. ``None`` if no moment uses it. ``after`` may be
        -1 (before the first moment).
        """
        if not -1 <= after < len(self.moments):
            raise ValueError(f"after must be in [-1, {len(self.moments)}), got {after}")
        uses = self._uses[chunk]
        if not uses:
            return None
        position = bisect.bisect_right(uses, after)
        return uses[position] if position < len(uses) else len(self.moments) + uses[0]

    @property
    def peak_non_model_bytes(self) -> int:
        return max((moment.non_model_bytes for moment in self.moments), default=0)

    def moment_device_bytes(self, index: int) -> int:
        """Bytes on the device while moment ``index`` runs with only its own chunks resident."""
        moment = self.moments[index]
        return self.bytes_of(moment.chunks) + moment.non_model_bytes

    def min_device_bytes(self) -> int:
        """The smallest device budget at which every moment can run."""
        return max((self.moment_device_bytes(i) for i in range(len(self.moments))), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": _FORMAT_VERSION,
            "chunk_bytes": list(self.chunk_bytes),
            "moments": [
                {
                    "label": moment.label,
                    "chunks": sorted(moment.chunks),
                    "non_model_bytes": moment.non_model_bytes,
                }
                for moment in self.moments
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AccessTrace:
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(
                f"access trace version {data.get('version')!r} is not {_FORMAT_VERSION}"
            )
        moments = tuple(
            Moment(
                index=index,
                chunks=frozenset(int(chunk) for chunk in entry["chunks"]),
                non_model_bytes=int(entry["non_model_bytes"]),
                label=str(entry["label"]),
            )
            for index, entry in enumerate(data["moments"])
        )
        return cls(moments=moments, chunk_bytes=tuple(int(size) for size in data["chunk_bytes"]))


class TraceRecorder:
    """Records the moments of one iteration; see [Note: trace validity] for how it is used."""

    def __init__(self, chunk_bytes: Sequence[int]) -> None:
        self._chunk_bytes = tuple(chunk_bytes)
        self._moments: list[Moment] | None = None

    @property
    def recording(self) -> bool:
        return self._moments is not None

    @property
    def moments(self) -> tuple[Moment, ...]:
        return tuple(self._moments or ())

    def begin_iteration(self) -> None:
        """Start (or restart, dropping what was recorded) the record of an iteration."""
        self._moments = []

    def record(self, label: str, chunks: Iterable[int], non_model_bytes: int) -> Moment:
        if self._moments is None:
            raise RuntimeError("record() before begin_iteration()")
        moment = Moment(len(self._moments), frozenset(chunks), non_model_bytes, label)
        unknown = sorted(c for c in moment.chunks if c >= len(self._chunk_bytes))
        if unknown:
            raise ValueError(f"moment {label!r} uses unknown chunks {unknown}")
        self._moments.append(moment)
        return moment

    def raise_last(self, non_model_bytes: int) -> None:
        """Raise the newest moment's non-model figure to ``non_model_bytes`` (its peak so far)."""
        if self._moments and non_model_bytes > self._moments[-1].non_model_bytes:
            self._moments[-1] = dataclasses.replace(
                self._moments[-1], non_model_bytes=non_model_bytes
            )

    def finish(self) -> AccessTrace:
        """End the iteration and return its trace."""
        if self._moments is None:
            raise RuntimeError("finish() before begin_iteration()")
        trace = AccessTrace(moments=tuple(self._moments), chunk_bytes=self._chunk_bytes)
        self._moments = None
        return trace

    def first_mismatch(self, trace: AccessTrace) -> int | None:
        """The first recorded moment whose label or chunk set differs from ``trace``, if any.

        A trace over a different number of chunks (another layout) differs from moment 0.
        """
        if len(trace.chunk_bytes) != len(self._chunk_bytes):
            return 0
        for moment in self._moments or ():
            if moment.index >= len(trace.moments):
                return moment.index
            stored = trace.moments[moment.index]
            if (moment.label, moment.chunks) != (stored.label, stored.chunks):
                return moment.index
        return None

    def matches(self, trace: AccessTrace, *, complete: bool = False) -> bool:
        """Whether the sequence recorded so far is a prefix of ``trace``'s (all of it if ``complete``)."""
        if self.first_mismatch(trace) is not None:
            return False
        return not complete or len(self._moments or ()) == len(trace.moments)
