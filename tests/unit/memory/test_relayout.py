"""Re-packing the chunks in first-use order at the first step ([Note: relayout]).

A model built in the reverse of the order it runs ends with its chunks in the order of use; the
losses stay bit for bit the reference engine's (fp32), or the engine's without relayout (bf16),
for AdamW and SGD with momentum, unlimited and tight budgets and gradient accumulation; the
device tier stays within its budget through the relayout; checkpoints carry over.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.memory.relayout import plan_relayout
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

STEPS = 12
CHUNK = 384  # elements: a layer's weight and bias share a chunk, the next layer opens another
VOCAB = 64


class _Backwards(nn.Module):
    """Built head first and run head last; its layers run in the reverse of their indices."""

    def __init__(
        self, *, width: int = 16, depth: int = 6, frozen_norm: bool = False, tied: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(width, VOCAB)
        self.norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.embed = nn.Embedding(VOCAB, width)
        self.norm.requires_grad_(not frozen_norm)
        if tied:  # registered as head.weight, first used as the embedding
            self.embed.weight = self.head.weight

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(num: int, *, vocab: int = VOCAB, seq_len: int = 16) -> Iterator:
    g = torch.Generator().manual_seed(1)
    for _ in range(num):
        tokens = torch.randint(0, vocab, (4, seq_len + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _optimizer(name: str = "adamw") -> OptimizerConfig:
    lr = 0.1 if name == "sgd" else 3e-3
    return OptimizerConfig(name=name, lr=lr, warmup_steps=3, decay_steps=STEPS)


def _train(engine, batches) -> list[float]:
    losses = []
    for inputs, targets in batches:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _reference(make: Callable[[], nn.Module], batches, *, optimizer: str = "adamw", **training):
    engine = ReferenceEngine(
        make(), optimizer=_optimizer(optimizer), training=TrainingConfig(device="cpu", **training)
    )
    return _train(engine, batches), engine


def _chunk(
    make: Callable[[], nn.Module],
    *,
    budget: int | None = None,
    optimizer: str = "adamw",
    relayout: bool = True,
    size: int = CHUNK,
    **training,
) -> ChunkEngine:
    return ChunkEngine(
        make(),
        optimizer=_optimizer(optimizer),
        training=TrainingConfig(device="cpu", **training),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=size, relayout=relayout),
    )


def _probe(make: Callable[[], nn.Module], **kwargs) -> int:
    """The minimum budget over two unlimited steps: the first in construction order, the second
    in first-use order (activations count against the budget, so it is measured by a run)."""
    engine = _chunk(make, **kwargs)
    minimum_bytes = 0
    for inputs, targets in _batches(2):
        engine.backward(engine(inputs, targets))
        engine.step()
        minimum_bytes = max(minimum_bytes, engine.stats()["min_device_bytes"])
    return minimum_bytes


def _slot_names(engine: ChunkEngine) -> list[str]:
    return [slot.names[0] for chunk in engine.layout.chunks for slot in chunk.slots]


def _first_use_names(engine: ChunkEngine) -> list[str]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return [names[pid] for pid in engine.store.first_use_order]


def _construction_names(engine: ChunkEngine) -> list[str]:
    return [name for name, _ in engine.model.named_parameters()]


def test_chunks_end_in_first_use_order() -> None:
    engine = _chunk(_Backwards)
    assert _slot_names(engine) == _construction_names(engine)
    _train(engine, _batches(1))
    assert _slot_names(engine) == _first_use_names(engine)
    assert _slot_names(engine)[:3] == ["embed.weight", "layers.5.weight", "layers.5.bias"]
    assert engine.layout.chunks[-1].slots[-1].names == ("head.bias",)
    assert engine.min_budget_bytes > 0 and engine.stats()["num_chunks"] == engine.layout.num_chunks
    # The trace was translated, and the meter knows the new chunks' storages: later iterations
    # repeat it exactly, so no new trace is adopted.
    _train(engine, _batches(4))
    assert engine.stats()["traces_recorded"] == 1


def test_llama_norms_move_before_their_attention() -> None:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    class CausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            )  # fmt: skip
            self.inner = transformers.LlamaForCausalLM(config)

        def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = self.inner(input_ids=inputs).logits
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    engine = _chunk(CausalLM, size=128)
    layer = "inner.model.layers.0"
    names = _construction_names(engine)
    assert names.index(f"{layer}.input_layernorm.weight") > names.index(
        f"{layer}.mlp.down_proj.weight"
    )
    _train(engine, _batches(1, vocab=128))
    names = _slot_names(engine)
    assert names == _first_use_names(engine)
    assert names.index(f"{layer}.input_layernorm.weight") < names.index(
        f"{layer}.self_attn.q_proj.weight"
    )
    assert names.index(f"{layer}.post_attention_layernorm.weight") < names.index(
        f"{layer}.mlp.gate_proj.weight"
    )


def test_a_model_built_in_use_order_keeps_its_layout() -> None:
    engine = _chunk(lambda: build_gpt(preset("tiny"), seed=0), size=128)
    before = engine.layout
    _train(engine, _batches(1, vocab=256))
    assert engine.layout is before


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_losses_match_the_reference_bit_for_bit(optimizer: str, tight: bool) -> None:
    want, reference = _reference(_Backwards, _batches(STEPS), optimizer=optimizer)
    budget = _probe(_Backwards, optimizer=optimizer) if tight else None
    engine = _chunk(_Backwards, budget=budget, optimizer=optimizer)
    assert _train(engine, _batches(STEPS)) == want
    assert _slot_names(engine) == _first_use_names(engine)
    want_state = reference.model.state_dict()
    for name, value in engine.model_state_dict().items():
        assert torch.equal(value, want_state[name]), name
    if tight:
        stats = engine.stats()
        assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= budget


@pytest.mark.parametrize("tight", [False, True], ids=["unlimited", "tight"])
def test_bf16_losses_do_not_depend_on_the_relayout(tight: bool) -> None:
    budget = _probe(_Backwards, precision="bf16") if tight else None
    losses = {}
    for relayout in (True, False):
        engine = _chunk(_Backwards, budget=budget, relayout=relayout, precision="bf16")
        losses[relayout] = _train(engine, _batches(STEPS))
        assert engine.store.chunks[0].dtype == torch.bfloat16
        assert engine.optimizer.masters is not None
        order = _first_use_names if relayout else _construction_names
        assert _slot_names(engine) == order(engine)
    assert losses[True] == losses[False]


def test_gradient_accumulation_relays_out_at_the_first_boundary() -> None:
    want, _ = _reference(_Backwards, _batches(2 * 6), grad_accum_steps=2)
    budget = _probe(_Backwards)
    engine = _chunk(_Backwards, budget=budget, grad_accum_steps=2)
    construction = engine.layout
    batches = _batches(2 * 6)
    losses = _train(engine, [next(batches)])
    assert engine.global_step == 0 and engine.layout is construction
    losses += _train(engine, [next(batches)])
    assert engine.global_step == 1 and _slot_names(engine) == _first_use_names(engine)
    losses += _train(engine, batches)
    assert losses == want and engine.global_step == 6
    assert engine.stats()["peak_device_bytes"] <= budget


def test_budgets_hold_through_the_relayout() -> None:
    budget = _probe(_Backwards)
    engine = _chunk(_Backwards, budget=budget)
    inputs, targets = next(_batches(1))
    engine.backward(engine(inputs, targets))
    plan = plan_relayout(engine.model, engine.store, engine.optimizer)
    assert plan is not None
    device, host = engine.device_tier, engine.host_tier
    resident_bytes = sum(c.num_bytes for c in engine.store.chunks if c.on_device)
    resident_used_bytes = sum(4 * c.spec.used for c in engine.store.chunks if c.on_device)
    assert resident_bytes > 0
    out_bytes, host_bytes, old_bytes = device.bytes_out, host.held_bytes, engine.store.model_bytes
    host.reset_peak()
    engine.step()
    assert engine.layout == plan.layout
    assert device.peak_bytes <= budget
    # The parameters on the device came to the host, counted as traffic (padding is not copied).
    assert device.bytes_out - out_bytes >= resident_used_bytes
    # The host grew by no more than planned: the chunks that were on the device, the padding
    # the new layout adds to each of the 4 kinds, and, with whole layers reversed, one chunk.
    assert host.peak_bytes - host_bytes <= plan.transient_host_bytes
    padding_bytes = engine.store.model_bytes - old_bytes  # fp32: the same for every kind
    largest_bytes = max(plan.trace.chunk_bytes)
    assert plan.transient_host_bytes <= resident_bytes + 4 * padding_bytes + largest_bytes


def test_no_relayout_when_the_host_cannot_hold_the_transient_copies() -> None:
    want, _ = _reference(_Backwards, _batches(4))
    engine = _chunk(_Backwards)
    engine.host_tier.budget_bytes = engine.host_tier.held_bytes  # not a byte to spare
    construction = engine.layout
    with pytest.warns(UserWarning, match="relayout .* skipped: the host tier has no room"):
        assert _train(engine, _batches(4)) == want
    assert engine.layout is construction


def test_state_dict_round_trip_after_relayout() -> None:
    budget = _probe(_Backwards)
    engine = _chunk(_Backwards, budget=budget)
    batches = list(_batches(6))
    _train(engine, batches[:3])
    saved = engine.state_dict()
    want = _train(engine, batches[3:])
    for relayout in (True, False):
        again = _chunk(_Backwards, budget=budget, relayout=relayout)
        again.load_state_dict(saved)
        assert _train(again, batches[3:]) == want
        order = _first_use_names if relayout else _construction_names
        assert _slot_names(again) == order(again)


def test_frozen_parameters_keep_chunks_of_their_own() -> None:
    def make() -> nn.Module:
        return _Backwards(frozen_norm=True)

    want, _ = _reference(make, _batches(STEPS))
    engine = _chunk(make)
    assert _train(engine, _batches(STEPS)) == want
    frozen = {"norm.weight", "norm.bias"}
    for chunk in engine.layout.chunks:
        assert len({slot.names[0] in frozen for slot in chunk.slots}) == 1
    trainable_order = [n for n in _first_use_names(engine) if n not in frozen]
    assert [n for n in _slot_names(engine) if n not in frozen] == trainable_order
    assert "norm.weight" not in engine.optimizer.state_dict()


def test_a_tied_parameter_moves_once() -> None:
    def make() -> nn.Module:
        return _Backwards(tied=True)

    want, _ = _reference(make, _batches(STEPS))
    engine = _chunk(make)
    assert _train(engine, _batches(STEPS)) == want
    assert engine.layout.chunks[0].slots[0].names == ("head.weight", "embed.weight")
    model = engine.model
    assert model.head.weight is model.embed.weight
    assert (
        model.head.weight.data_ptr()
        == engine.store.chunks[0].device_view(0, engine.device_tier).data_ptr()
    )


def test_without_relayout_the_layout_stays_in_construction_order() -> None:
    engine = _chunk(_Backwards, relayout=False)
    construction = engine.layout
    _train(engine, _batches(3))
    assert engine.layout is construction
    assert _slot_names(engine) == _construction_names(engine) != _first_use_names(engine)
