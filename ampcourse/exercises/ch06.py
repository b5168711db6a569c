"""Chapter 6 exercises: a scale with no flushed gradients, a predicted trajectory, the update rule."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..scaling import range_counts, simulate_scale, zone_thresholds
from ._core import call_learner, failed, number_list, passed

__all__ = ["check_no_flush_scale", "check_scale_prediction", "check_update_rule"]


def check_no_flush_scale(scale: Any, grads, fmt: str = "fp16") -> None:
    """Exercise 6.1: a loss scale at which no gradient value flushes to zero and none overflows in fmt."""
    title = "Exercise 6.1 (a loss scale that loses nothing)"
    try:
        s = float(scale)
    except (TypeError, ValueError):
        failed(title, "a number", repr(scale)[:80], "answer with a scale such as 2.0**16")
    if not (math.isfinite(s) and s > 0):
        failed(title, "a positive finite scale", s, "loss scales are positive numbers, usually powers of two")
    c = range_counts(grads, s, fmt)
    if c["underflow"] or c["overflow"]:
        v = np.abs(np.asarray(grads, dtype=np.float64)).ravel()
        v = v[(v > 0) & np.isfinite(v)]
        flush, _, over = zone_thresholds(fmt)
        hint = ("the values span more binades than the format holds: no single scale works" if v.max() / v.min() >= over / flush
                else "some values still flush to zero: scale up" if c["underflow"] else "some values overflow: scale down")
        failed(title, "0 flushed to zero and 0 overflowing", f"{c['underflow']:,} flushed, {c['overflow']:,} overflowing", hint)
    passed(title, f"Every value lands between {fmt}'s smallest subnormal and its maximum "
                  "(the smallest ones still as subnormals, with reduced precision).")


def check_scale_prediction(predicted: Sequence[float], overflows: Sequence[bool], init_scale: float,
                           growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """Exercise 6.2: the scale after each update() for a given overflow pattern and settings."""
    title = "Exercise 6.2 (predict the scale trajectory)"
    want = simulate_scale(overflows, init_scale, growth_factor, backoff_factor, growth_interval)
    got = number_list(title, predicted, len(want), "one scale per step, after its update()", "one entry per step of the pattern")
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            hint = ("an overflow multiplies by backoff_factor and restarts the count of clean steps" if overflows[i] else
                    f"the scale grows only after {growth_interval} clean steps in a row, counted since the last growth or overflow")
            failed(title, f"scale {w!r} after step {i + 1}", g, hint)
    passed(title, f"Final scale {want[-1]:g} after {sum(overflows)} skipped steps.")


def _torch_update(scale: float, tracker: int, found_inf: bool, gf: float, bf: float, gi: int) -> tuple[float, int]:
    """What torch's own kernel does (the ground truth)."""
    s = torch.tensor(scale, dtype=torch.float32)
    t = torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor(float(found_inf)), gf, bf, gi)
    return s.item(), int(t.item())


_F32_MAX = float(torch.finfo(torch.float32).max)  # 3.4e38: where GradScaler's float32 scale becomes inf


def _update_rule_hint(case: tuple, got: Any, want: tuple[float, int]) -> str:
    """What a wrong (scale, tracker) for one case of 6.3 most likely missed.

    The growth check is float32's: ``scale * growth_factor`` above 3.4e38 is inf in the float32 scale tensor
    but a finite Python float (up to 1.8e308), so "unless that gives inf" alone sends a learner checking
    ``math.isinf`` on a float64 product that never is.
    """
    scale, tracker, found, gf, bf, gi = case
    got_scale = float(got[0])
    close = math.isclose(got_scale, want[0], rel_tol=1e-6) and int(got[1]) == want[1]
    if close:
        return ("right up to the last bit: the scale is float32; multiply in float64 and round once, "
                "e.g. float(np.float32(scale * factor))")
    if found:
        return "overflow: scale * backoff_factor and tracker 0"
    if math.isfinite(got_scale) and got_scale > _F32_MAX:
        return (f"your scale {got_scale:.4g} is a finite Python float, but GradScaler keeps the scale in float32, "
                f"whose largest value is {_F32_MAX:.4g}: there it is inf. When the grown scale is inf in float32, "
                "keep the old scale (the tracker still restarts at 0)")
    return (f"no overflow: tracker + 1; when it reaches growth_interval, grow and reset to 0, unless the grown scale "
            f"is inf in float32 (above {_F32_MAX:.4g}, though a Python float is still finite there): then keep the scale")


def check_update_rule(update: Callable[..., tuple[float, int]], n_cases: int = 400) -> None:
    """Exercise 6.3: update(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval) -> (scale, tracker), bit for bit."""
    title = "Exercise 6.3 (GradScaler's update rule)"
    rng = random.Random(6)
    cases = [(65536.0, 0, True, 2.0, 0.5, 2000), (65536.0, 1999, False, 2.0, 0.5, 2000), (65536.0, 5, False, 2.0, 0.5, 2000),
             (2.0**127, 0, False, 2.0, 0.5, 1), (1000.0, 2, False, 1.1, 0.3, 3), (1000.0, 2, True, 1.1, 0.3, 3)]
    for _ in range(n_cases):
        gi = rng.choice([1, 2, 3, 10])
        scale = float(torch.tensor(2.0 ** rng.uniform(-30, 60), dtype=torch.float32))
        cases.append((scale, rng.randrange(gi), rng.random() < 0.4, rng.uniform(1.01, 4.0), rng.uniform(0.05, 0.95), gi))
    for case in cases:
        want = _torch_update(*case)
        got = call_learner(title, update, *case)
        try:
            ok = (float(got[0]), int(got[1])) == want
        except (TypeError, ValueError, IndexError):
            failed(title, "a pair (scale, tracker)", repr(got)[:80], "return new_scale, new_tracker")
        if not ok:
            failed(title, f"update{case} == {want}", tuple(got), _update_rule_hint(case, got, want))
    passed(title, f"Your rule matches torch._amp_update_scale_ on {len(cases)} cases, float32 rounding included.")
