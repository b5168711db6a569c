"""Chapter 1's exercise checkers: each accepts a right answer and rejects wrong ones with feedback (chapters 2-9: test_exercises_chNN.py)."""

import math

import pytest
import torch

from ampcourse import exercises, formats
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


def skips_rounding_first(x: float) -> float:
    """frexp on the raw |x|: right everywhere except where |x| rounds up into the next binade (2047.9 -> 2048)."""
    a = abs(x)
    e = math.frexp(a)[1] - 1 if a > 0 else -14
    return 2.0 ** (max(e, -14) - 10)


def nextafter_gap(x: float) -> float:
    """The literal reading: the next fp16 value up minus |x| rounded (inf at fp16's largest value)."""
    r = torch.tensor(abs(x), dtype=torch.float16)
    return (torch.nextafter(r, torch.tensor(math.inf, dtype=torch.float16)).float() - r.float()).item()


def test_fp16_ulp_rejects_a_solution_that_does_not_round_first(capsys):
    assert skips_rounding_first(2047.9) == 1.0 and skips_rounding_first(0.99999) == 2.0**-11
    with pytest.raises(ExerciseError, match="round |x| to fp16 first".replace("|", r"\|")):
        exercises.check_fp16_ulp(skips_rounding_first)
    assert "binade above" in capsys.readouterr().out


def test_fp16_ulp_at_the_largest_value_follows_the_stated_convention(capsys):
    """At 65504 there is no next fp16 value: the exercise text and the hint say to answer the gap below it."""
    assert nextafter_gap(1.0) == 2.0**-10 and math.isinf(nextafter_gap(65504.0))
    with pytest.raises(ExerciseError, match="no larger value here"):
        exercises.check_fp16_ulp(nextafter_gap)
    capsys.readouterr()
    below_max = lambda x: formats.ulp(x, "fp16") if abs(x) < 65504.0 else 65504.0 - torch.nextafter(
        torch.tensor(65504.0, dtype=torch.float16), torch.tensor(0.0, dtype=torch.float16)).item()
    exercises.check_fp16_ulp(below_max)  # the convention, written with torch.nextafter downwards
    assert "✅" in capsys.readouterr().out


def test_fp16_ulp_exercise_text_states_the_convention_at_the_largest_value():
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).parents[2] / "chapters/01_precision_basics.ipynb").read_text())
    text = next("".join(c["source"]) for c in nb["cells"] if "**1.1**" in "".join(c["source"]))
    assert "largest" in text and "nextafter" in text and "rounded to fp16" in text


def test_largest_exact_integer_accepts_what_operator_index_accepts(capsys):
    """np.argmin gives np.int64 (the prose's own route); an integer tensor is a whole number too."""
    import numpy as np
    ints = np.arange(0, 5000)
    n = np.argmin(formats.quantize(ints, "bf16") == ints) - 1
    assert type(n) is np.int64
    for answer in (n, torch.tensor(256), np.int32(2048)):
        exercises.check_largest_exact_integer(answer, "bf16" if answer != 2048 else "fp16")
    assert capsys.readouterr().out.count("✅") == 3
    for wrong in (np.True_, torch.tensor(True), torch.tensor(256.0), np.float64(256.0), torch.tensor([256, 257])):
        with pytest.raises(ExerciseError, match="an int"):
            exercises.check_largest_exact_integer(wrong, "bf16")


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "tf32"])
def test_largest_exact_integer_is_right_for_every_format(fmt, capsys):
    """The answer by brute force with quantize (fp6_e2m3's range, max 7.5, ends before its mantissa: 7, not 16)."""
    import numpy as np
    from ampcourse.exercises.ch01 import largest_exact_integer
    want = largest_exact_integer(fmt)
    if want < 10**5:
        ints = np.arange(0, want + 3)
        assert int(np.argmin(formats.quantize(ints, fmt) == ints)) - 1 == want
    else:  # fp32: too many integers to list; the answer is exact and the next one is not
        assert formats.quantize([want], fmt)[0] == want and formats.quantize([want + 1], fmt)[0] != want + 1
    exercises.check_largest_exact_integer(want, fmt)
    assert "✅" in capsys.readouterr().out
    for wrong in (want - 1, want + 1, 2 ** (formats.spec(fmt).mantissa_bits + 1) + (want == 2 ** (formats.spec(fmt).mantissa_bits + 1))):
        with pytest.raises(ExerciseError):
            exercises.check_largest_exact_integer(wrong, fmt)
    assert largest_exact_integer("fp6_e2m3") == 7 and largest_exact_integer("fp4_e2m1") == 4


def test_largest_exact_integer_range_hint_does_not_leak_the_answer(capsys):
    with pytest.raises(ExerciseError, match="range ends before"):
        exercises.check_largest_exact_integer(16, "fp6_e2m3")
    shown = capsys.readouterr().out.split("hint", 1)[1]
    assert "7" not in shown and "8" not in shown


def test_largest_exact_integer_refuses_a_format_without_zero():
    with pytest.raises(ValueError, match="fp8_e8m0 has no zero"):
        exercises.check_largest_exact_integer(1, "fp8_e8m0")
