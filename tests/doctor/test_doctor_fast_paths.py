"""The doctor's fast paths (issue 25, round 7) give what their plain originals give: the histogram's bin index from
7 in-place ops against the exact _bin_index, on every fraction a float32 can have; the batched counter's maxima
and inf/NaN counts read off the counted bits; the cheap dispatch-mode switch against torch's own."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ampcourse.doctor.watch import _ModesOff
from ampcourse.doctor.hist import COUNT_CAP, Log2Hist, _Counter


@pytest.mark.parametrize("exponent", [1, 142, 254])
def test_fast_index_agrees_with_the_exact_index_on_every_fraction(exponent):
    """All 2**23 fractions at one exponent: Q (0 for a power of two, 1 + leading ones, capped) and the row."""
    frac = torch.arange(0, 2**23, dtype=torch.int32)
    bits = frac | (exponent << 23)
    idx = Log2Hist._fast_index(bits, torch.empty_like(bits), torch.empty_like(bits))
    exact = Log2Hist._bin_index(bits)
    nq = Log2Hist.QMAX + 1
    q_fast = 150 - (idx - nq * exponent)
    assert torch.equal(q_fast, exact % nq)
    assert torch.equal(exact // nq, torch.full_like(exact, exponent + Log2Hist._ROW0))


def test_counted_bits_give_the_max_and_the_infs_and_nans():
    """An uncapped tensor's max and inf/NaN count come from its counted bits: the same as from the tensor."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(3000, generator=g) * 100
    t[::97] = math.inf
    t[5::211] = -math.inf
    t[7::301] = math.nan
    for x in (t, t.half(), t.bfloat16(), -t.abs(), torch.full((10,), math.nan), torch.tensor([-0.0])):
        h = Log2Hist()
        counter = _Counter()
        counter.add(x, [h], COUNT_CAP)
        counter.flush()
        finite = x[torch.isfinite(x)].float()
        assert h.nonfinite == int((~torch.isfinite(x)).sum())
        assert h.max == (float(finite.abs().max()) if finite.numel() else 0.0)
        assert math.copysign(1.0, h.max) == 1.0


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_modes_off_turns_every_mode_off_and_puts_them_back():
    x = torch.randn(4)
    with _Counting() as outer, _Counting() as inner:
        stack = _get_current_dispatch_mode_stack()
        with _ModesOff():
            assert _get_current_dispatch_mode_stack() == []
            x + 1
        assert outer.ops == inner.ops == 0 and _get_current_dispatch_mode_stack() == stack
        with pytest.raises(RuntimeError, match="inside"):
            with _ModesOff():
                raise RuntimeError("inside")
        assert _get_current_dispatch_mode_stack() == stack
        x + 1
        assert inner.ops == 1
