"""The spill accounting of the optimizer fence (checkpoint/spill.py): what fits the fixed cap is
copied device to device, in copy order, each piece at an aligned offset; the first piece that
does not fit and everything after it wait (the D2H copies must stay a prefix of the order)."""

from __future__ import annotations

import pytest

from gpumem.checkpoint.stage.pieces import Piece
from gpumem.checkpoint.stage.spill import plan_spill


def _pieces(*sizes: int) -> list[Piece]:
    return [Piece(i, 0, n, 0, 0) for i, n in enumerate(sizes)]


def test_pieces_fit_in_order_at_aligned_offsets():
    ps = _pieces(100, 300, 256, 1)
    plan = plan_spill(ps, cap=1024)
    # 100 at 0; 300 at 256 (next boundary); 256 at 768; the last byte would need 1024..1025
    assert [(p.index, at) for p, at in plan.spilled] == [(0, 0), (1, 256), (2, 768)]
    assert [p.index for p in plan.waiting] == [3]
    assert (plan.spill_bytes, plan.used) == (656, 1024)


def test_a_piece_that_does_not_fit_stops_the_spill_even_if_later_ones_would():
    ps = _pieces(600, 500, 10)
    plan = plan_spill(ps, cap=1024)
    assert [p.index for p, _ in plan.spilled] == [0]
    assert [p.index for p in plan.waiting] == [1, 2]  # 10 bytes would fit, but out of order
    assert plan.spill_bytes == 600


@pytest.mark.parametrize("cap", [0, 99])
def test_no_room_everything_waits(cap):
    ps = _pieces(100, 1)
    plan = plan_spill(ps, cap=cap)
    assert plan.spilled == [] and plan.waiting == ps and plan.spill_bytes == plan.used == 0


def test_everything_fits_nothing_waits():
    ps = _pieces(256, 256, 256)
    plan = plan_spill(ps, cap=768)
    assert [at for _, at in plan.spilled] == [0, 256, 512] and plan.waiting == []
    assert plan.spill_bytes == plan.used == 768
