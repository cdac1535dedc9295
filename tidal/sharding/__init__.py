"""ZeRO-3 data parallelism over chunks: sharded chunks, reduce-scattered gradients, sharded state."""

from tidal.sharding.config import ShardingConfig

__all__ = ["ShardingConfig"]
