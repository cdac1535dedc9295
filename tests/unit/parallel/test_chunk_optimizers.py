"""AdamW, Adam and SGD in the chunk engine against the reference engine; frozen parameters.

Every optimizer's 20-step losses, final weights and optimizer state equal the reference engine's
bit for bit (fp32), with placement on and off; frozen parameters get chunks of their own and no
gradient or optimizer-state bytes; checkpoints resume exactly for each optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tidal.config import ConfigError
from tidal.memory.chunk import ChunkKind
from tidal.memory.config import ChunkConfig
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.testing.trees import assert_equal_tree
from tidal.train import OptimizerConfig, ReferenceEngine, Trainer, TrainingConfig
from tidal.train.checkpoint import Checkpoint, list_checkpoints, load_checkpoint, read_tensors
from tidal.train.metrics import read_metrics

TINY = preset("tiny")
STEPS = 20
TINY_CHUNK = 128  # elements: about two dozen chunks for the tiny preset

# name -> OptimizerConfig overrides; SGD gets a learning rate that moves the weights visibly.
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"name": "adamw"},
    "adam": {"name": "adam"},
    "sgd": {"name": "sgd", "lr": 0.1},
    "sgd-plain": {"name": "sgd", "lr": 0.1, "momentum": 0.0},
    "sgd-nesterov": {"name": "sgd", "lr": 0.1, "nesterov": True},
    "sgd-dampening": {"name": "sgd", "lr": 0.1, "dampening": 0.3},
    "sgd-unfused": {"name": "sgd", "lr": 0.1, "fused": False},
    "adam-unfused": {"name": "adam", "fused": False},
    # torch's rule for model.parameters(): biases, norms and gains decay too
    "adamw-decay-all": {"name": "adamw", "weight_decay_on": "all"},
}


def _optimizer(key: str) -> OptimizerConfig:
    settings = {"lr": 3e-3, "warmup_steps": 5, "decay_steps": STEPS, **OPTIMIZERS[key]}
    return OptimizerConfig(**settings)


def _batches(num: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    for _ in range(num):
        tokens = torch.randint(0, TINY.vocab_size, (4, 65), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def _train(engine: Any, num: int, *, skip: int = 0) -> list[float]:
    """Train on batches ``skip .. num - 1``; the losses."""
    losses = []
    for inputs, targets in list(_batches(num))[skip:]:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _tiny() -> nn.Module:
    return build_gpt(TINY, seed=0)


def _frozen() -> nn.Module:
    """The tiny GPT with its position embedding, first block and final norm frozen."""
    model = _tiny()
    model.pos_embed.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    model.ln_f.requires_grad_(False)
    return model


def _reference(make: Callable[[], nn.Module], key: str) -> ReferenceEngine:
    return ReferenceEngine(make(), optimizer=_optimizer(key), training=TrainingConfig(device="cpu"))


def _chunk(make: Callable[[], nn.Module], key: str, *, budget: int | None = None) -> ChunkEngine:
    return ChunkEngine(
        make(),
        optimizer=_optimizer(key),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=TINY_CHUNK),
    )


def _assert_same_optimizer_state(chunk: ChunkEngine, reference: ReferenceEngine) -> None:
    """The chunk optimizer's per-name state is torch's, key for key and bit for bit."""
    want = {
        name: reference.optimizer.state[param]
        for name, param in reference.model.named_parameters()
        if param in reference.optimizer.state and reference.optimizer.state[param]
    }
    got = chunk.optimizer.state_dict()
    assert got.keys() == want.keys()
    for name, state in got.items():
        assert state.keys() == want[name].keys(), name
        for key, value in state.items():
            assert torch.equal(value, want[name][key]), (name, key)


@pytest.mark.parametrize("key", OPTIMIZERS)
def test_losses_weights_and_state_equal_the_reference(key: str) -> None:
    reference = _reference(_tiny, key)
    want = _train(reference, STEPS)
    chunk = _chunk(_tiny, key)
    assert _train(chunk, STEPS) == want  # bit for bit, not a tolerance
    assert want[-1] != want[0]
    reference_state = reference.model.state_dict()
    for name, value in chunk.model_state_dict().items():
        assert torch.equal(value, reference_state[name]), name
    _assert_same_optimizer_state(chunk, reference)


def _roomy_budget(make: Callable[[], nn.Module], key: str) -> int:
    """The measured minimum plus every parameter chunk 1.5 times more: some indices, not all, can
    be pinned with their optimizer state, and the others are updated on the host."""
    probe = _chunk(make, key)
    _train(probe, 1)
    return probe.stats()["min_device_bytes"] + 3 * probe.store.model_bytes // 2


@pytest.mark.parametrize("key", ["adam", "sgd", "sgd-plain"])
def test_a_tight_budget_gives_the_same_losses(key: str) -> None:
    unlimited = _train(_chunk(_tiny, key), 8)
    budget = _roomy_budget(_tiny, key)
    tight = _chunk(_tiny, key, budget=budget)
    assert _train(tight, 8) == unlimited
    assert 0 < len(tight.store.pinned) < tight.layout.num_chunks
    assert tight.stats()["peak_device_bytes"] <= budget


@pytest.mark.parametrize(
    ("key", "kinds", "keys"),
    [
        ("adamw", (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ), {"step", "exp_avg", "exp_avg_sq"}),
        ("adam", (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ), {"step", "exp_avg", "exp_avg_sq"}),
        ("sgd", (ChunkKind.MOMENTUM,), {"momentum_buffer"}),
        ("sgd-plain", (), set()),
    ],
)
def test_state_chunks_and_checkpoint_keys_per_optimizer(key: str, kinds: tuple, keys: set) -> None:
    engine = _chunk(_tiny, key)
    optimizer = engine.optimizer
    assert tuple(optimizer.states) == kinds
    assert all(c is not None and c.kind is kind for kind in kinds for c in optimizer.states[kind])
    num_tensors = len(list(engine.model.parameters()))
    param_bytes = engine.store.model_bytes  # fp32: every state chunk has these bytes
    steps_bytes = 4 * num_tensors if "step" in keys else 0
    assert engine.model_data_bytes() == {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer_state": len(kinds) * param_bytes + steps_bytes,
    }
    # torch's SGD has no momentum buffer before its first step; Adam starts from zeros.
    before = optimizer.state_dict()
    assert all(state.keys() == keys - {"momentum_buffer"} for state in before.values())
    _train(engine, 2)
    state = optimizer.state_dict()
    if keys:
        assert len(state) == num_tensors
        assert all(entry.keys() == keys for entry in state.values())
    else:
        assert state == {}


@pytest.mark.parametrize("key", ["adamw", "sgd", "sgd-plain"])
def test_state_dict_round_trip_continues_identically(key: str) -> None:
    a = _chunk(_tiny, key)
    _train(a, 3)
    b = _chunk(_tiny, key)
    b.load_state_dict(a.state_dict())
    assert _train(a, 6, skip=3) == _train(b, 6, skip=3)
    for name, value in a.model_state_dict().items():
        assert torch.equal(value, b.model_state_dict()[name]), name


def test_a_fresh_sgd_state_stays_lazy_through_a_round_trip() -> None:
    # Saved before the first step: no momentum buffer, so the next step must start it from the
    # gradient (torch's rule), not from the zeros in the chunk.
    a = _chunk(_tiny, "sgd")
    b = _chunk(_tiny, "sgd")
    b.load_state_dict(a.state_dict())
    assert _train(a, 3) == _train(b, 3) == _train(_reference(_tiny, "sgd"), 3)


def test_another_optimizers_state_is_refused() -> None:
    adamw = _chunk(_tiny, "adamw")
    _train(adamw, 1)
    sgd = _chunk(_tiny, "sgd")
    with pytest.raises(ValueError, match="exp_avg.*another optimizer"):
        sgd.load_state_dict(adamw.state_dict())
    with pytest.raises(KeyError, match="no 'step' for"):
        _chunk(_tiny, "adam").optimizer.load_state_dict({})


# ---------------------------------------------------------------------------------------------
# frozen parameters


def _trainable_chunk_bytes(engine: ChunkEngine) -> int:
    """fp32 bytes of the chunks holding trainable parameters, read from the layout alone."""
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    return 4 * sum(
        chunk.capacity
        for chunk in engine.layout.chunks
        if any(slot.names[0] in trainable for slot in chunk.slots)
    )


@pytest.mark.parametrize("key", ["adamw", "sgd"])
def test_frozen_parameters_train_like_the_reference(key: str) -> None:
    reference = _reference(_frozen, key)
    want = _train(reference, STEPS)
    engine = _chunk(_frozen, key)
    assert _train(engine, STEPS) == want
    state = engine.model_state_dict()
    untouched = _frozen()
    for name, param in untouched.named_parameters():
        if not param.requires_grad:
            assert torch.equal(state[name], param.detach()), name
    _assert_same_optimizer_state(engine, reference)


def test_frozen_chunks_carry_no_gradient_or_optimizer_state() -> None:
    engine = _chunk(_frozen, "adamw")
    requires_grad = {n: p.requires_grad for n, p in engine.model.named_parameters()}
    frozen_indices = set()
    for chunk in engine.layout.chunks:
        groups = {requires_grad[slot.names[0]] for slot in chunk.slots}
        assert len(groups) == 1, f"chunk {chunk.index} mixes frozen and trainable parameters"
        if groups == {False}:
            frozen_indices.add(chunk.index)
    optimizer = engine.optimizer
    assert frozen_indices and optimizer.trainable.isdisjoint(frozen_indices)
    for index in frozen_indices:
        assert optimizer.grads[index] is None and optimizer.state_bytes_of(index) == 0
        assert all(chunks[index] is None for chunks in optimizer.states.values())

    grad_bytes = _trainable_chunk_bytes(engine)
    num_trainable = sum(requires_grad.values())
    data = engine.model_data_bytes()
    assert data["grads"] == grad_bytes
    assert data["optimizer_state"] == 2 * grad_bytes + 4 * num_trainable  # moments + steps
    everything = _chunk(_tiny, "adamw").model_data_bytes()
    assert data["grads"] < everything["grads"]
    assert data["optimizer_state"] < everything["optimizer_state"]


def test_frozen_parameters_under_a_budget_with_bf16_masters() -> None:
    def bf16(budget: int | None) -> ChunkEngine:
        return ChunkEngine(
            _frozen(),
            optimizer=_optimizer("sgd"),
            training=TrainingConfig(device="cpu", precision="bf16"),
            memory=MemoryConfig(device_budget=budget),
            chunk=ChunkConfig(size=TINY_CHUNK),
        )

    unlimited = bf16(None)
    losses = _train(unlimited, 6)
    masters = unlimited.optimizer.masters
    assert masters is not None
    assert [m is not None for m in masters] == [
        i in unlimited.optimizer.trainable for i in range(unlimited.layout.num_chunks)
    ]
    # Placement never changes the arithmetic; frozen indices pin with no state bytes.
    budget = unlimited.stats()["min_device_bytes"] + unlimited.store.model_bytes
    tight = bf16(budget)
    assert _train(tight, 6) == losses
    assert 0 < len(tight.store.pinned) < tight.layout.num_chunks
    assert tight.stats()["peak_device_bytes"] <= budget


# ---------------------------------------------------------------------------------------------
# resume through the trainer, per optimizer

RESUME_COMMON = [
    "model.dropout=0.1",
    "optimizer.decay_steps=6",
    "optimizer.warmup_steps=2",
    "training.grad_accum_steps=2",
    "training.val_every=3",
    "training.log_every=1",
    "checkpoint.every_steps=0",
    "metrics.peak_tflops=1.0",
]
RESUME_OPTIMIZERS = {
    "adam": ("optimizer.name=adam",),
    "sgd": ("optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.nesterov=true"),
    "sgd-plain": ("optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.momentum=0"),
}
RESUME_ENGINES = {
    "reference": (),
    # Unlimited: every index is pinned and updated in place on the device tier (the host-side
    # update is covered by test_a_tight_budget_gives_the_same_losses).
    "chunk": ("engine=chunk", "chunk.size=128"),
}


def _run(run_dir: Path, steps: int, extra: tuple[str, ...], *, resume: bool = False) -> dict:
    overrides = [*RESUME_COMMON, f"run_dir={run_dir}", f"training.steps={steps}", *extra]
    return Trainer("tiny", overrides).fit(resume=resume)


def _train_records(run_dir: Path) -> list[tuple]:
    return [
        (r["step"], r["loss"], r["grad_norm"], r["lr"])
        for r in read_metrics(run_dir)
        if r["kind"] == "train"
    ]


def _final_state(run_dir: Path) -> Checkpoint:
    return load_checkpoint(list_checkpoints(run_dir)[-1][1])


@pytest.mark.parametrize("engine", RESUME_ENGINES)
@pytest.mark.parametrize("optimizer", RESUME_OPTIMIZERS)
def test_six_steps_equal_three_plus_resume_plus_three(
    tmp_path: Path, optimizer: str, engine: str
) -> None:
    extra = (*RESUME_OPTIMIZERS[optimizer], *RESUME_ENGINES[engine])
    whole = _run(tmp_path / "whole", 6, extra)
    _run(tmp_path / "split", 3, extra)
    split = _run(tmp_path / "split", 6, extra, resume=True)
    records = _train_records(tmp_path / "whole")
    assert [r[0] for r in records] == list(range(1, 7))
    assert _train_records(tmp_path / "split") == records  # floats compared with ==
    assert split["final_loss"] == whole["final_loss"] and split["resumed_from_step"] == 3
    a, b = _final_state(tmp_path / "whole"), _final_state(tmp_path / "split")
    assert_equal_tree(a.train_state["engine"], b.train_state["engine"])
    # Every engine writes the one format: every model and optimizer tensor by key.
    tensors_a, tensors_b = read_tensors(a.path), read_tensors(b.path)
    assert_equal_tree(tensors_a, tensors_b)
    has_state = any(key.startswith("optim/") for key in tensors_a)
    assert has_state == (optimizer != "sgd-plain")


# ---------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize(
    ("settings", "key", "message"),
    [
        ({"name": "lion"}, "name", "expected 'adamw', 'adam' or 'sgd'"),
        ({"name": "sgd", "momentum": -0.1}, "momentum", "must be >= 0"),
        ({"name": "sgd", "dampening": 1.5}, "dampening", r"must be in \[0, 1\]"),
        ({"name": "sgd", "nesterov": True, "momentum": 0.0}, "nesterov", "momentum > 0"),
        ({"name": "sgd", "nesterov": True, "dampening": 0.1}, "nesterov", "dampening 0"),
        ({"nesterov": True}, "nesterov", "applies to SGD only"),
        ({"name": "adam", "dampening": 0.1}, "dampening", "applies to SGD only"),
    ],
)
def test_optimizer_settings_are_validated(settings: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        OptimizerConfig(**settings)
    assert err.value.key == key


def test_state_tensors_per_param() -> None:
    assert OptimizerConfig().state_tensors_per_param == 2
    assert OptimizerConfig(name="adam").state_tensors_per_param == 2
    assert OptimizerConfig(name="sgd").state_tensors_per_param == 1
    assert OptimizerConfig(name="sgd", momentum=0.0).state_tensors_per_param == 0
