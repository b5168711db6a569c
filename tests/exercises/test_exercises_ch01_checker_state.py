"""What every checker does whatever the learner's notebook did first (ampcourse.exercises._core.checker):
a known torch state (restored afterwards), placeholder answers, sys.exit() and a function that never returns
get verdicts, and verdict lines wrap between words. Examples from chapters 1, 2, 3 and 5; the rule is one
wrapper, so one example per kind of state is enough."""

import re
import sys
import time

import pytest
import torch

from ampcourse import exercises
from ampcourse.exercises import ExerciseError, _core

from test_exercises_ch01 import right_fp16_ulp
from test_exercises_ch03 import RIGHT as RIGHT_AUTOCAST
from test_exercises_ch05 import _square


@pytest.fixture
def restore_torch():
    """Put torch's global state back even when a test fails half-way."""
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


def test_default_dtype_float64_does_not_fail_a_right_answer(restore_torch, capsys):
    torch.set_default_dtype(torch.float64)
    exercises.check_autocast_dtypes(RIGHT_AUTOCAST)   # 3.1
    exercises.check_fp16_ulp(right_fp16_ulp)          # 1.1
    assert capsys.readouterr().out.count("✅") == 2
    assert torch.get_default_dtype() is torch.float64  # the learner's choice is back


def test_grad_mode_off_does_not_fail_a_right_answer(restore_torch, capsys):
    torch.set_grad_enabled(False)
    exercises.check_square_function(_square())  # 5.2: runs a backward
    assert "✅" in capsys.readouterr().out
    assert not torch.is_grad_enabled()
    with torch.inference_mode():
        exercises.check_square_function(_square())
        assert torch.is_inference_mode_enabled()
    assert "✅" in capsys.readouterr().out


def test_an_open_autocast_does_not_fail_a_right_answer(capsys):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exercises.check_saved_bytes(1536, 768)  # 2.2: measures saved activations with and without autocast
        assert torch.is_autocast_enabled("cpu")
    assert "✅" in capsys.readouterr().out


def test_wrong_answers_are_still_rejected_in_a_changed_state(restore_torch):
    torch.set_default_dtype(torch.float64)
    with pytest.raises(ExerciseError):
        exercises.check_saved_bytes(1536, 1536)
    with pytest.raises(ExerciseError):
        exercises.check_fp16_ulp(lambda x: 2.0**-10 * abs(x))


@pytest.mark.parametrize("answer", [..., [..., 1.0], {"x @ w": ...}])
def test_placeholder_reads_not_answered_yet(answer, capsys):
    check = exercises.check_autocast_dtypes if isinstance(answer, dict) else exercises.check_largest_exact_integer
    with pytest.raises(ExerciseError):
        check(answer) if isinstance(answer, dict) else check(answer, "bf16")
    out = capsys.readouterr().out
    assert "not answered yet" in out and "Ellipsis" not in out


def test_sys_exit_in_a_learner_function_gets_a_verdict(capsys):
    with pytest.raises(ExerciseError):
        exercises.check_fp16_ulp(lambda x: sys.exit(0))
    out = capsys.readouterr().out
    assert "sys.exit(0)" in out and "return the answer" in out


def test_a_learner_function_that_never_returns_is_bounded(monkeypatch, capsys):
    monkeypatch.setattr(_core, "TIME_LIMIT_S", 0.5)

    def sleeps(x):
        try:
            time.sleep(60)
        except Exception:  # a learner's broad except must not swallow the limit
            pass
        return 1.0

    start = time.monotonic()
    with pytest.raises(ExerciseError):
        exercises.check_fp16_ulp(sleeps)
    assert time.monotonic() - start < 10
    assert "still running" in capsys.readouterr().out
    exercises.check_fp16_ulp(right_fp16_ulp)  # the alarm is off again: the next check is not cut short


def test_verdict_lines_wrap_between_words(capsys):
    long_hint = " ".join(["before"] * 40)
    with pytest.raises(ExerciseError):
        _core.failed("Exercise 0.0", "x", "y", long_hint)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    hint = " ".join(line.strip() for line in lines[3:]).removeprefix("hint:").strip()
    assert hint == long_hint  # every word whole, none broken across lines
    assert all(re.fullmatch(r" {13}\S.*", line) for line in lines[4:])  # continuation lines under the text


def test_in_a_kernel_a_learner_function_that_never_returns_gets_a_verdict_and_the_next_cell_runs(tmp_path):
    """The bound works where learners run checkers: in a Jupyter kernel (cells run in its main thread)."""
    import nbformat
    from nbclient import NotebookClient

    code = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [code("import time\nfrom ampcourse import exercises\nfrom ampcourse.exercises import _core\n"
                     "_core.TIME_LIMIT_S = 1.0\n"
                     "def fp16_ulp(x):\n    time.sleep(120)\n"
                     "exercises.check_fp16_ulp(fp16_ulp)"),
                code("import sys\nexercises.check_fp16_ulp(lambda x: sys.exit(3))"),
                code("print('next cell ran')")]
    NotebookClient(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert "still running" in texts[0] and "sys.exit(3)" in texts[1] and texts[2] == "next cell ran\n"
    assert not any(o.output_type == "error" for c in nb.cells for o in c.outputs)
