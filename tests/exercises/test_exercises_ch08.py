"""Chapter 8 checkers accept right answers and reject wrong ones with feedback."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampcourse import exercises
from ampcourse.doctor import examine
from ampcourse.exercises import ExerciseError
from ampcourse.policy import apply_policy
from planted import NaiveRMSNorm  # noqa: E402


def test_init_scale(capsys):
    exercises.check_init_scale(2.0**13, 0.9)  # 0.9 * 2**13 * 8 = 58982 <= 65504 < 0.9 * 2**14 * 8
    assert "✅" in capsys.readouterr().out


def test_init_scale_verdict_states_the_headroom_it_measured(capsys):
    exercises.check_init_scale(2.0**14, 0.37)  # 0.37 * 2**14 = 6062: 10.8x below 65504 (was "8x below": the margin)
    out = " ".join(capsys.readouterr().out.split())  # the verdict wraps its lines
    assert "6062, 10.8x below 65504 (at least 8x asked" in out and "5.4x)" in out, out


def test_init_scale_is_the_largest_power_of_two_within_the_margin(capsys):
    g = 0.5  # 0.5 * 2**14 * 8 = 65536 > 65504, so 2**13 is the answer
    exercises.check_init_scale(2.0**13, g)
    assert "✅" in capsys.readouterr().out
    for wrong in [2.0**14, 2.0**12, 2.0**16, 3000.0, 0.0, -8192.0, float("inf"), "big", None]:
        with pytest.raises(ExerciseError):
            exercises.check_init_scale(wrong, g)


def test_init_scale_answered_with_the_exponent_is_told_it_is_the_exponent():
    # chapter 8's exercise: max grad 0.37 -> 2**14; a learner who answers 14 gave k, not 2**k
    with pytest.raises(ExerciseError, match="14 is the exponent k, not the scale"):
        exercises.check_init_scale(14, 0.37)
    with pytest.raises(ExerciseError, match="looks like an exponent"):
        exercises.check_init_scale(13, 0.37)
    exercises.check_init_scale(2.0**14, 0.37)


class TwoProblems(nn.Module):
    """A naive RMSNorm whose x*x overflows fp16, and a linear layer whose outputs exceed 65504."""

    def __init__(self):
        super().__init__()
        self.up, self.norm = nn.Linear(16, 32), NaiveRMSNorm(32)
        self.boost, self.ln, self.head = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4)
        with torch.no_grad():
            self.up.weight.mul_(600)
            self.boost.weight.mul_(1e5)

    def forward(self, x):
        return self.head(self.ln(self.boost(F.gelu(self.norm(self.up(x))))))


def make():
    torch.manual_seed(0)
    return TwoProblems()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def test_fp32_islands(data, capsys):
    x, y = data
    exercises.check_fp32_islands(["norm", "boost"], make, x, y, F.cross_entropy)
    exercises.check_fp32_islands(("boost", "norm"), make, x, y, F.cross_entropy)
    assert capsys.readouterr().out.count("✅") == 2
    wrong_answers = [[], ["norm"], ["boost"], ["norm", "boost", "head"], ["norm", "booster"], [""], "norm", None, [3],
                     ["up"], ["up", "norm"], ["up", "head"], ["ln", "boost"], ["up", "norm", "boost"]]
    for wrong in wrong_answers:
        with pytest.raises(ExerciseError):
            exercises.check_fp32_islands(wrong, make, x, y, F.cross_entropy)


def test_an_accepted_answer_is_one_the_doctor_itself_calls_clean(data):
    """The checker and the doctor agree: with the doctor's own islands applied, examine says fp16 is clean (before,
    'boost' kept in fp32 still drew an activation_overflow warning that refused fp16, while the checker said clean)."""
    x, y = data
    for names in (["norm", "boost"], ["up", "boost"]):
        model = make()
        apply_policy(model, {n: "fp32" for n in names})
        report = examine(model, x, y, loss_fn=F.cross_entropy, precisions=("fp16",))
        assert report.is_clean("fp16"), report.summary()
        [f] = report.find("activation_overflow", "fp16")
        assert f.module == "boost" and f.severity == "info" and "fine as it is" in f.message


def test_fp32_islands_accepts_an_equivalent_answer_the_doctor_did_not_name(data, capsys):
    """'up' in fp32 feeds the naive norm fp32 inputs: as few islands as the doctor's, and fp16 is clean."""
    x, y = data
    exercises.check_fp32_islands(["up", "boost"], make, x, y, F.cross_entropy)
    out = capsys.readouterr().out
    assert "✅" in out and "The doctor named ['boost', 'norm']" in " ".join(out.split())  # verdicts wrap between words
