"""Chapter 9 checkers accept right answers and reject wrong ones with feedback."""

import math

import pytest

from ampcourse import exercises, formats
from ampcourse.exercises import ExerciseError


def mx_scale(amax, element):
    return 2.0 ** (math.floor(math.log2(amax)) - formats.spec(element).emax)


def test_mx_scale_accepts_the_ocp_rule(capsys):
    exercises.check_mx_scale(mx_scale)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (lambda a, e: 2.0 ** math.ceil(math.log2(a / formats.spec(e).max)), "RCEIL"),
    (lambda a, e: a / formats.spec(e).max, "power of two"),
    (lambda a, e: 2.0 ** math.floor(math.log2(a)), "emax"),
    (lambda a, e: 2.0 ** (round(math.log2(a)) - formats.spec(e).emax), "floor"),
    (lambda a, e: 2.0 ** (math.floor(math.log2(a)) - 8), "floor"),  # e4m3's emax for every element
    (lambda a, e: "one", "float"),
    (lambda a, e: None, "float"),
    (None, "function"),
])
def test_mx_scale_rejects_wrong_rules(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_mx_scale(wrong)


AMAXES = [1.0, 2.0, 100.0, 3.0, 3.0, 3.0, 1.0]


def delayed(amaxes, history, margin, fmax=448.0):
    out, seen, scale = [], [], 1.0
    for a in amaxes:
        out.append(scale)
        seen = (seen + [a])[-history:]
        scale = max(seen) * 2.0**margin / fmax
    return out


def test_delayed_scales_accepts_the_te_rule(capsys):
    exercises.check_delayed_scales(delayed(AMAXES, 3, 1), AMAXES, history=3, margin=1)
    exercises.check_delayed_scales(delayed(AMAXES, 2, 0, fmax=57344.0), AMAXES, history=2, element="fp8_e5m2")
    assert capsys.readouterr().out.count("✅") == 2


def delayed_own_amax(amaxes, history, margin, fmax=448.0):
    """The slip of putting each step's own amax into its window before the cast."""
    out, seen = [], []
    for a in amaxes:
        seen = (seen + [a])[-history:]
        out.append(max(seen) * 2.0**margin / fmax)
    return out


@pytest.mark.parametrize("wrong, hint", [
    ([a * 2 / 448 for a in AMAXES], "current scaling"),
    ([a / 448 for a in AMAXES], "current scaling"),
    (delayed(AMAXES, 3, 0), "margin"),
    (delayed(AMAXES, 99, 1), "only the last 3"),
    (delayed(AMAXES, 4, 1), "only the last 3"),
    (delayed(AMAXES, 2, 1), "the last 3 amaxes, not 2"),  # was called "current scaling": step 5's 2-step window is [3, 3]
    (delayed(AMAXES, 1, 1), "the last 3 amaxes, not 1"),
    (delayed_own_amax(AMAXES, 3, 1), "only after its cast"),
    ([0.5] + delayed(AMAXES, 3, 1)[1:], "starts at 1"),
    (delayed(AMAXES, 3, 1)[:5] + [1.0, 1.0], r"max\(last 3 amaxes"),
    (delayed(AMAXES, 3, 1)[:-1], "one entry per amax"),
    ("scales", "one scale per step"),
    (None, "one scale per step"),
])
def test_delayed_scales_rejects_wrong_answers(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_delayed_scales(wrong, AMAXES, history=3, margin=1)


def test_a_two_step_window_is_not_called_current_scaling(capsys):
    with pytest.raises(ExerciseError):
        exercises.check_delayed_scales(delayed(AMAXES, 2, 1), AMAXES, history=3, margin=1)
    assert "current scaling" not in capsys.readouterr().out
