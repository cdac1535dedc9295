"""The ``[sharding]`` section: ZeRO-3 data parallelism over chunks (see [Note: sharded chunks])."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import require

__all__ = ["ShardingConfig"]


@dataclass(kw_only=True, slots=True)
class ShardingConfig:
    """How the chunk engine shards model data when it runs on several ranks (torchrun).

    With one process these settings do nothing.

    Attributes:
        reshard_after_forward: drop every gathered chunk when the forward ends, so the backward
            gathers again (ZeRO-3: three transfers of the model per step, and between forward
            and backward a rank holds only its shards). ``false`` keeps what the device budget
            allows from the forward to the backward (two transfers, more device memory held
            while the activations are at their peak).
        max_pending_reductions: gradient reduce-scatters in flight at once during the backward;
            each holds a chunk's fp32 gradient on the device until it completes.
        check_gathers: before each gather, check that every rank gathers the same chunk (a
            two-number all-reduce on a CPU group, [Note: ranks decide alike] in store.py), so
            ranks that run different modules (a mixture of experts that skips an expert no
            token chose) stop with an error naming both chunks instead of hanging or mixing
            shards; ``false`` saves that round trip once a model is known to run alike (it
            cost 6-10% of the demo's step on 2 ranks of a 2-core CPU machine, ``tidal bench
            dp --section perf``).
        reduce_per_step: in a pipeline's chunk stages, reduce-scatter a step's gradients once,
            after the stage's last backward of the step, instead of after every microbatch's:
            each chunk's fp32 gradient is held whole on the device from its first microbatch
            to the last (more device memory), and the reduce-scatter traffic is ``1/m`` of
            per-microbatch reduction (``m`` microbatches a step). With ``reshard_after_forward =
            false`` the gathered chunks then stay for the step too, as far as the device budget
            allows. ([Note: reducing once per step] in tidal/sharding/grads.py.)
    """

    reshard_after_forward: bool = True
    max_pending_reductions: int = 2
    check_gathers: bool = True
    reduce_per_step: bool = False

    def __post_init__(self) -> None:
        require(
            self.max_pending_reductions >= 1,
            "max_pending_reductions",
            f"must be >= 1, got {self.max_pending_reductions}",
        )
