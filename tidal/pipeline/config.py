"""The ``[pipeline]`` section: how a run splits its model into stages and which schedule runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tidal.config import ByteSize, require

__all__ = ["PipelineConfig", "ScheduleName"]

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "pipedream", "2bw", "pipemare", "pipemarew"]
_ASYNC = ("pipedream", "2bw", "pipemare", "pipemarew")
_KEEPS_NO_VERSIONS = ("pipemare", "pipemarew")  # asynchronous, no stashed weights


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """Pipeline parallelism: how the ``parallel.pp`` stages run (``tidal train --mesh pp=P``;
    the number of stages is ``parallel.pp``, [Note: one mesh] in tidal/parallel/dims.py).

    Attributes:
        schedule: ``gpipe``, ``1f1b`` (PipeDream-Flush / DAPPLE), ``interleaved`` (1F1B over
            ``virtual_stages`` model chunks per rank) are synchronous: every step flushes, and
            the result equals one-process training. ``pipedream`` (weight stashing), ``2bw``
            (two weight versions), ``pipemare`` (no stashing, delay-aware) and ``pipemarew``
            (``sync_steps`` synchronous steps, then ``pipemare``) update weights while
            microbatches are in flight: no flush, no bubble after the start, but gradients are
            computed ``tau`` updates late.
        microbatches: per optimizer step (the rows of ``training.batch_size`` are split into
            this many); ``None`` means one per stage. May be below the number of stages.
        virtual_stages: model chunks per rank for ``interleaved``.
        partition: ``balanced`` splits the blocks by dynamic programming over their profiled
            time (under ``memory_limit_bytes``); ``even`` gives each stage the same count.
        lr_rescheduling: PipeMare's first technique, dividing each stage's learning rate by its
            delay ``tau`` at the start and fading that out by step ``lr_warmup_steps``.
            ``None`` means on for ``pipemare``/``pipemarew`` and off otherwise.
        lr_warmup_steps: T1 of the rescheduling.
        correction: PipeMare's discrepancy correction: backward weights ``w - tau * delta``,
            ``delta`` an average of recent updates (one weight-sized buffer per stage).
        correction_decay: ``D`` in ``gamma = D ** (1 / tau)`` (for ``prediction`` too).
        prediction: weight prediction, tidal's alternative to ``correction``: each forward
            runs on the weights its backward is expected to find ``tau_hat`` updates later
            (the optimizer's next update, then ``delta``; one weight-sized buffer per stage, as
            with correction). Recommended with AdamW; asynchronous schedules without stashing
            only; not together with ``correction``.
        sync_steps: ``pipemarew``'s synchronous warm-up steps (T2).
        stage_memory: bytes each stage may hold (weights, gradients, optimizer state, stashed
            versions and the activations of its in-flight microbatches under the schedule);
            the balanced partition respects it or says the least any split needs.
        memory: MPress's savers: ``recompute`` on every block (each keeps its input and runs
            its forward again in its backward), ``selective`` (recompute on each block's
            attention part only, Megatron's selective recompute), ``host`` on every block (what
            each saves goes to the host tier, ``memory.host_budget``, and comes back for its
            backward), ``peer`` (the saver planner with peer swap only: what a rank cannot hold
            is lent to a later stage's rank, [Note: lending] in tidal/pipeline/lending.py),
            ``auto`` (the saver planner's choice per part of each block among all three), both
            against
            ``memory.device_budget`` per rank, ``none`` (keep everything). Savers give the same
            numbers as ``none``, bit for bit; recompute runs under synchronous schedules only
            (``auto`` under an asynchronous one plans without it).
            With ``memory.device_budget`` set every rank is checked before the first step and
            held to it while it trains ([Note: pipeline memory] in
            tidal/train/pipeline_memory.py).
    """

    schedule: ScheduleName = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    partition: Literal["balanced", "even"] = "balanced"
    lr_rescheduling: bool | None = None
    lr_warmup_steps: int = 100
    correction: bool = False
    correction_decay: float = 0.1
    prediction: bool = False
    sync_steps: int = 10
    stage_memory: ByteSize | None = None
    memory: Literal["none", "recompute", "selective", "host", "peer", "auto"] = "none"

    def __post_init__(self) -> None:
        require(
            self.microbatches is None or self.microbatches >= 1,
            "microbatches",
            f"must be >= 1 (or unset for one per stage), got {self.microbatches}",
        )
        require(
            self.virtual_stages >= 1, "virtual_stages", f"must be >= 1, got {self.virtual_stages}"
        )
        require(
            self.virtual_stages == 1 or self.schedule == "interleaved",
            "virtual_stages",
            f"only the interleaved schedule runs several chunks per rank; got "
            f"{self.virtual_stages} with schedule {self.schedule!r}",
        )
        require(
            self.lr_warmup_steps >= 0,
            "lr_warmup_steps",
            f"must be >= 0, got {self.lr_warmup_steps}",
        )
        require(
            0.0 < self.correction_decay < 1.0,
            "correction_decay",
            f"must be in (0, 1), got {self.correction_decay}",
        )
        require(
            not (self.prediction and self.correction),
            "prediction",
            "choose one of prediction (forward on the weights the backward will see) and "
            "correction (backward on the weights the forward saw); they undo each other",
        )
        require(
            not self.prediction or self.schedule in ("pipemare", "pipemarew"),
            "prediction",
            f"weight prediction needs schedule 'pipemare' or 'pipemarew' (got "
            f"{self.schedule!r}): synchronous schedules have no delay and stashing ones run "
            "the forward on a stashed version",
        )
        require(self.sync_steps >= 0, "sync_steps", f"must be >= 0, got {self.sync_steps}")
        require(
            self.memory not in ("recompute", "selective")
            or self.schedule not in _KEEPS_NO_VERSIONS,
            "memory",
            f"{self.memory} runs under synchronous and stashing schedules (gpipe, 1f1b, "
            f"interleaved, pipedream, 2bw), not {self.schedule!r}: it would run the forward again "
            f"on weights the forward did not use; host, peer and auto (without recompute) run "
            f"under it",
        )

    def num_microbatches(self, stages: int) -> int:
        """Microbatches per step in a pipeline of ``stages``: one per stage unless set."""
        return stages if self.microbatches is None else self.microbatches

    @property
    def asynchronous(self) -> bool:
        return self.schedule in _ASYNC

    @property
    def stashes(self) -> bool:
        """Asynchronous with stashed weight versions (a recompute can run on its forward's)."""
        return self.asynchronous and self.schedule not in _KEEPS_NO_VERSIONS

    @property
    def reschedules_lr(self) -> bool:
        if self.lr_rescheduling is None:
            return self.schedule in ("pipemare", "pipemarew")
        return self.lr_rescheduling
