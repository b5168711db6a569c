"""Chapter 2 checkers accept right answers and reject wrong ones with feedback."""

import pytest

from ampcourse import exercises
from ampcourse.exercises import ExerciseError
from ampcourse.exercises.ch02 import saved_bytes_question


def right_adam_bytes(model):
    return sum(4 * p.numel() * p.element_size() for p in model.parameters())


def test_adam_bytes_accepts_a_right_answer(capsys):
    exercises.check_adam_bytes(right_adam_bytes)
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [
    lambda m: sum(16 * p.numel() for p in m.parameters()),                   # assumes fp32 everywhere
    lambda m: sum(3 * p.numel() * p.element_size() for p in m.parameters()),  # forgets the gradients
    lambda m: sum(p.numel() * p.element_size() for p in m.parameters()),      # weights only
    lambda m: 4 * len(list(m.parameters())),                                  # counts tensors, not elements
    lambda m: float(right_adam_bytes(m)),                                     # a float, not an int
    lambda m: (_ for _ in ()).throw(NotImplementedError()),                   # the learner-copy stub
    None,
])
def test_adam_bytes_rejects_wrong_answers(wrong, capsys):
    with pytest.raises(ExerciseError, match="expected"):
        exercises.check_adam_bytes(wrong)
    assert "hint" in capsys.readouterr().out


def test_adam_bytes_hint_names_the_bf16_model(capsys):
    with pytest.raises(ExerciseError):
        exercises.check_adam_bytes(lambda m: sum(16 * p.numel() for p in m.parameters()))
    assert "bf16" in capsys.readouterr().out


def test_saved_bytes_question_by_hand():
    # fp32: Linear saves its 8x16 input; ReLU saves its 8x32 output, which the second Linear saves again
    assert saved_bytes_question(autocast=False) == 8 * 16 * 4 + 8 * 32 * 4
    assert saved_bytes_question(autocast=True) == 8 * 16 * 2 + 8 * 32 * 2


def test_saved_bytes_checker(capsys):
    exercises.check_saved_bytes(1536, 768)
    assert "✅" in capsys.readouterr().out
    for wrong in [(1536 + 1024, 768), (1536, 768 + 512), (1536, 1536), (768, 768), (1536.0, 768), ("1536", 768), (None, None)]:
        with pytest.raises(ExerciseError):
            exercises.check_saved_bytes(*wrong)
    out = capsys.readouterr().out
    assert "counted once" in out  # the double-counting mistake gets a specific hint
