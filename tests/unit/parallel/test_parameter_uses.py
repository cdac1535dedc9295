"""Every use of a chunked parameter, whatever its residency ([Note: parameter uses]).

Before parameters knew their chunk, reading one whose chunk was off the device ran the kernel on
a 0-byte storage: element-wise ops and reductions killed the process (SIGSEGV), and
``torch.save(model.state_dict())`` wrote empty storages. The op-family test runs in a
subprocess so that a signal fails it instead of ending the test session.
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tidal.memory.config import ChunkConfig
from tidal.memory.uses import ChunkParameter, ParameterUseError
from tidal.models import build_gpt, preset
from tidal.parallel.chunk_engine import ChunkEngine
from tidal.parallel.config import MemoryConfig
from tidal.train import OptimizerConfig, ReferenceEngine, TrainingConfig

TINY = preset("tiny")


def _batches(num: int, seq_len: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 256, (2, seq_len + 1), generator=g) for _ in range(num)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _engine(*, budget: int | None = None, precision: str = "fp32", seed: int = 0) -> ChunkEngine:
    return ChunkEngine(
        build_gpt(TINY, seed=seed),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, weight_decay=0.1),
        training=TrainingConfig(device="cpu", precision=precision),
        memory=MemoryConfig(device_budget=budget),
        chunk=ChunkConfig(size=1024),
    )


def _minimum(precision: str = "fp32") -> int:
    probe = _engine(precision=precision)
    for inputs, targets in _batches(2):
        probe.backward(probe(inputs, targets))
        probe.step()
    return probe.stats()["min_device_bytes"]


_OP_FAMILIES = textwrap.dedent(
    """
    import io, json, sys, torch
    sys.path.insert(0, {tests!r})
    from test_parameter_uses import _batches, _engine, _minimum

    precision = sys.argv[1]
    engine = _engine(budget=_minimum(precision), precision=precision)
    for inputs, targets in _batches(2):
        engine.backward(engine(inputs, targets))
        engine.step()
    store = engine.store
    name, param = next((n, p) for n, p in engine.model.named_parameters()
                       if not store.on_device(p) and p.dim() == 2)
    master = engine.read_parameter(param)  # full precision
    weights = master.to(param.dtype)  # what the model computes with
    ops = {{
        "element-wise": (lambda: param * 2, lambda: weights * 2),
        "abs": (lambda: param.abs(), lambda: weights.abs()),
        "reduction": (lambda: param.sum(), lambda: weights.sum()),
        "norm": (lambda: param.norm(), lambda: weights.norm()),
        "clone": (lambda: param.clone(), lambda: weights),
        "view": (lambda: param.view(-1), None),
        "detach": (lambda: param.detach(), None),
        "data": (lambda: param.data, None),
        "index": (lambda: param[0], None),
        "torch.save(p.detach())": (lambda: torch.save(param.detach(), io.BytesIO()), None),
        "in-place": (lambda: param.add_(0.0), lambda: weights),
        "set .data": (lambda: setattr(param, "data", torch.zeros(3)), None),
    }}
    results = {{"name": name}}
    for key, (op, want) in ops.items():
        store.evict_unpinned()  # off the device again before each op
        try:
            with torch.no_grad():
                got = op()
        except Exception as err:
            results[key] = ["error", type(err).__name__, str(err)]
            continue
        same = want is not None and torch.equal(got.clone(), want())
        results[key] = ["value", bool(same)]
    saved = io.BytesIO()
    torch.save(param, saved)
    saved.seek(0)
    results["torch.save(p)"] = ["value", torch.equal(torch.load(saved), master)]
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_op_family_on_an_evicted_parameter_is_safe(tmp_path, precision: str) -> None:
    """Reads give the weights, aliasing views and unsafe writes raise one clear error: never a
    signal, never garbage."""
    tests = str(__import__("pathlib").Path(__file__).resolve().parent)
    script = _OP_FAMILIES.format(tests=tests)
    done = subprocess.run(
        [sys.executable, "-c", script, precision], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    results = json.loads(done.stdout.strip().splitlines()[-1])
    name = results.pop("name")
    reads = ["element-wise", "abs", "reduction", "norm", "clone", "torch.save(p)"]
    for key in reads:
        assert results[key] == ["value", True], (key, results[key])
    for key in ("view", "detach", "data", "index", "torch.save(p.detach())", "set .data"):
        kind, error, message = results[key]
        assert (kind, error) == ("error", "ParameterUseError"), (key, results[key])
        assert name in message, (key, message)
        assert "copy" in message, (key, message)
    if precision == "fp32":  # the slot is the weights: in place is fine
        assert results["in-place"] == ["value", True]
    else:  # the fp32 master is: a write to the bf16 copy would be lost at the next step
        kind, error, message = results["in-place"]
        assert error == "ParameterUseError" and "copy_" in message and "master" in message


def test_metadata_reads_fetch_nothing() -> None:
    engine = _engine(budget=_minimum())
    for inputs, targets in _batches(2):
        engine.backward(engine(inputs, targets))
        engine.step()
    param = next(p for p in engine.model.parameters() if not engine.store.on_device(p))
    fetches = engine.store.num_fetches
    assert isinstance(param, ChunkParameter) and isinstance(param, nn.Parameter)
    facts = (param.dtype, param.shape, param.device, param.requires_grad, param.size(0))
    assert facts == (torch.float32, param.shape, torch.device("cpu"), True, param.shape[0])
    assert param.dim() == 2 and param.numel() > 0 and param.grad is None
    assert engine.store.num_fetches == fetches and not engine.store.on_device(param)


class _PenalisedGPT(nn.Module):
    """A GPT whose loss adds an L2 penalty over every parameter, computed after the model's
    forward has returned (the issue's first segfault)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = build_gpt(TINY, seed=0)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt(inputs, targets)


def _penalised(engine, batches) -> list[float]:
    losses = []
    for inputs, targets in batches:
        loss = engine(inputs, targets)
        penalty = sum(p.pow(2).sum() for p in engine.model.parameters())
        total = loss + 1e-4 * penalty
        engine.backward(total)
        engine.step()
        losses.append(total.item())
    return losses


def test_a_penalty_over_all_parameters_after_the_forward_trains_like_the_reference() -> None:
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=0)
    reference = ReferenceEngine(
        _PenalisedGPT(), optimizer=optimizer, training=TrainingConfig(device="cpu")
    )
    want = _penalised(reference, _batches(4))

    def chunk(budget: int | None) -> ChunkEngine:
        return ChunkEngine(
            _PenalisedGPT(),
            optimizer=optimizer,
            training=TrainingConfig(device="cpu"),
            memory=MemoryConfig(device_budget=budget),
            chunk=ChunkConfig(size=1024),
        )

    probe = chunk(None)
    assert _penalised(probe, _batches(4)) == want
    budget = probe.stats()["min_device_bytes"]
    tight = chunk(budget)
    assert _penalised(tight, _batches(4)) == want
    stats = tight.stats()
    assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= budget
    labels = [m.label for m in tight.store.trace.moments]
    assert any(label.startswith("fn:") for label in labels)  # the penalty's reads are moments


def _trained(budget: int | None, precision: str = "fp32") -> ChunkEngine:
    engine = _engine(budget=budget, precision=precision)
    for inputs, targets in _batches(3):
        engine.backward(engine(inputs, targets))
        engine.step()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_users_torch_save_of_the_state_dict_reloads(precision: str) -> None:
    budget = _minimum(precision)
    engine = _trained(budget, precision)
    on_host = [p for p in engine.model.parameters() if not engine.store.on_device(p)]
    assert len(on_host) > 5  # mid-training under a budget: most parameters are off the device
    saved = io.BytesIO()
    torch.save(engine.model.state_dict(), saved)
    saved.seek(0)
    fresh = build_gpt(TINY, seed=1)
    fresh.load_state_dict(torch.load(saved))
    want = engine.model_state_dict()  # the weights at full precision
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, want[name]), name
    if precision == "fp32":  # the same model on the same CPU: the same logits
        inputs, targets = _batches(1, seq_len=16)[0]
        with torch.no_grad():
            assert torch.equal(fresh(inputs, targets), engine(inputs, targets))


def test_load_state_dict_and_copy_write_through_to_the_masters() -> None:
    engine = _trained(_minimum("bf16"), "bf16")
    source = build_gpt(TINY, seed=7).state_dict()
    engine.model.load_state_dict(source)  # copy_ into parameters, most of them on the host
    got = engine.model_state_dict()
    for name, value in source.items():
        assert torch.equal(got[name], value), name  # the fp32 masters took the values exactly
    twin = _engine(precision="bf16", seed=7)
    inputs, targets = _batches(1, seq_len=16)[0]
    with torch.no_grad():
        assert torch.equal(engine(inputs, targets), twin(inputs, targets))
    with pytest.raises(ParameterUseError, match="assign=False"):
        engine.model.load_state_dict(source, assign=True)


def test_deepcopy_gives_a_plain_model_with_the_weights() -> None:
    engine = _trained(_minimum())
    twin = copy.deepcopy(engine.model)
    assert not any(isinstance(p, ChunkParameter) for p in twin.parameters())
    want = engine.model_state_dict()
    for name, value in twin.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert twin.tok_embed.weight is twin.lm_head.weight or not TINY.tie_embeddings
    fetches = engine.store.num_fetches
    inputs, targets = _batches(1, seq_len=16)[0]
    with torch.no_grad():  # the copy runs on its own weights: the engine's hooks stayed behind
        assert torch.equal(twin(inputs, targets), engine(inputs, targets))
        assert engine.store.num_fetches > fetches  # the engine's own forward did fetch
        fetches = engine.store.num_fetches
        twin(inputs, targets)
    assert engine.store.num_fetches == fetches


class _ReadsItsWeightsDtype(nn.Module):
    """Like Hugging Face ViT and T5: a parent's forward reads a child's ``weight.dtype`` and
    ``.shape``; its modules are also built out of order, so relayout has work to do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 64)
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).to(self.body.weight.dtype)
        assert h.shape[-1] == self.body.weight.shape[1]
        logits = self.head(torch.tanh(self.body(h)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_attribute_reads_are_not_uses() -> None:
    torch.manual_seed(0)
    engine = ChunkEngine(
        _ReadsItsWeightsDtype(),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0),
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=1024),
    )
    before = engine.layout
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "relayout skipped" would fail here
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
    labels = [m.label for m in engine.store.trace.moments]
    assert not any(label.startswith(("fn:", "unpack:")) for label in labels), labels
    assert engine.layout != before  # relayout ran: embed first, head last
    first = engine.layout.chunks[0].slots[0].names[0]
    assert first == "embed.weight", first


class _ConvertsItsRouter(nn.Module):
    """Like Hugging Face Switch Transformers' router: ``module.to(dtype)`` in the forward, with
    the dtype the module already has, which torch carries out as ``p.data = p``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.router = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.router = self.router.to(torch.float32)
        logits = self.router(self.embed(ids))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_converting_a_module_to_its_own_dtype_is_a_no_op() -> None:
    def train(engine) -> list[float]:
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    optimizer = OptimizerConfig(lr=1e-2, warmup_steps=0)
    torch.manual_seed(0)
    want = train(ReferenceEngine(_ConvertsItsRouter(), optimizer=optimizer,
                                 training=TrainingConfig(device="cpu")))  # fmt: skip
    torch.manual_seed(0)
    engine = ChunkEngine(
        _ConvertsItsRouter(),
        optimizer=optimizer,
        training=TrainingConfig(device="cpu"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=1024),
    )
    assert train(engine) == want
    with torch.no_grad(), pytest.raises(ParameterUseError, match="cut it from its chunk"):
        engine.model.router.weight.data = torch.zeros(64, 32)  # another tensor: refused


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(images))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), labels)


def test_floating_inputs_meet_bf16_weights() -> None:
    """A CNN's fp32 images meet bf16 weights: the engine's forward runs under autocast, which
    casts them where they meet the weights and keeps the loss in fp32, as the reference does;
    BatchNorm's statistics are in the weights' dtype, which its kernel needs."""
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    optimizer = OptimizerConfig(lr=1e-2, warmup_steps=0)
    torch.manual_seed(0)
    reference = ReferenceEngine(
        _SmallCNN(), optimizer=optimizer, training=TrainingConfig(device="cpu", precision="bf16")
    )
    torch.manual_seed(0)
    engine = ChunkEngine(
        _SmallCNN(),
        optimizer=optimizer,
        training=TrainingConfig(device="cpu", precision="bf16"),
        memory=MemoryConfig(),
        chunk=ChunkConfig(size=256),
    )
    for _ in range(3):
        want, got = reference(images, labels), engine(images, labels)
        assert got.dtype == want.dtype == torch.float32
        assert got.item() == pytest.approx(want.item(), rel=2e-2)
        for e, loss in ((reference, want), (engine, got)):
            e.backward(loss)
            e.step()
    assert not torch.equal(engine.model.norm.running_mean, torch.zeros(8))  # BatchNorm ran
