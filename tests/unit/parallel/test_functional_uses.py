"""Parameters used outside their own module train like the reference ([Note: functional uses])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

STEPS = 8
VOCAB, WIDTH = 64, 32


class UntiedHeadReadsTheEmbedding(nn.Module):
    """The LM head is ``F.linear`` on the embedding's weight in the root's forward, and a norm
    gain owned by an unused module scales the hidden state: both are used outside their module.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )
        self.spare = nn.LayerNorm(WIDTH, bias=False)  # never called: only its weight is read

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.body(h) * self.spare.weight
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return UntiedHeadReadsTheEmbedding()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (4, 17), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(engine) -> list[float]:
    losses = []
    for inputs, targets in _batches():
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, warmup_steps=2, decay_steps=STEPS)


def _chunk_engine(budget: int | None) -> ChunkEngine:
    return ChunkEngine(
        _model(),
        optimizer=_optimizer(),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=1024),  # a chunk or two per parameter: uses cross chunks
    )


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_uses_outside_the_module_match_the_reference(tight: bool) -> None:
    reference = ReferenceEngine(
        _model(), optimizer=_optimizer(), training=TrainingConfig(device="cpu")
    )
    want = _train(reference)
    budget = None
    if tight:
        probe = _chunk_engine(None)
        _train(probe)
        budget = probe.stats()["min_device_bytes"]
    engine = _chunk_engine(budget)
    assert _train(engine) == want
    stats = engine.stats()
    labels = [m.label for m in engine.store.trace.moments]
    assert any(label.startswith("fn:") and "embed.weight" in label for label in labels)
    assert any(label.startswith("fn:") and "spare.weight" in label for label in labels)
    # Use moments do not depend on residency: every iteration made the same sequence.
    assert stats["traces_recorded"] == 1
    if tight:
        assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= budget
        assert any(label.startswith("unpack:") for label in labels)


class SometimesReadsTheHead(UntiedHeadReadsTheEmbedding):
    """Calls its head module at first; later forwards read the head's weight outside it."""

    def __init__(self) -> None:
        super().__init__()
        del self.spare
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.outside = False

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.body(h)
        logits = F.linear(h, self.head.weight) if self.outside else self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_use_that_appears_later_is_fetched() -> None:
    """The head's weight is first read outside its module at the fourth step, with its chunk
    evicted: the parameter itself asks for its chunk ([Note: parameter uses]), so the step
    trains exactly like the reference instead of reading an empty chunk."""

    def train(engine, switch_at: int) -> list[float]:
        losses = []
        for step, (inputs, targets) in enumerate(_batches()):
            engine.model.outside = step >= switch_at
            if step == switch_at and isinstance(engine, ChunkEngine):
                head, _ = engine.store.slot_of[id(engine.model.head.weight)]
                assert head not in engine.store.pinned
                if engine.store.chunks[head].on_device:
                    engine.store.evict(head)  # where a tight budget may well have put it
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    def engine_for(budget: int | None) -> ChunkEngine:
        torch.manual_seed(0)
        return ChunkEngine(
            SometimesReadsTheHead(),
            optimizer=_optimizer(),
            training=TrainingConfig(device="cpu"),
            memory=MemoryConfig(device_budget=budget),
            chunk=ChunkConfig(size=1024, prefetch=False),
        )

    torch.manual_seed(0)
    reference = ReferenceEngine(
        SometimesReadsTheHead(), optimizer=_optimizer(), training=TrainingConfig(device="cpu")
    )
    want = train(reference, switch_at=3)
    probe = engine_for(None)
    _train(probe)
    engine = engine_for(probe.stats()["min_device_bytes"])
    assert train(engine, switch_at=3) == want
    labels = [m.label for m in engine.store.trace.moments]
    assert "fn:head.weight" in labels and "fwd:head" not in labels
