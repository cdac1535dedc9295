"""The Engine protocol, its phases ([Note: engine phases] in tidal/parallel/protocol.py) and the
verbs that build engines (tidal/parallel/verbs.py), on a two-layer regression model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tidal
from tidal.config import ConfigError
from tidal.memory.config import ChunkConfig
from tidal.memory.uses import ChunkParameter
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig, OptimizerConfig, TrainingConfig
from tidal.parallel.local_parts import LocalParts
from tidal.parallel.protocol import Engine, Phase, Phases, TrainingEngine
from tidal.parallel.reference import ReferenceEngine
from tidal.parallel.sharded_parts import ShardedParts
from tidal.parallel.verbs import offload, shard
from tidal.runtime.stage_engine import StageEngine
from tidal.runtime.weights import StageWeights
from tidal.sharding.config import ShardingConfig


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


def _configs(precision: str = "fp32", accum: int = 1) -> dict[str, Any]:
    return {
        "optimizer": OptimizerConfig(lr=1e-2, warmup_steps=0),
        "training": TrainingConfig(device="cpu", precision=precision, grad_accum_steps=accum),
    }


def _chunk_configs() -> dict[str, Any]:
    return {"memory": MemoryConfig(), "chunk": ChunkConfig(size=128, align=16)}


def _reference(**configs: Any) -> ReferenceEngine:
    return ReferenceEngine(_Regression(), **configs)


def _offload(**configs: Any) -> ChunkEngine:
    return offload(_Regression(), **configs, **_chunk_configs())


def _shard(**configs: Any) -> ChunkEngine:
    return shard(_Regression(), **configs, **_chunk_configs(), sharding=ShardingConfig())


ENGINES: dict[str, Callable[..., Any]] = {
    "reference": _reference, "offload": _offload, "shard": _shard
}  # fmt: skip


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_is_a_training_engine(kind: str) -> None:
    engine = ENGINES[kind](**_configs())
    assert isinstance(engine, TrainingEngine)
    assert isinstance(engine, Engine)  # the DCP checkpoint contract
    assert not isinstance(object(), TrainingEngine)


def test_no_engine_subclasses_anything() -> None:
    from tidal.parallel.plan_layout import PlanLayout
    from tidal.parallel.reference import Replicas

    for made in (ChunkEngine, ReferenceEngine, Replicas, PlanLayout):
        assert made.__bases__ == (object,), made


@pytest.mark.parametrize("kind", ENGINES)
def test_phases_follow_the_calls(kind: str) -> None:
    engine = ENGINES[kind](**_configs(accum=2))
    x, y = _batch(0)
    assert engine.phase is Phase.IDLE
    loss = engine(x, y)
    assert engine.phase is Phase.FORWARD
    engine.backward(loss)
    assert engine.phase is Phase.ACCUMULATED
    assert not engine.step() and engine.phase is Phase.ACCUMULATED  # mid-window
    with torch.no_grad():  # an evaluation between micro-batches keeps their gradients
        engine(x, y)
    assert engine.phase is Phase.ACCUMULATED
    engine.backward(engine(x, y))
    assert engine.step() and engine.phase is Phase.IDLE
    engine(x, y)
    engine.zero_grad()  # drops no open forward
    assert engine.phase is Phase.FORWARD
    with torch.no_grad():  # a forward ends the open one, returning to the phase it left
        engine(x, y)
    assert engine.phase is Phase.IDLE


@pytest.mark.parametrize("kind", ENGINES)
def test_a_forward_that_raises_returns_to_the_phase_it_left(kind: str) -> None:
    engine = ENGINES[kind](**_configs(accum=2))
    x, y = _batch(0)
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError):
        engine(torch.randn(8, 3), y)  # the wrong width
    assert engine.phase is Phase.ACCUMULATED


def test_gradients_in_parameters_refuse_a_forward_until_the_step() -> None:
    engine = _offload(**_configs(precision="bf16"))
    x, y = _batch(0)
    engine.backward(engine(x, y))
    assert engine.optimizer.grads_in_params and engine.phase is Phase.GRADS_IN_PARAMS
    with pytest.raises(RuntimeError, match=r"called between backward\(\) and step\(\)"):
        engine(x, y)
    with pytest.raises(RuntimeError, match=r"load_state_dict between backward\(\) and step\(\)"):
        engine.load_state_dict(engine.state_dict())
    assert engine.phase is Phase.GRADS_IN_PARAMS  # refused before any change
    engine.zero_grad()
    assert engine.phase is Phase.IDLE
    engine.backward(engine(x, y))
    assert engine.step() and engine.phase is Phase.IDLE


def test_the_phase_table_is_asserted() -> None:
    phases = Phases()
    phases.backward()  # a loss of the parameters alone needs no forward
    phases.forward()
    phases.forward_ended()
    assert phases.now is Phase.ACCUMULATED
    phases.gradients_dropped()
    phases.backward(grads_in_params=True)
    with pytest.raises(
        AssertionError, match="illegal engine phase change grads_in_params -> forward"
    ):
        phases.forward()
    with pytest.raises(AssertionError, match="grads_in_params -> accumulated"):
        phases.backward()
    assert phases.now is Phase.GRADS_IN_PARAMS


def test_offload_changes_the_model_in_place() -> None:
    model = _Regression()
    engine = offload(model, **_configs(), **_chunk_configs())
    assert engine.model is model and isinstance(engine.parts, LocalParts)
    for param in model.parameters():  # each one is a slot of a chunk now
        assert isinstance(param, ChunkParameter) and id(param) in engine.store.slot_of


def test_shard_without_a_process_group_is_a_mesh_of_one() -> None:
    local, sharded = _offload(**_configs()), _shard(**_configs())
    assert (sharded.rank, sharded.world_size) == (0, 1)
    assert isinstance(sharded.parts, ShardedParts)
    assert sharded.stats()["engine"] == "chunk-sharded" and local.stats()["engine"] == "chunk"
    for step in range(4):
        losses = []
        for engine in (local, sharded):
            loss = engine(*_batch(step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("key", ["relayout", "grads_in_params"])
def test_shard_refuses_what_applies_on_one_process_only(key: str) -> None:
    chunk = ChunkConfig(size=128, align=16, **{key: True})
    with pytest.raises(ConfigError, match=f"chunk.{key}.*one process only"):
        shard(_Regression(), **_configs(), memory=MemoryConfig(), chunk=chunk,
              sharding=ShardingConfig())  # fmt: skip
    for setting in (None, False):  # unset, or off: the sharded engine is built
        chunk = ChunkConfig(size=128, align=16, **{key: setting})
        shard(_Regression(), **_configs(), memory=MemoryConfig(), chunk=chunk,
              sharding=ShardingConfig())  # fmt: skip


@pytest.mark.parametrize(
    ("section", "parts"),
    [({"engine": "reference"}, None), ({"engine": "chunk"}, LocalParts), ({"engine": "chunk", "memory": {"nvme_dir": "DISK"}}, ShardedParts)],
)  # fmt: skip
def test_initialize_chooses_the_verb_from_the_config_alone(
    tmp_path: Path, section: dict[str, Any], parts: type | None
) -> None:
    config: dict[str, Any] = {**section, "training": {"device": "cpu"}}
    if "memory" in config:
        config["memory"] = {"nvme_dir": str(tmp_path)}
    engine = tidal.initialize(_Regression(), config)
    assert isinstance(engine, tidal.Engine)  # the one checkpoint format too
    assert isinstance(engine, StageEngine)  # [Note: one model on stages]: one stage, always
    if parts is None:  # plain replicas
        assert type(engine.params) is StageWeights and engine.chunks is None
    else:  # the chunk transform, one process or a mesh of one for the disk
        assert isinstance(engine.chunks, tidal.ChunkEngine) and isinstance(
            engine.chunks.parts, parts
        )
