"""Savers carried out in place ([Note: savers in place] in tidal/activations/apply.py): recompute
and host swap give the same training, bit for bit (fp32, CPU), on a whole model and through a
pipeline schedule; the host tier's budget holds; what cannot run is refused in one line."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tidal.activations import Saver, Stripe
from tidal.activations.apply import apply_savers, check_schedule
from tidal.config import ConfigError
from tidal.memory.tiers import Tier, TierBudgetError, TierKind
from tidal.models import build_gpt
from tidal.models.gpt import GPTConfig, split_gpt
from tidal.pipeline.schedules import make_schedule
from tidal.pipeline.split import even_ranges
from tidal.runtime.local import run_local
from tidal.runtime.pipemare import AsyncConfig, StageWeights, WeightMode

CONFIG = GPTConfig(vocab_size=64, seq_len=8, num_layers=4, num_heads=2, d_model=16)
SAVERS = {"blocks.0.attn": Saver.RECOMPUTE, "blocks.1": Saver.HOST, "blocks.2.mlp": Saver.HOST,
          "blocks.3": Saver.RECOMPUTE, "blocks.2.ln_1": Saver.KEEP}  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Module, steps: int = 3) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(*_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def test_recompute_and_host_swap_train_bit_for_bit_and_give_the_host_back() -> None:
    plain = build_gpt(CONFIG, seed=0)
    saved = copy.deepcopy(plain)
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=1 << 20)
    handles = apply_savers(saved, SAVERS, host=host)
    forwards = []  # a recomputed block enters its forward (its children too) again in backward
    saved.get_submodule("blocks.3.mlp").register_forward_pre_hook(lambda *_: forwards.append(1))
    assert handles.recomputed == ("blocks.0.attn", "blocks.3")
    assert handles.swapped == ("blocks.1", "blocks.2.mlp")
    want, got = _train(plain), _train(saved)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (want, got)
    for (name, a), b in zip(plain.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert handles.host is not None and handles.host.tensors_back >= handles.host.tensors_out > 0
    assert host.peak_bytes > 0 and host.held_bytes == 0  # every swapped tensor given back
    assert len(forwards) == 2 * 3
    swapped = handles.host.tensors_out
    handles.remove()  # the swaps stop
    _train(saved, steps=1)
    assert handles.host.tensors_out == swapped


def test_a_host_budget_too_small_is_refused_before_anything_is_copied() -> None:
    model = build_gpt(CONFIG, seed=0)
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=64)
    apply_savers(model, {"blocks.0": Saver.HOST}, host=host)
    with pytest.raises(TierBudgetError):
        model(*_batch(0))
    assert host.held_bytes == 0


def _trained(stages: list[torch.nn.Module], result: Any) -> tuple[list[torch.Tensor], list[float]]:
    return [p.detach().clone() for s in stages for p in s.parameters()], list(result.losses)


def _assert_same(got: tuple[list[torch.Tensor], list[float]],
                 want: tuple[list[torch.Tensor], list[float]]) -> None:  # fmt: skip
    """The same losses and parameters, bit for bit."""
    assert got[1] == want[1]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))


@pytest.mark.parametrize(("name", "ranks", "virtual"),
                         [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2)])  # fmt: skip
def test_savers_through_a_pipeline_equal_the_plain_pipeline(name: str, ranks: int,
                                                            virtual: int) -> None:  # fmt: skip
    def run(savers: bool) -> tuple[list[torch.Tensor], list[float]]:
        schedule = make_schedule(name, stages=ranks, microbatches=4, virtual=virtual, steps=2)
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, schedule.num_stages))
        host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
        if savers:  # the first stage (the loaded one) recomputes, the second swaps, others keep
            apply_savers(stages[0], {"layers.0": Saver.RECOMPUTE}, host=host)
            apply_savers(stages[1], {"layers.0.attn": Saver.HOST, "layers.0.mlp": Saver.RECOMPUTE},
                         host=host)  # fmt: skip
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.CURRENT)) for s in stages]  # fmt: skip
        return _trained(stages, run_local(schedule, stages, weights, _batch, lambda _: 0.5))

    _assert_same(run(True), run(False))


def test_what_cannot_run_is_one_line() -> None:
    model = build_gpt(CONFIG, seed=0)
    with pytest.raises(ConfigError, match="no submodule 'blocks.9'"):
        apply_savers(model, {"blocks.9": Saver.RECOMPUTE})
    with pytest.raises(ConfigError, match="a peer swap needs the rank it lends to"):
        apply_savers(model, {"blocks.0": Saver.PEER})
    with pytest.raises(ConfigError, match="'blocks.0' and on 'blocks.0.mlp', inside it"):
        apply_savers(model, {"blocks.0": Saver.RECOMPUTE, "blocks.0.mlp": Saver.HOST})
    with pytest.raises(ConfigError, match="host swaps need a host tier"):
        apply_savers(model, {"blocks.0": Saver.HOST})
    with pytest.raises(
        ConfigError, match="recompute runs under synchronous and stashing schedules, not 'pipemare'"
    ):
        check_schedule({"blocks.0": Saver.RECOMPUTE}, asynchronous=True, stashes=False,
                       schedule="pipemare")  # fmt: skip
    check_schedule({"blocks.0": Saver.HOST, "blocks.1": Saver.PEER}, asynchronous=True,
                   stashes=False, schedule="pipemare")  # fmt: skip
    check_schedule({"blocks.0": Saver.RECOMPUTE}, asynchronous=True, stashes=True,
                   schedule="pipedream")  # fmt: skip
    check_schedule({"blocks.0": Saver.RECOMPUTE}, asynchronous=False, stashes=False,
                   schedule="1f1b")  # fmt: skip


class _Views(torch.nn.Module):
    """Saves three views of one storage (as attention saves q, k and v) and one product."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q * k * v).sum()


def test_a_host_swap_copies_each_storage_once_and_brings_the_views_back() -> None:
    plain = _Views()
    swapped = copy.deepcopy(plain)
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    handles = apply_savers(swapped, {"": Saver.HOST}, host=host)
    x = torch.randn(4, 8)
    for model in (plain, swapped):
        model(x.requires_grad_()).backward()
    assert handles.host is not None
    # Saved: q and k (for q * k), then q * k and v: four tensors, two storages (qkv and q * k),
    # the input x (for the linear's weight gradient) a third.
    assert handles.host.tensors_out == 5 and handles.host.storages_out == 3
    assert host.peak_bytes == (4 * 24 + 4 * 8 + 4 * 8) * 4  # qkv once, not three times
    assert host.held_bytes == 0
    for a, b in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_the_backward_fetches_the_group_saved_before_the_one_it_reads() -> None:
    """[Note: host swap prefetch]: microbatches forwarded together, then their backwards (as
    1F1B's first stage runs them): each block's backward fetches the block before it in its own
    forward, the first block's the next microbatch's last block, never a block a backward
    already read."""
    plain = build_gpt(CONFIG, seed=0)
    swapped = copy.deepcopy(plain)
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    handles = apply_savers(swapped, {f"blocks.{k}": Saver.HOST for k in range(4)}, host=host)
    assert handles.host is not None
    for model in (plain, swapped):
        for step in range(2):
            losses = [model(*_batch(3 * step + m)) for m in range(3)]
            for loss in losses:
                loss.backward()
    # Per step: blocks 2, 1 and 0 of each microbatch, and block 3 of the second and the third
    # (on the CPU nothing is copied: the host tier is the device's memory).
    assert handles.host.groups_fetched == (3 * 3 + 2) * 2
    assert handles.host.storages_fetched == 0 and handles.host.storages_unread == 0
    assert host.held_bytes == 0
    for (name, a), b in zip(plain.named_parameters(), swapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize(("name", "ranks", "mode"),
                         [("gpipe", 2, WeightMode.CURRENT), ("1f1b", 2, WeightMode.CURRENT),
                          ("1f1b", 4, WeightMode.CURRENT), ("pipedream", 2, WeightMode.STASH),
                          ("pipedream", 4, WeightMode.STASH), ("pipemare", 2, WeightMode.CURRENT),
                          ("pipemare", 4, WeightMode.CURRENT)])  # fmt: skip
def test_lending_and_host_swap_equal_the_plain_pipeline(name: str, ranks: int,
                                                        mode: WeightMode) -> None:  # fmt: skip
    """Under asynchronous schedules too: a swap hands the parameters its submodule saves to the
    stage's weight-version redirection, so the backward sees the weights it would have."""
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending

    def run(lend: bool) -> tuple[tuple[list[torch.Tensor], list[float]], Any]:
        schedule = make_schedule(name, stages=ranks, microbatches=4, steps=2)
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, ranks))
        lending, swaps = None, {}
        if lend:  # stage 0 lends its first block's attention striped over rank 1 and the
            # last (a quarter and three quarters: [Note: stripes]), its MLP to rank 1, so rank 1's
            # message carries shares of two bundles; stage 1 (with 4 ranks) its whole first
            # block to the last rank
            swaps = {0: PeerSwap(), 1: PeerSwap()}
            last = ranks - 1
            stripe = Stripe(lenders=(1, last), weights=(1.0, 3.0)) if last != 1 else _to(1)
            apply_savers(stages[0], {"layers.0.attn": Saver.PEER, "layers.0.mlp": Saver.PEER},
                         peer=swaps[0], lenders={"layers.0.attn": stripe, "layers.0.mlp": _to(1)})  # fmt: skip
            lenders = {0: (1, last) if last != 1 else (1,)}
            if ranks > 2:
                apply_savers(stages[1], {"layers.0": Saver.PEER}, peer=swaps[1],
                             lenders={"layers.0": _to(last)})  # fmt: skip
                lenders[1] = (last,)
            lending = Lending(lenders=lenders, swaps=swaps)
            host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
            apply_savers(stages[ranks - 1], {"layers.0": Saver.HOST}, host=host)
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=mode)) for s in stages]  # fmt: skip
        result = run_local(schedule, stages, weights, _batch, lambda _: 0.5, lending=lending)
        return _trained(stages, result), (result, swaps)

    lent, (result, swaps) = run(True)
    _assert_same(lent, run(False)[0])
    assert swaps[0].storages_lent > 0 and result.peak_held_bytes[ranks - 1] > 0
    assert result.peak_held_bytes[0] == 0  # the first rank lends, holds nothing
    assert result.peak_held_bytes[1] > 0  # a lender of both of stage 0's units


@pytest.mark.parametrize(("name", "ranks", "mode"),
                         [("gpipe", 2, WeightMode.CURRENT), ("1f1b", 2, WeightMode.CURRENT),
                          ("1f1b", 4, WeightMode.CURRENT), ("pipedream", 4, WeightMode.STASH),
                          ("pipemare", 4, WeightMode.CURRENT)])  # fmt: skip
def test_lending_to_earlier_ranks_equals_the_plain_pipeline(name: str, ranks: int,
                                                            mode: WeightMode) -> None:  # fmt: skip
    """[Note: lending]'s earlier lenders: the last stage (the head's logits) lends its block to
    rank 0; with 4 ranks stage 2 also lends its attention striped over ranks 0 and 1 and its MLP
    to rank 3 (later and earlier lenders at once). Bit for bit, every lender held bytes."""
    lent = {ranks - 1: {"layers.0": _to(0)}}
    if ranks > 2:
        lent[2] = {"layers.0.attn": Stripe(lenders=(0, 1), weights=(1.0, 1.0)),
                   "layers.0.mlp": _to(3)}  # fmt: skip
    held = _lent_equals_plain(make_schedule(name, stages=ranks, microbatches=4, steps=2),
                              ranks, lent, AsyncConfig(weights=mode))  # fmt: skip
    assert all(held[r] > 0 for r in ((0, 1, 3) if ranks > 2 else (0,))), held


def test_lending_under_virtual_stages_equals_the_plain_pipeline() -> None:
    """[Note: lending] with 2 chunks on 2 ranks: stage 0 lends to rank 1, stage 1 back to rank 0
    (held at stage 2, the next chunk), stage 2 to rank 1; bit for bit, both ranks hold bytes."""
    schedule = make_schedule("interleaved", stages=2, microbatches=4, virtual=2, steps=2)
    lent = {0: {"layers.0": _to(1)}, 1: {"layers.0.attn": _to(0)}, 2: {"layers.0": _to(1)}}
    held = _lent_equals_plain(schedule, 4, lent, AsyncConfig())
    assert held[0] > 0 and held[1] > 0, held


def _lent_equals_plain(schedule: Any, num_stages: int, lent: dict[int, dict[str, Stripe]],
                       config: AsyncConfig) -> list[int]:  # fmt: skip
    """Train ``schedule`` with ``lent[s]`` (per stage, each unit it lends and its stripe) and
    without; assert the two bit for bit and that every lending stage lent; each rank's most
    bytes held for others."""
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending

    def run(lend: bool) -> tuple[tuple[list[torch.Tensor], list[float]], Any]:
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, num_stages))
        lending, swaps = None, {}
        if lend:
            for s, units in lent.items():
                swaps[s] = PeerSwap()
                apply_savers(stages[s], dict.fromkeys(units, Saver.PEER), peer=swaps[s],
                             lenders=units)  # fmt: skip
            lenders = {s: tuple(sorted({r for stripe in units.values() for r in stripe.lenders}))
                       for s, units in lent.items()}  # fmt: skip
            lending = Lending(lenders=lenders, swaps=swaps)
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5), config)
                   for s in stages]  # fmt: skip
        result = run_local(schedule, stages, weights, _batch, lambda _: 0.5, lending=lending)
        return _trained(stages, result), (result, swaps)

    trained, (result, swaps) = run(True)
    _assert_same(trained, run(False)[0])
    assert all(swap.storages_lent > 0 for swap in swaps.values())
    return list(result.peak_held_bytes)


def _to(lender: int) -> Stripe:
    return Stripe(lenders=(lender,), weights=(1.0,))


def test_a_stripe_splits_its_bytes_by_its_links_exactly() -> None:
    """[Note: stripes]: the shares sum to the bytes, follow the weights, and a remainder goes to
    the largest fractions; the planner's held bytes and the runtime's messages both use it."""
    assert Stripe(lenders=(1, 2), weights=(1.0, 3.0)).split(100) == (25, 75)
    assert Stripe(lenders=(1, 2, 3), weights=(1.0, 1.0, 1.0)).split(100) == (34, 33, 33)
    assert Stripe(lenders=(5,), weights=(2.0,)).split(7) == (7,)
    for num_bytes in (0, 1, 2, 63, 4097):
        assert sum(Stripe(lenders=(1, 2, 3), weights=(1.0, 2.5, 0.5)).split(num_bytes)) == num_bytes
    with pytest.raises(ConfigError, match="one link per lender"):
        Stripe(lenders=(1, 2), weights=(1.0, 0.0))


@pytest.mark.parametrize("ranks", [2, 4])
def test_recompute_under_pipedream_runs_on_the_stashed_version(ranks: int) -> None:
    """Recompute runs the forward again inside the backward: under PipeDream it must run on the
    version that forward used (the stage's stash), not on the weights updated since."""

    def run(savers: bool, *, stashed: bool = True) -> tuple[list[torch.Tensor], list[float]]:
        schedule = make_schedule("pipedream", stages=ranks, microbatches=4, steps=3)
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, ranks))
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.STASH)) for s in stages]  # fmt: skip
        if savers:
            for s in range(ranks - 1):  # the loaded stages recompute every block
                context = weights[s].forward_weights if stashed else None
                apply_savers(stages[s], {f"layers.{k}": Saver.RECOMPUTE
                                         for k in range(len(stages[s].layers))},
                             recompute_context=context)  # fmt: skip
        return _trained(stages, run_local(schedule, stages, weights, _batch, lambda _: 0.5))

    plain = run(False)
    _assert_same(run(True), plain)
    _, live_losses = run(True, stashed=False)  # on the live weights: another computation
    assert live_losses[1:] != plain[1][1:]


def test_a_recompute_cannot_find_weights_pipemare_did_not_keep() -> None:
    stage = split_gpt(build_gpt(CONFIG, seed=0), [(0, 4)])[0]
    weights = StageWeights(stage, torch.optim.SGD(stage.parameters(), lr=0.5),
                           AsyncConfig(weights=WeightMode.CURRENT))  # fmt: skip
    with weights.forward(0):
        loss = stage(*_batch(0))
    weights.step(lr=0.5, step=0)  # an update between the forward and its backward
    with weights.backward(0), pytest.raises(RuntimeError, match="does not keep"):  # noqa: SIM117
        with weights.forward_weights():
            pass
    del loss


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipedream_stashes_on_the_host_train_as_on_the_device(ranks: int) -> None:
    """[Note: stashes on the host] in tidal/runtime/weights.py: PipeDream's weight versions in
    the host tier give the same training bit for bit, with recompute reading them too, and
    every copy is given back once no microbatch needs it."""

    def run(host: Tier | None) -> tuple[list[torch.Tensor], list[float]]:
        schedule = make_schedule("pipedream", stages=ranks, microbatches=4, steps=3)
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, ranks))
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.STASH)) for s in stages]  # fmt: skip
        for s in range(ranks - 1):  # the loaded stages: stashes and recomputes
            apply_savers(stages[s], {"layers.0": Saver.RECOMPUTE},
                         recompute_context=weights[s].forward_weights)  # fmt: skip
            if host is not None:
                weights[s].stash_to(host)
        return _trained(stages, run_local(schedule, stages, weights, _batch, lambda _: 0.5))

    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    on_device = run(None)
    _assert_same(run(host), on_device)
    stage_bytes = sum(p.numel() * 4 for p in split_gpt(build_gpt(CONFIG, seed=0),
                                                        even_ranges(4, ranks))[0].parameters())  # fmt: skip
    assert host.peak_bytes >= stage_bytes  # at least the first stage's one version waited there
    assert host.held_bytes == 0  # and was given back


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 1), (4, 1), (4, 4)])
def test_pipedream_stashes_on_a_peer_train_as_on_the_device(ranks: int, microbatches: int) -> None:
    """[Note: stashes on a peer] in tidal/runtime/weights.py: every stage but the last sends
    each forward's weight version to the last rank with the microbatch's lent bytes (stage 0's
    first block too, and recomputes read the version); bit for bit the same training, no stage
    keeps a stashed copy (the plain run does), and the lender held the versions."""
    from tidal.activations.runtime import PeerSwap
    from tidal.pipeline.lending import Lending

    schedule = make_schedule("pipedream", stages=ranks, microbatches=microbatches,
                             steps=12 // microbatches)  # fmt: skip
    last = ranks - 1

    def run(lend: bool) -> tuple[tuple[list[torch.Tensor], list[float]], Any, int]:
        stages = split_gpt(build_gpt(CONFIG, seed=0), even_ranges(4, ranks))
        weights = [StageWeights(s, torch.optim.SGD(s.parameters(), lr=0.5),
                                AsyncConfig(weights=WeightMode.STASH)) for s in stages]  # fmt: skip
        swaps = {s: PeerSwap() for s in range(last)}
        for s in range(1, last):
            apply_savers(stages[s], {"layers.0": Saver.RECOMPUTE},
                         recompute_context=weights[s].forward_weights)  # fmt: skip
        if lend:
            apply_savers(stages[0], {"layers.0": Saver.PEER}, peer=swaps[0],
                         lenders={"layers.0": _to(last)})  # fmt: skip
            for s in range(last):
                weights[s].lend_with(lambda params, swap=swaps[s]: swap.lend(params, _to(last)))
        stashed = [0]

        def lr(_: int) -> float:  # called at every update, before it stashes
            stashed[0] = max(stashed[0], *(w.stashed_bytes for w in weights[:last]))
            return 0.5

        lending = (
            Lending(lenders=dict.fromkeys(range(last), (last,)), swaps=swaps) if lend else None
        )
        result = run_local(schedule, stages, weights, _batch, lr, lending=lending)
        return _trained(stages, result), result, stashed[0]

    lent, result, stashed = run(True)
    plain, _, stashed_plain = run(False)
    _assert_same(lent, plain)
    assert stashed == 0 and stashed_plain > 0
    stage_bytes = sum(p.numel() * 4 for p in split_gpt(build_gpt(CONFIG, seed=0),
                                                        even_ranges(4, ranks))[0].parameters())  # fmt: skip
    assert result.peak_held_bytes[last] >= stage_bytes  # stage 0's version, held on the lender
    assert result.peak_held_bytes[0] == 0


def test_a_stash_over_the_host_budget_is_refused_before_it_is_copied() -> None:
    stage = split_gpt(build_gpt(CONFIG, seed=0), [(0, 4)])[0]
    weights = StageWeights(stage, torch.optim.SGD(stage.parameters(), lr=0.5),
                           AsyncConfig(weights=WeightMode.STASH))  # fmt: skip
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=256)
    weights.stash_to(host)
    with weights.forward(0):
        loss = stage(*_batch(0))
    with pytest.raises(TierBudgetError):  # the update must keep version 0 for microbatch 0
        weights.step(lr=0.5, step=0)
    assert host.held_bytes <= 256
    del loss


def test_only_pipedream_stashes_go_to_the_host() -> None:
    stage = split_gpt(build_gpt(CONFIG, seed=0), [(0, 4)])[0]
    host = Tier(TierKind.HOST, torch.device("cpu"), budget_bytes=None)
    for mode in (WeightMode.TWO_VERSIONS, WeightMode.CURRENT):
        weights = StageWeights(stage, torch.optim.SGD(stage.parameters(), lr=0.5),
                               AsyncConfig(weights=mode, microbatches_per_update=4))  # fmt: skip
        with pytest.raises(ValueError, match="only PipeDream's stashed versions wait on the host"):
            weights.stash_to(host)
