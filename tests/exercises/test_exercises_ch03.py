"""Chapter 3 checkers accept right answers and reject wrong ones with feedback."""

import pytest
import torch

from ampcourse import exercises
from ampcourse.exercises import ExerciseError
from ampcourse.exercises.ch03 import AUTOCAST_QUESTIONS, autocast_answers

RIGHT = {
    "x @ w": torch.bfloat16,
    "x + b": torch.float32,
    "(x @ w) + x": torch.float32,
    "torch.softmax(x @ w, dim=-1)": torch.bfloat16,
    "F.layer_norm(x @ w, (8,))": torch.bfloat16,
    "F.cross_entropy(x @ w, y)": torch.float32,
    "F.relu(x @ w).sum()": torch.bfloat16,
}


def test_answers_are_measured_live():
    assert autocast_answers("cpu", torch.bfloat16) == RIGHT
    assert set(autocast_answers("cpu", torch.float16).values()) == {torch.float16, torch.float32}


def test_autocast_dtypes_accepts_dtypes_and_names(capsys):
    exercises.check_autocast_dtypes(RIGHT)
    exercises.check_autocast_dtypes({k: str(v).removeprefix("torch.") for k, v in RIGHT.items()})
    exercises.check_autocast_dtypes({k: {torch.bfloat16: "bf16", torch.float32: "fp32"}[v] for k, v in RIGHT.items()})
    assert capsys.readouterr().out.count("✅") == 3


@pytest.mark.parametrize("change", [
    {"torch.softmax(x @ w, dim=-1)": torch.float32},   # CUDA's answer, not CPU's
    {"F.layer_norm(x @ w, (8,))": torch.float32},      # CUDA's answer, not CPU's
    {"(x @ w) + x": torch.bfloat16},                  # forgets type promotion
    {"F.cross_entropy(x @ w, y)": torch.bfloat16},     # forgets the fp32 loss
    {"x @ w": torch.float16},                         # the wrong low-precision dtype
    {"x @ w": "not a dtype"},
])
def test_autocast_dtypes_rejects_wrong_answers(change, capsys):
    with pytest.raises(ExerciseError, match="expected"):
        exercises.check_autocast_dtypes({**RIGHT, **change})
    assert "hint" in capsys.readouterr().out


@pytest.mark.parametrize("change", [
    {"F.cross_entropy(x @ w, y)": torch.bfloat16},
    {"x @ w": torch.float32, "x + b": torch.bfloat16},
    {"torch.softmax(x @ w, dim=-1)": "float32"},
])
def test_autocast_dtypes_verdict_names_the_wrong_expressions_but_not_their_dtypes(change, capsys):
    """The verdict says which predictions to rethink, never the right dtype of one (a giveaway)."""
    with pytest.raises(ExerciseError):
        exercises.check_autocast_dtypes({**RIGHT, **change})
    out = capsys.readouterr().out
    expected_line = next(line for line in out.splitlines() if "expected:" in line)
    got_line = next(line for line in out.splitlines() if "got:" in line)
    assert all(q in got_line for q in change)
    for q in change:  # the true dtype of a wrong item appears nowhere but in the learner's own words
        truth = str(RIGHT[q]).removeprefix("torch.")
        assert truth not in expected_line and f"-> {truth}" not in out and f"-> {RIGHT[q]}" not in out


def test_autocast_dtypes_rejects_incomplete_answers():
    with pytest.raises(ExerciseError, match="missing"):
        exercises.check_autocast_dtypes({"x @ w": torch.bfloat16})
    with pytest.raises(ExerciseError):
        exercises.check_autocast_dtypes(None)
    assert len(AUTOCAST_QUESTIONS) == len(RIGHT)


def right_update(scale, tracker, found_inf, growth_interval):
    if found_inf:
        return scale * 0.5, 0
    tracker += 1
    if tracker == growth_interval:
        return scale * 2.0, 0
    return scale, tracker


def test_scale_update_accepts_a_right_answer(capsys):
    exercises.check_scale_update(right_update)
    assert "✅" in capsys.readouterr().out


def keeps_tracker_on_inf(scale, tracker, found_inf, growth_interval):
    if found_inf:
        return scale * 0.5, tracker
    return right_update(scale, tracker, False, growth_interval)


def grows_one_step_early(scale, tracker, found_inf, growth_interval):
    if found_inf:
        return scale * 0.5, 0
    tracker += 1
    return (scale * 2.0, 0) if tracker >= growth_interval - 1 else (scale, tracker)


@pytest.mark.parametrize("wrong", [
    keeps_tracker_on_inf,
    grows_one_step_early,
    lambda s, t, bad, n: (s / 4, 0) if bad else right_update(s, t, bad, n),   # backs off too hard
    lambda s, t, bad, n: (s, t),                                              # never changes
    lambda s, t, bad, n: s * (0.5 if bad else 1.0),                           # returns only the scale
    lambda s, t, bad, n: (_ for _ in ()).throw(NotImplementedError()),        # the learner-copy stub
])
def test_scale_update_rejects_wrong_answers(wrong, capsys):
    with pytest.raises(ExerciseError, match="expected"):
        exercises.check_scale_update(wrong)
    assert "hint" in capsys.readouterr().out
