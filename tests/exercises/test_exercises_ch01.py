"""Chapter 1's exercise checkers: each accepts a right answer and rejects wrong ones with feedback (chapters 2-9: test_exercises_chNN.py)."""

import math

import pytest
import torch

from ampcourse import exercises
from ampcourse.exercises import ExerciseError


def right_fp16_ulp(x: float) -> float:
    a = abs(float(torch.tensor(x, dtype=torch.float16)))
    e = math.frexp(a)[1] - 1 if a > 0 else -14
    return 2.0 ** (max(e, -14) - 10)


def test_fp16_ulp_accepts_a_right_answer(capsys):
    exercises.check_fp16_ulp(right_fp16_ulp)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda x: 2.0 ** (math.frexp(abs(x))[1] - 1 - 10),      # forgets the subnormal floor
    lambda x: 2.0**-10 * abs(x),                            # relative, not absolute spacing
    lambda x: 2.0 ** (math.frexp(abs(x))[1] - 1 - 7),       # bf16's mantissa width
    lambda x: (_ for _ in ()).throw(NotImplementedError()),  # the learner-copy stub
    "not a function",
])
def test_fp16_ulp_rejects_wrong_answers(wrong, capsys):
    with pytest.raises(ExerciseError, match="expected"):
        exercises.check_fp16_ulp(wrong)
    out = capsys.readouterr().out
    assert "❌" in out and "hint" in out


def test_largest_exact_integer():
    exercises.check_largest_exact_integer(256, "bf16")
    exercises.check_largest_exact_integer(2048, "fp16")
    for wrong in [255, 257, 128, 65504, 256.0, "256", None]:
        with pytest.raises(ExerciseError):
            exercises.check_largest_exact_integer(wrong, "bf16")


@pytest.mark.parametrize("fmt, wrong, hint", [
    ("bf16", 255, "try a bigger number"), ("bf16", 128, "try a bigger number"), ("bf16", 0, "try a bigger number"),
    ("bf16", 257, "spacing between neighbours becomes 2"), ("bf16", 65504, "7 stored mantissa bits"),
    ("fp16", 2047, "try a bigger number"), ("fp16", 4096, "10 stored mantissa bits"),
])
def test_largest_exact_integer_hints_at_the_idea_not_the_answer(fmt, wrong, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_largest_exact_integer(wrong, fmt)
    out = capsys.readouterr().out
    answer = {"bf16": 256, "fp16": 2048}[fmt]
    shown = out.split("hint", 1)[1]  # what the hint says (the 'got' line repeats the learner's own number)
    for leak in (answer, answer + 1, answer - 1):
        if leak != wrong:
            assert str(leak) not in shown, (wrong, leak, shown)


def test_subnormal_example():
    exercises.check_subnormal_example(1e-6)
    exercises.check_subnormal_example(2.0**-20)
    for wrong in [1e-3, 1e-9, 0.0, 1.0, float("nan"), "small", None]:
        with pytest.raises(ExerciseError):
            exercises.check_subnormal_example(wrong)
