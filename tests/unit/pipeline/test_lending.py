"""MPress's peer swap as schedule actions ([Note: lending] in tidal/pipeline/lending.py): where
with_lending puts them, that they parse back, and what it refuses."""

from __future__ import annotations

import pytest

from tidal.config import ConfigError
from tidal.pipeline.ir import Kind, format_program, parse_action, parse_program, with_communication
from tidal.pipeline.lending import with_lending
from tidal.pipeline.schedules import make_schedule


def test_each_microbatch_goes_out_after_its_forward_and_home_before_its_backward() -> None:
    base = with_communication(make_schedule("1f1b", stages=3, microbatches=3))
    lent = with_lending(base, {0: (2,), 1: (2,)})
    for program in lent.programs:
        assert parse_program(format_program(program)) == list(program)
    borrower = [str(a) for a in lent.programs[0]]
    for j in range(3):  # out right after the forward's send, home right before the backward
        assert borrower[borrower.index(f"0SF{j}") + 1] == f"0LO{j}p2"
        assert borrower[borrower.index(f"0B{j}v0") - 1] == f"0LI{j}p2"
    lender = [str(a) for a in lent.programs[2]]
    for j in range(3):  # held from before the lender's own forward to after its backward
        assert lender.index(f"0HI{j}p0") < lender.index(f"2RF{j}") < lender.index(f"2B{j}v0")
        assert lender.index(f"2B{j}v0") < lender.index(f"0HO{j}p0") < lender.index(f"2SB{j}")
    untouched = [a for a in lent.programs[2] if not a.kind.is_lending]
    assert untouched == list(base.programs[2])
    assert sum(a.kind is Kind.HOLD for a in lent.programs[2]) == 6  # 2 borrowers x 3
    assert with_lending(base, {}) is base


def test_with_virtual_stages_the_lender_holds_at_its_first_stage_after_the_borrower() -> None:
    # 2 ranks, 2 chunks: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3. Stage 0 lends to
    # rank 1 (held at stage 1), stage 1 to rank 0 (at stage 2, the next chunk), stage 2 to
    # rank 1 (at stage 3): each rank borrows and lends at once.
    base = with_communication(make_schedule("interleaved", stages=2, microbatches=4, virtual=2))
    lent = with_lending(base, {0: (1,), 1: (0,), 2: (1,)})
    for s, lender, t in ((0, 1, 1), (1, 0, 2), (2, 1, 3)):
        borrower = [str(a) for a in lent.programs[base.rank_of(s)]]
        holder = [str(a) for a in lent.programs[lender]]
        for j in range(4):
            assert borrower.index(f"{s}F{j}v0") < borrower.index(f"{s}LO{j}p{lender}")
            assert borrower.index(f"{s}LI{j}p{lender}") == borrower.index(f"{s}B{j}v0") - 1
            held_in = holder.index(f"{s}HI{j}p{base.rank_of(s)}")
            assert held_in == holder.index(f"{t}RF{j}") - 1
            held_out = holder.index(f"{s}HO{j}p{base.rank_of(s)}")
            assert holder.index(f"{t}B{j}v0") < held_out == holder.index(f"{t}SB{j}") - 1
    for rank in range(2):
        untouched = [a for a in lent.programs[rank] if not a.kind.is_lending]
        assert untouched == list(base.programs[rank])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_an_earlier_lender_holds_between_two_gradients_it_already_waits_for(name: str) -> None:
    # Stage 2 of 3 lends to rank 0: HI(j) right before rank 0 receives the gradient of the
    # borrower's first backward after F(2, j), HO(j) right before it receives the gradient of j.
    base = with_communication(make_schedule(name, stages=3, microbatches=4))
    lent = with_lending(base, {2: (0,)})
    borrower = [str(a) for a in lent.programs[2]]
    lender = [str(a) for a in lent.programs[0]]
    for j in range(4):
        after = [b for b in borrower[borrower.index(f"2F{j}v0") :] if b.startswith("2B")][0]
        i = int(after[2:].split("v")[0])
        after_hold = lender[lender.index(f"2HI{j}p2") :]
        assert [a for a in after_hold if "H" not in a][0] == f"0RB{i}"
        assert lender[lender.index(f"0RB{j}") - 1] == f"2HO{j}p2"
        assert borrower.index(f"2LO{j}p0") < borrower.index(after)
    assert [a for a in lent.programs[0] if not a.kind.is_lending] == list(base.programs[0])
    if name == "gpipe":  # every forward before the first backward: all held before any is back
        assert lender.index("2HI3p2") < lender.index("2HO0p2") < lender.index("0RB0")


def test_lending_that_cannot_run_is_refused() -> None:
    base = with_communication(make_schedule("1f1b", stages=3, microbatches=3))
    with pytest.raises(ConfigError, match="stage 1 cannot lend to rank 1: a lender is another"):
        with_lending(base, {1: (1,)})
    with pytest.raises(ConfigError, match="stage 1 cannot lend to rank 3: a lender is another"):
        with_lending(base, {1: (3,)})
    interleaved = with_communication(make_schedule("interleaved", stages=2, microbatches=4,
                                                   virtual=2))  # fmt: skip
    with pytest.raises(ConfigError, match="no stage of rank 0 comes after stage 3"):
        with_lending(interleaved, {3: (0,)})
    with pytest.raises(ValueError, match="names its peer rank"):
        parse_action("0LO3")
    assert str(parse_action("1HI4p0")) == "1HI4p0"
