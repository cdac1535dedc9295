"""The cost model of MPress's savers: what a choice per saved tensor makes each rank hold and add.

Pure: the inputs are plain numbers (what each block saves per microbatch and how many copies the
schedule keeps live, the ranks' budgets, the links); :func:`evaluate` prices one choice per saved
tensor as a :class:`SaverPlan` (what each rank then holds, lent bytes included, and what the
savers add to a step). The planners (``greedy.py``, ``exact.py``, chosen between by
``plan.py``) search over choices with these prices and nothing else, so both price a choice
alike. Nothing here touches a tensor or a process group.

[Note: saver costs]
A pipeline leaves memory imbalanced: under 1F1B stage s keeps p - s microbatches' activations
while the last stage keeps one, so the first ranks overflow while the last have room to lend.
Per saved tensor (a :class:`Saved`: one class of one block of one stage), with ``n`` uses per
step (microbatches) and ``c`` copies live at the stage's peak:

    keep       the rank holds c x bytes; costs nothing
    recompute  (activations only) the rank keeps what the recompute starts from (c x
               ``recompute_keeps_bytes``: the inputs of the submodule run again; 0 where that
               is an item of its own, a block's input) and runs the forward again in its
               backward: n x recompute_s added to the rank's backward
    host swap  out after the last forward use, back before the first backward use, over the rank's
               host link (its bandwidth split evenly among the ranks behind it that host-swap
               anything: a rank that swaps nothing takes none of it): each use costs 2 x bytes /
               bandwidth, of which the idle window between those uses hides idle_s; the host
               holds c x bytes
    peer swap  the same over the links to one or more lender ranks (a stripe), which hold the
               c x bytes in their own budgets, split in proportion to their links' bandwidths
               so that every part arrives at once: a use costs 2 x bytes / the stripe's
               bandwidth (the sum of its links', at most what the rank sends at once,
               ``Links.peer_egress``), less its idle window as a host swap's does

A tensor that is not kept is back on its rank for its block's backward, one block at a time: a
rank holds, beside what it keeps, the largest single copy of what it does not keep (:func:`transient_bytes`);
where host swaps fetch the next block's copy ahead (``Links.host_prefetch``, on CUDA), also its
largest host-swapped copy.
A step then takes the schedule's step time plus the added seconds of the slowest rank (each
rank's savers lengthen its own backward, and the pipeline runs at its slowest stage); the
planners minimise that.

[Note: stripes]
A peer swap may split a tensor over several lenders (MPress sends over several NVLinks at
once). Two things a stripe buys: time, where a rank's links to its peers are separate (a
DGX-1's hybrid cube mesh: one or two 25 GB/s NVLinks to each of four peers, 150 GB/s in all),
and room, where no one lender has spare enough for a tensor that several together have (on
an NVSwitch every pair already gets the whole of a rank's links: no time, only room). Every
subset of lenders would be an option, exponential in the ranks; the options are each linked
lender alone and, per k >= 2, the k fastest (ties to the later stage's rank: under every
schedule tidal runs a later stage keeps fewer copies, so it has the room), which covers both:
more links is faster, and the k most likely to have room come first. The lenders' shares are
fixed by the links (:class:`Stripe`), so the planners price a stripe as they price one lender.
The model does not charge a lender's link for what two borrowers send it at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.config import require

__all__ = [
    "Choice",
    "Links",
    "Saved",
    "Saver",
    "SaverPlan",
    "Stripe",
    "TensorClass",
    "evaluate",
    "host_ranks",
    "host_users",
    "keep_all",
    "least_peak_bytes",
    "lent_shares",
    "microbatches_per_step",
    "price_s",
    "saver_options",
    "transient_bytes",
    "transient_bytes_per_rank",
]


class TensorClass(enum.StrEnum):
    BLOCK_INPUT = "block_input"  # what a recompute starts from: never recomputed itself
    ATTENTION = "attention"
    MLP = "mlp"
    NORM = "norm"
    OTHER = "other"  # what a block-less unit saves (an embedding's output, a head's logits)
    WEIGHTS = "weights"  # a stashed weight version (PipeDream, 2BW): never recomputed


class Saver(enum.StrEnum):
    KEEP = "keep"
    RECOMPUTE = "recompute"
    HOST = "host"
    PEER = "peer"


@dataclass(kw_only=True, frozen=True, slots=True)
class Saved:
    """One class of tensors one block of one stage saves ([Note: saver costs]): the bytes of one
    copy, the copies live at the stage's peak, its uses per step, the seconds to recompute one
    copy (None: it cannot be, as block inputs and weight versions), and the shortest window
    between a copy's last forward use and first backward use."""

    stage: int
    block: int
    tensor_class: TensorClass
    num_bytes: int
    copies: int
    uses_per_step: int
    recompute_s: float | None
    idle_s: float = 0.0
    path: str = ""  # the submodule of its stage that saves it, where training carries it out
    recompute_keeps_bytes: int = 0  # of one copy: the inputs a recompute of it starts from
    fixed: bool = False  # saved outside every submodule a saver wraps (a loss): always kept
    # the copies a lender holds of it, where that is not ``copies``: a stashed weight version
    # leaves with its forward's microbatch, so a lender holds one per microbatch in flight
    # ([Note: stashes on a peer] in tidal/runtime/weights.py)
    copies_lent: int | None = None

    def __post_init__(self) -> None:
        require(self.num_bytes >= 0 and self.copies >= 0 and self.uses_per_step >= 0,
                "saved tensors", f"bytes, copies and uses must be >= 0: {self}")  # fmt: skip
        require(0 <= self.recompute_keeps_bytes <= self.num_bytes, "saved tensors",
                f"a recompute keeps at most what is saved: {self}")  # fmt: skip
        require(self.copies_lent is None or self.copies_lent >= 0, "saved tensors",
                f"copies lent must be >= 0: {self}")  # fmt: skip
        if self.fixed or self.tensor_class in (TensorClass.BLOCK_INPUT, TensorClass.WEIGHTS):
            require(self.recompute_s is None, "saved tensors",
                    f"{self.tensor_class} cannot be recomputed: {self}")  # fmt: skip

    @property
    def held_bytes(self) -> int:
        return self.num_bytes * self.copies

    def held_under(self, saver: Saver) -> int:
        """What its rank holds of it under ``saver`` (lent and hosted bytes are elsewhere)."""
        if saver is Saver.KEEP:
            return self.held_bytes
        return self.recompute_keeps_bytes * self.copies if saver is Saver.RECOMPUTE else 0


@dataclass(kw_only=True, frozen=True, slots=True)
class Links:
    """Where stages run and what connects the ranks: per rank its budget, the bytes no saver
    moves (model data, communication buffers) and its host link; per host link its bandwidth
    (bytes/s each way) and the bytes the host may hold for it (None: no limit); per pair of
    ranks the peer bandwidth (0: no link)."""

    stage_rank: tuple[int, ...]
    budget_bytes: tuple[int, ...]
    base_bytes: tuple[int, ...]
    host_link: tuple[int, ...]
    host_bandwidth: tuple[float, ...]
    host_budget_bytes: tuple[int | None, ...]
    peer_bandwidth: tuple[tuple[float, ...], ...]
    # per rank, the most bytes/s it sends to (or takes from) its peers at once (None: the sum of
    # its links; an NVSwitch gives one pair all of a rank's links: a stripe is then no faster)
    peer_egress: tuple[float, ...] | None = None
    # Host swaps fetch the next group back while a backward reads one ([Note: host swap
    # prefetch] in runtime.py): a rank then also holds its largest host-swapped item.
    host_prefetch: bool = False
    max_stripe: int | None = None  # the most lenders a tensor is split over (None: every linked)
    # per stage, the ranks it may lend to (None: every linked rank): a lender holds a stage's
    # bytes from one of its own later stages' forward to its backward ([Note: lending] in
    # tidal/pipeline/lending.py), so with virtual stages it depends on the stage, not the rank
    stage_lenders: tuple[tuple[int, ...], ...] | None = None
    # derived once from the fields above: per stage, the lenders of each peer option, and each
    # stripe's shares of a size ([Note: stripes]; the planners ask for them millions of times)
    _peer_options: tuple[tuple[tuple[int, ...], ...], ...] = field(init=False, repr=False,
                                                                   compare=False)  # fmt: skip
    _shares: dict[tuple[int, tuple[int, ...], int], tuple[int, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        n = len(self.budget_bytes)
        require(len(self.base_bytes) == n and len(self.host_link) == n, "links",
                f"one budget, base and host link per rank: {n} budgets")  # fmt: skip
        require(all(0 <= r < n for r in self.stage_rank), "links",
                f"stages mapped to ranks {self.stage_rank}, but there are {n} ranks")  # fmt: skip
        require(len(self.peer_bandwidth) == n and all(len(row) == n for row in self.peer_bandwidth),
                "links", f"the peer bandwidth matrix must be {n} x {n}")  # fmt: skip
        links = len(self.host_bandwidth)
        require(all(0 <= h < links for h in self.host_link) and len(self.host_budget_bytes) == links,
                "links", f"host links {self.host_link} outside the {links} given")  # fmt: skip
        require(self.peer_egress is None or (len(self.peer_egress) == n
                                              and all(e > 0 for e in self.peer_egress)),
                "links", f"one positive peer egress per rank: {self.peer_egress}")  # fmt: skip
        require(self.max_stripe is None or self.max_stripe >= 1, "links",
                f"a stripe has at least one lender, not {self.max_stripe}")  # fmt: skip
        stages = len(self.stage_rank)
        require(self.stage_lenders is None or (len(self.stage_lenders) == stages and all(
                    0 <= r < n for lenders in self.stage_lenders for r in lenders)),
                "links", f"one tuple of lender ranks below {n} per stage ({stages})")  # fmt: skip
        object.__setattr__(self, "_peer_options", tuple(self._stripes_of(s) for s in range(stages)))

    def _stripes_of(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """``stage``'s peer options: each linked lender it may lend to alone, then the k fastest
        together, ties to the later stage's rank ([Note: stripes])."""
        rank = self.stage_rank[stage]
        last_stage = {r: s for s, r in enumerate(self.stage_rank)}
        row = self.peer_bandwidth[rank]
        allowed = range(self.num_ranks) if self.stage_lenders is None else self.stage_lenders[stage]
        linked = sorted((r for r in allowed if r != rank and row[r] > 0),
                        key=lambda r: (-row[r], -last_stage.get(r, -1), -r))  # fmt: skip
        widest = len(linked) if self.max_stripe is None else min(len(linked), self.max_stripe)
        return (*((r,) for r in sorted(linked)),
                *(tuple(sorted(linked[:k])) for k in range(2, widest + 1)))  # fmt: skip

    def peer_options(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """The lenders of each peer swap ``stage`` may make."""
        return self._peer_options[stage]

    def shares(self, rank: int, lenders: tuple[int, ...], num_bytes: int) -> tuple[int, ...]:
        """What each of ``lenders`` holds of ``num_bytes`` ``rank`` lends them."""
        key = (rank, lenders, num_bytes)
        if key not in self._shares:
            self._shares[key] = self.stripe(rank, lenders).split(num_bytes)
        return self._shares[key]

    @property
    def num_ranks(self) -> int:
        return len(self.budget_bytes)

    def sharers(self, link: int) -> int:
        return sum(1 for h in self.host_link if h == link)

    def stripe(self, rank: int, lenders: tuple[int, ...]) -> Stripe:
        """How ``rank``'s peer swaps to ``lenders`` split ([Note: stripes])."""
        return Stripe(lenders=lenders, weights=tuple(self.peer_bandwidth[rank][r] for r in lenders))

    def stripe_bandwidth(self, rank: int, lenders: tuple[int, ...]) -> float:
        """Bytes/s a peer swap from ``rank`` to ``lenders`` moves: its links', at most the
        rank's egress."""
        total = sum(self.peer_bandwidth[rank][r] for r in lenders)
        return total if self.peer_egress is None else min(total, self.peer_egress[rank])


@dataclass(frozen=True, slots=True)
class Stripe:
    """The lenders a peer-swapped tensor is split over, with each one's share of its bytes in
    proportion to ``weights`` (its link's bandwidth: every part arrives at once)."""

    lenders: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        require(len(self.lenders) == len(self.weights) > 0 and all(w > 0 for w in self.weights),
                "links", f"a stripe needs one link per lender, each above 0 bytes/s: {self}")  # fmt: skip

    def split(self, num_bytes: int) -> tuple[int, ...]:
        """``num_bytes`` in one share per lender, in proportion (largest remainders first),
        summing to it exactly: the planner's held bytes and the runtime's message sizes."""
        total = sum(self.weights)
        exact = [num_bytes * w / total for w in self.weights]
        shares = [min(int(x), num_bytes) for x in exact]
        rest = num_bytes - sum(shares)
        assert 0 <= rest <= len(shares), (num_bytes, self)
        for i in sorted(range(len(shares)), key=lambda i: (shares[i] - exact[i], i))[:rest]:
            shares[i] += 1
        return tuple(shares)


Choice = tuple[Saver, tuple[int, ...] | None]  # (saver, its lenders for PEER: [Note: stripes])


@dataclass(kw_only=True, frozen=True, slots=True)
class SaverPlan:
    """Per saved tensor its saver; per rank what it holds at its peak (lent bytes included) and
    the seconds its savers add to a step; per host link what the host holds."""

    saved: tuple[Saved, ...]
    choices: tuple[Choice, ...]
    peak_bytes: tuple[int, ...]
    lent_bytes: tuple[int, ...]  # held for other ranks
    host_bytes: tuple[int, ...]
    added_s: tuple[float, ...]
    item_added_s: tuple[float, ...]  # per saved tensor, what its saver adds to its rank's step
    solver: str
    links: Links
    fits: bool = field(default=True)

    @property
    def added_step_s(self) -> float:
        """What the savers add to a step: the slowest rank's added seconds."""
        return max(self.added_s, default=0.0)

    @property
    def pipeline_added_s(self) -> float:
        """What the savers add to a pipeline's step, as the planners compare plans: the slowest
        rank's added seconds, plus every rank's for one microbatch. The slowest rank sets the
        pace of all microbatches but about one; the fill and the drain pass every rank, so what
        each adds to one microbatch counts too. Two plans of one slowest rank are not alike: on
        ``tidal bench mpress``'s GPT (1F1B, 200 blocks) one that added 0.098 s on its slowest
        rank and 0.645 s over all simulated 3% slower than one adding 0.109 s on one rank."""
        return self.added_step_s + sum(self.added_s) / microbatches_per_step(self.saved)

    def stripe(self, index: int) -> Stripe | None:
        """How saved tensor ``index`` splits over its lenders (None: it is not lent)."""
        saver, lenders = self.choices[index]
        if saver is not Saver.PEER:
            return None
        assert lenders is not None
        return self.links.stripe(self.links.stage_rank[self.saved[index].stage], lenders)


def microbatches_per_step(saved: Sequence[Saved]) -> int:
    """The microbatches of a step: the most uses per step of any saved tensor (at least 1)."""
    return max((item.uses_per_step for item in saved), default=1) or 1


# -- the model of [Note: saver costs] ----------------------------------------------------------


def saver_options(item: Saved, links: Links) -> list[Choice]:
    out: list[Choice] = [(Saver.KEEP, None)]
    if item.fixed:
        return out
    if item.recompute_s is not None:
        out.append((Saver.RECOMPUTE, None))
    out.append((Saver.HOST, None))
    out += [(Saver.PEER, lenders) for lenders in links.peer_options(item.stage)]
    return out


def lent_shares(item: Saved, lenders: tuple[int, ...] | None,
                 links: Links) -> list[tuple[int, int]]:  # fmt: skip
    """What each lender of ``item``'s stripe holds of it: its share of each copy."""
    assert lenders is not None
    shares = links.shares(links.stage_rank[item.stage], lenders, item.num_bytes)
    copies = item.copies if item.copies_lent is None else item.copies_lent
    return [(to, copies * b) for to, b in zip(lenders, shares, strict=True)]


def host_ranks(saved: Sequence[Saved], choices: Sequence[Choice], links: Links) -> frozenset[int]:
    """The ranks that host-swap anything under ``choices``."""
    return frozenset(links.stage_rank[item.stage]
                     for item, (saver, _) in zip(saved, choices, strict=True)
                     if saver is Saver.HOST)  # fmt: skip


def host_users(links: Links, hosting: frozenset[int], rank: int) -> int:
    """How many ranks share ``rank``'s host link when ``rank`` host-swaps: those of ``hosting``
    (the ranks that host-swap anything) behind the same link, ``rank`` included."""
    link = links.host_link[rank]
    return len({r for r in hosting if links.host_link[r] == link} | {rank})


def price_s(item: Saved, choice: Choice, links: Links, num_host_users: int) -> float:
    """Seconds ``choice`` adds to ``item``'s rank per step; a host swap shares its link's
    bandwidth with ``num_host_users`` ranks, its own included."""
    saver, lender = choice
    rank = links.stage_rank[item.stage]
    if saver is Saver.KEEP:
        return 0.0
    if saver is Saver.RECOMPUTE:
        assert item.recompute_s is not None
        return item.uses_per_step * item.recompute_s
    if saver is Saver.HOST:
        bandwidth = links.host_bandwidth[links.host_link[rank]] / num_host_users
    else:
        assert lender is not None
        bandwidth = links.stripe_bandwidth(rank, lender)
    if item.num_bytes == 0:
        return 0.0
    per_use = 2 * item.num_bytes / bandwidth
    return item.uses_per_step * max(0.0, per_use - item.idle_s)


def evaluate(saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
             solver: str) -> SaverPlan:  # fmt: skip
    """What ``choices`` (one per saved tensor) make each rank hold and add ([Note: saver costs])."""
    n = links.num_ranks
    kept, lent = list(links.base_bytes), [0] * n
    host = [0] * len(links.host_bandwidth)
    added = [0.0] * n
    hosting = host_ranks(saved, choices, links)
    users = [host_users(links, hosting, rank) for rank in range(n)]
    per_item = tuple(price_s(item, choice, links, users[links.stage_rank[item.stage]])
                     for item, choice in zip(saved, choices, strict=True))  # fmt: skip
    for item, choice, item_added in zip(saved, choices, per_item, strict=True):
        rank = links.stage_rank[item.stage]
        saver, lender = choice
        added[rank] += item_added
        kept[rank] += item.held_under(saver)
        if saver is Saver.HOST:
            host[links.host_link[rank]] += item.held_bytes
        elif saver is Saver.PEER:
            for to, num_bytes in lent_shares(item, lender, links):
                lent[to] += num_bytes
    transient = transient_bytes_per_rank(saved, choices, links)
    peak = tuple(k + lent_ + t for k, lent_, t in zip(kept, lent, transient, strict=True))
    fits = all(p <= b for p, b in zip(peak, links.budget_bytes, strict=True)) and all(
        cap is None or held <= cap for held, cap in zip(host, links.host_budget_bytes, strict=True)
    )
    return SaverPlan(saved=tuple(saved), choices=tuple(choices), peak_bytes=peak,
                     lent_bytes=tuple(lent), host_bytes=tuple(host), added_s=tuple(added),
                     item_added_s=per_item, solver=solver, links=links, fits=fits)  # fmt: skip


def keep_all(saved: Sequence[Saved], links: Links) -> SaverPlan:
    """Every tensor kept: what each rank holds without savers."""
    return evaluate(saved, [(Saver.KEEP, None)] * len(saved), links, "none")


def transient_bytes(saved: Sequence[Saved], choices: Sequence[Choice], links: Links,
               mine: Sequence[int]) -> int:  # fmt: skip
    """What one rank, whose saved tensors are ``mine``, holds back at once: its largest moved
    copy (and, fetching ahead, its largest host-swapped one beside it)."""
    moved = ahead = 0
    for index in mine:
        item, saver = saved[index], choices[index][0]
        if saver is Saver.KEEP or not item.copies:
            continue
        moved = max(moved, item.num_bytes)
        if saver is Saver.HOST and links.host_prefetch:
            ahead = max(ahead, item.num_bytes)
    return moved + ahead


def transient_bytes_per_rank(saved: Sequence[Saved], choices: Sequence[Choice],
                             links: Links) -> list[int]:  # fmt: skip
    """What each rank holds back at once: its largest moved copy (and, fetching ahead, its
    largest host-swapped one beside it)."""
    mine: list[list[int]] = [[] for _ in range(links.num_ranks)]
    for index, item in enumerate(saved):
        mine[links.stage_rank[item.stage]].append(index)
    return [transient_bytes(saved, choices, links, indices) for indices in mine]


def least_peak_bytes(saved: Sequence[Saved], links: Links) -> tuple[int, ...]:
    """Per rank, the least it can hold with every tensor moved that can be (its base, what no
    saver moves, and the largest single copy of its own tensors): a budget below this cannot
    fit."""
    least = list(links.base_bytes)
    for rank in range(links.num_ranks):
        mine = [item for item in saved if links.stage_rank[item.stage] == rank and item.copies]
        least[rank] += sum(item.held_bytes for item in mine if item.fixed)
        least[rank] += max((item.num_bytes for item in mine if not item.fixed), default=0)
    return tuple(least)
