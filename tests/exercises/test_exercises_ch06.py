"""Chapter 6 checkers accept right answers and reject wrong ones with feedback."""

import math

import numpy as np
import pytest
import torch

from ampcourse import exercises
from ampcourse.exercises import ExerciseError
from ampcourse.scaling import simulate_scale


@pytest.fixture(scope="module")
def grads():
    rng = np.random.default_rng(0)
    return rng.choice([-1.0, 1.0], 5000) * 2.0 ** rng.uniform(-38, -6, 5000)  # 32 binades: fit fp16 only when scaled


def test_no_flush_scale(grads, capsys):
    exercises.check_no_flush_scale(2.0**16, grads)
    exercises.check_no_flush_scale(2.0**20, grads)
    assert capsys.readouterr().out.count("✅") == 2
    for wrong in [1.0, 2.0**8, 2.0**30, 0.0, -65536.0, float("inf"), "big", None]:
        with pytest.raises(ExerciseError):
            exercises.check_no_flush_scale(wrong, grads)
    wide = np.concatenate([grads, [1e-13, 1.0]])  # 43 binades, fp16 holds 41: no single scale works
    with pytest.raises(ExerciseError, match="no single scale"):
        exercises.check_no_flush_scale(2.0**16, wide)


PATTERN = [False, False, True, False, False, False, True, True, False, False, False, False]
CFG = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def test_scale_prediction(capsys):
    exercises.check_scale_prediction(simulate_scale(PATTERN, **CFG), PATTERN, **CFG)
    assert "✅" in capsys.readouterr().out
    right = simulate_scale(PATTERN, **CFG)
    no_reset = [1024.0, 1024.0, 512.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 512.0, 512.0, 512.0, 1024.0]
    for wrong in [right[:-1], [1024.0] * len(PATTERN), no_reset, right[:5] + [x * 2 for x in right[5:]], "1024", None]:
        with pytest.raises(ExerciseError):
            exercises.check_scale_prediction(wrong, PATTERN, **CFG)


def update_rule(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return float(np.float32(scale * backoff_factor)), 0
    if tracker + 1 == growth_interval:
        with np.errstate(over="ignore"):
            grown = float(np.float32(scale * growth_factor))
        return (grown if np.isfinite(grown) else scale), 0
    return scale, tracker + 1


def test_update_rule(capsys):
    exercises.check_update_rule(update_rule)
    assert "✅" in capsys.readouterr().out


def _float_arith(scale, tracker, found, gf, bf, gi):  # Python doubles: off in the last bit
    if found:
        return scale * bf, 0
    if tracker + 1 == gi:
        return scale * gf, 0
    return scale, tracker + 1


def _no_reset(scale, tracker, found, gf, bf, gi):
    s, t = update_rule(scale, tracker, found, gf, bf, gi)
    return s, (tracker + 1 if found else t)


def _grows_to_inf(scale, tracker, found, gf, bf, gi):
    if not found and tracker + 1 == gi:
        with np.errstate(over="ignore"):
            return float(np.float32(scale * gf)), 0
    return update_rule(scale, tracker, found, gf, bf, gi)


def _float32_factors(scale, tracker, found, gf, bf, gi):  # rounds the factor first: a different last bit
    s, t = update_rule(scale, tracker, found, gf, bf, gi)
    if found:
        s = float(np.float32(scale) * np.float32(bf))
    return s, t


@pytest.mark.parametrize("wrong", [_float_arith, _no_reset, _grows_to_inf, _float32_factors,
                                   lambda *a: a[0], lambda *a: (_ for _ in ()).throw(NotImplementedError())])
def test_update_rule_rejects(wrong, capsys):
    with pytest.raises(ExerciseError):
        exercises.check_update_rule(wrong)
    assert "hint" in capsys.readouterr().out


def _grows_past_float32_in_python(scale, tracker, found, gf, bf, gi):
    """Checks for inf on the float64 product: 2.0**127 * 2 = 3.4e38 is finite in Python, inf in float32."""
    if not found and tracker + 1 == gi:
        grown = scale * gf
        return (scale if math.isinf(grown) else grown), 0
    return update_rule(scale, tracker, found, gf, bf, gi)


def test_update_rule_hint_says_the_overflow_is_float32s(capsys):
    """Issue 28 item 14: "unless that gives inf" hid that 3.4e38 is finite in Python."""
    with pytest.raises(ExerciseError):
        exercises.check_update_rule(_grows_past_float32_in_python)
    out = capsys.readouterr().out
    assert "float32" in out and f"{float(torch.finfo(torch.float32).max):.4g}" in out and "finite Python float" in out
    with pytest.raises(ExerciseError):
        exercises.check_update_rule(lambda s, t, f, gf, bf, gi: update_rule(s, t, f, gf, bf, gi) if f
                                    else (s, 0 if t + 1 == gi else t + 1))  # never grows
    out = capsys.readouterr().out
    assert "inf in float32" in out
