"""Deferred construction: a model on the meta device and its values streamed into chunks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tidal
from tidal.memory.layout import plan_layout, unique_parameters
from tidal.memory.materialize import feed_chunks, materialize, values_of
from tidal.models import build_gpt, gpt_init, preset

TINY = preset("tiny")


def _job(engine: str = "chunk", **training: Any) -> dict[str, Any]:
    return {"engine": engine, "chunk": {"size": 128}, "training": {"device": "cpu", **training},
            "optimizer": {"lr": 3e-3, "warmup_steps": 2}}  # fmt: skip


def _train(engine: Any, steps: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 33), generator=g)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_gpt_values_are_what_build_gpt_gives() -> None:
    built = build_gpt(TINY, seed=7)
    meta = build_gpt(TINY, device="meta")
    values = dict(gpt_init(meta, seed=7)())
    assert values.keys() == dict(built.named_parameters()).keys()  # tied ones once
    for name, param in built.named_parameters():
        assert torch.equal(values[name], param.detach()), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("engine", ["chunk", "reference"])
def test_a_meta_model_trains_like_the_one_built_whole(engine: str, precision: str) -> None:
    whole = tidal.initialize(build_gpt(TINY, seed=3), _job(engine, precision=precision))
    model = build_gpt(TINY, device="meta")
    deferred = tidal.initialize(model, _job(engine, precision=precision), init=gpt_init(model, 3))
    assert not any(p.is_meta for p in deferred.model.parameters())
    assert deferred.model.lm_head.weight is deferred.model.tok_embed.weight  # the tie survives
    assert _train(deferred) == _train(whole)  # bit for bit


def test_frozen_parameters_stay_frozen() -> None:
    model = build_gpt(TINY, device="meta")
    model.tok_embed.weight.requires_grad_(False)
    engine = tidal.initialize(model, _job(), init=gpt_init(model, 0))
    assert not engine.model.tok_embed.weight.requires_grad
    assert engine.model.blocks[0].attn.qkv.weight.requires_grad


def test_a_meta_model_without_values_is_refused() -> None:
    with pytest.raises(ValueError, match="meta device.*init="):
        tidal.initialize(build_gpt(TINY, device="meta"), _job())


def _layout() -> tuple[nn.Module, Any]:
    model = build_gpt(TINY, device="meta")
    return model, plan_layout(unique_parameters(model), chunk_size=4096, align=1)


def test_feed_chunks_begins_and_ends_each_chunk_once_in_order_of_completion() -> None:
    model, layout = _layout()
    events: list[tuple[str, int]] = []
    feed_chunks(layout, gpt_init(model, 0)(), write=lambda i, s, v: None,
                begin=lambda i: events.append(("begin", i)),
                end=lambda i: events.append(("end", i)))  # fmt: skip
    begun = [i for kind, i in events if kind == "begin"]
    ended = [i for kind, i in events if kind == "end"]
    assert sorted(begun) == sorted(ended) == list(range(layout.num_chunks))
    for index in range(layout.num_chunks):  # a chunk ends after it begins
        assert events.index(("begin", index)) < events.index(("end", index))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (lambda v: [*v, ("nope", torch.zeros(1))], "'nope', which is not a parameter"),
        (lambda v: [*v, v[0]], "twice"),
        (lambda v: v[1:], "no value for tok_embed.weight"),
        (lambda v: [(v[0][0], torch.zeros(3)), *v[1:]], "3 elements"),
    ],
    ids=["unknown", "twice", "missing", "size"],
)
def test_a_wrong_source_is_named(values: Any, message: str) -> None:
    model, layout = _layout()
    with pytest.raises(ValueError, match=message):
        feed_chunks(layout, values(list(gpt_init(model, 0)())), write=lambda i, s, v: None)


def test_materialize_fills_every_parameter_or_names_the_missing() -> None:
    model = build_gpt(TINY, device="meta")
    materialize(model, gpt_init(model, 5), torch.device("cpu"))
    for (name, got), (_, want) in zip(values_of(model), values_of(build_gpt(TINY, seed=5)),
                                      strict=True):  # fmt: skip
        assert torch.equal(got, want), name
    partial = build_gpt(TINY, device="meta")
    with pytest.raises(ValueError, match="no value for"):
        materialize(partial, lambda: list(gpt_init(partial, 0)())[1:], torch.device("cpu"))
