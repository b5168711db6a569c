"""Chapter 9 exercises: the OCP MX block scale, and the scales delayed scaling picks."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import formats
from ..fp8 import simulate_scaling
from ._core import call_learner, failed, number_list, passed

__all__ = ["check_mx_scale", "check_delayed_scales"]

#: The MX element formats: every signed format of 8 bits or fewer in the registry (fp8, fp6, fp4), so a new one is checked too.


def _ocp_scale(amax: float, element: str) -> float:
    """OCP MX v1.0: X = 2**(floor(log2(amax)) - emax of the element format)."""
    return 2.0 ** (math.floor(math.log2(amax)) - formats.spec(element).emax)


def _mx_cases() -> list[tuple[float, str]]:
    """Block amaxes to try: exact powers of two, values just below and above them, the formats' maxima, random ones."""
    rng = random.Random(9)
    cases = []
    for el in formats.mx_elements():
        m = formats.spec(el).max
        cases += [(1.0, el), (m, el), (m * 1.1, el), (0.75, el), (2.0**10, el), (2.0**10 * (1 - 2**-20), el),
                  (2.0**-10 * (1 + 2**-20), el), (3.0, el)]
        cases += [(2.0 ** rng.uniform(-30, 30), el) for _ in range(40)]
    return cases


def check_mx_scale(mx_scale: Callable[[float, str], float]) -> None:
    """Exercise 9.1: mx_scale(amax, element) -> the block's power-of-two scale by the OCP MX rule (floor)."""
    title = "Exercise 9.1 (the MX block scale)"
    for amax, el in _mx_cases():
        want = _ocp_scale(amax, el)
        got = call_learner(title, mx_scale, amax, el)
        try:
            g = float(got)
        except (TypeError, ValueError):
            failed(title, f"a number for amax={amax!r}, {el}", repr(got)[:80], "return the scale as a float")
        if g == want:
            continue
        f = formats.spec(el)
        rceil = 2.0 ** math.ceil(math.log2(amax / f.max))
        if g == rceil:
            hint = "that is the round-up (RCEIL) rule; OCP's spec takes the floor of log2(amax) minus the element's emax"
        elif g > 0 and math.isfinite(g) and math.log2(g) != int(math.log2(g)):
            hint = "an MX scale is stored in e8m0, so it is a power of two: do not divide by the element's max"
        elif g == 2.0 ** math.floor(math.log2(amax)):
            hint = "subtract the element format's largest exponent (formats.spec(element).emax)"
        else:
            hint = "X = 2**(floor(log2(amax)) - emax), with emax = formats.spec(element).emax"
        failed(title, f"{want!r} for amax={amax!r}, element {el}", g, hint)
    passed(title, "Blocks whose amax / X lands above the element's max will saturate: that is the cost of the floor.")


def _delayed(amaxes: Sequence[float], history: int, margin: int, fmax: float, *, own_amax: bool = False,
             start: float = 1.0) -> list[float]:
    """Delayed scaling's scale per step, in plain Python; ``own_amax`` puts each step's amax in its window first (a slip)."""
    out, seen, scale = [], [], start
    for a in amaxes:
        if own_amax:
            seen = (seen + [a])[-history:]
            scale = max(seen) * 2.0**margin / fmax
        out.append(scale)
        if not own_amax:
            seen = (seen + [a])[-history:]
            scale = max(seen) * 2.0**margin / fmax
    return out


def _slips(amaxes: Sequence[float], history: int, margin: int, fmax: float) -> list[tuple[list[float], str]]:
    """Whole answers that a known slip gives, each with its hint, most specific first.

    Diagnosing the whole list, not one step: a wrong window can match another rule at one step (a 2-step
    window gives this step's own amax where the last two steps repeat it, which a per-step test took for
    current scaling).
    """
    slips = []
    for h in range(1, len(amaxes) + 1):
        if h < history:
            slips.append((_delayed(amaxes, h, margin, fmax),
                          f"the window holds the last {history} amaxes, not {h}: a spike stays in it for {history} steps"))
        elif h > history:
            slips.append((_delayed(amaxes, h, margin, fmax),
                          f"the history holds only the last {history} amaxes: older ones drop out"))
    slips.append((_delayed(amaxes, history, margin, fmax, own_amax=True),
                  "a step's own amax enters the history only after its cast: the scale of step i uses steps before i"))
    if margin:
        slips.append((_delayed(amaxes, history, 0, fmax), f"remember the margin: multiply by 2**{margin}"))
    for m in sorted({margin, 0}):
        slips.append(([a * 2.0**m / fmax for a in amaxes],
                       "that is current scaling (each step's own amax): delayed scaling uses the amaxes of *earlier* steps only"))
    return slips


def check_delayed_scales(scales: Any, amaxes: Sequence[float], history: int, margin: int = 0,
                         element: str = "fp8_e4m3") -> None:
    """Exercise 9.2: the dequantization scale delayed scaling uses at each step of an amax sequence."""
    title = "Exercise 9.2 (delayed scaling's scales)"
    tensors = [torch.tensor([float(a)], dtype=torch.float64) for a in amaxes]
    want = [s.scale for s in simulate_scaling(tensors, element, "delayed", history=history, margin=margin)]
    got = number_list(title, scales, len(want), "one scale per step", "one entry per amax in the sequence")
    fmax = formats.spec(element).max

    def same(a: Sequence[float], b: Sequence[float]) -> bool:
        return all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b))

    for i, (g, w) in enumerate(zip(got, want)):
        if math.isclose(g, w, rel_tol=1e-9):
            continue
        hint = next((h for slip, h in _slips(amaxes, history, margin, fmax) if same(got, slip)), None)
        if hint is None and i == 0:
            hint = "the first step has no history yet: the scale starts at 1"
        elif hint is None and same(got[1:], want[1:]):
            hint = "only the first step is off: with no history yet, the scale starts at 1"
        elif hint is None:
            hint = f"scale = max(last {history} amaxes before this step) * 2**margin / {fmax:g}"
        failed(title, f"scale {w!r} at step {i}", g, hint)
    passed(title, "A spike stays in the history for its whole window: that is where delayed scaling loses precision.")
