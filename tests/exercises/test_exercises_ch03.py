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


def never_resets_the_tracker(scale, tracker, found_inf, growth_interval):
    """Right scales, wrong tracker: grows whenever the count is a multiple of growth_interval, never resets it."""
    if found_inf:
        return scale * 0.5, 0
    tracker += 1
    return (scale * 2.0, tracker) if tracker % growth_interval == 0 else (scale, tracker)


def test_scale_update_compares_the_tracker_with_gradscalers(capsys):
    from ampcourse.exercises.ch03 import _torch_scales
    # GradScaler's own tracker (its state_dict's _growth_tracker) goes back to 0 after a growth and after an inf
    assert _torch_scales([False] * 5, 1024.0, 2) == [(1024.0, 1), (2048.0, 0), (2048.0, 1), (4096.0, 0), (4096.0, 1)]
    assert [s for s, _ in _torch_scales([False, True, False], 8.0, 2)] == [8.0, 4.0, 4.0]
    assert [t for _, t in _torch_scales([False, True, False], 8.0, 2)] == [1, 0, 1]
    with pytest.raises(ExerciseError, match="trackers"):
        exercises.check_scale_update(never_resets_the_tracker)
    assert "after the scale grows" in capsys.readouterr().out


def test_autocast_dtypes_hint_points_to_the_cpu_table(capsys):
    """Section 3.4's first table is CUDA's on a GPU; the exercise is CPU autocast: the hint names cpu_bf16."""
    with pytest.raises(ExerciseError):
        exercises.check_autocast_dtypes({**RIGHT, "torch.softmax(x @ w, dim=-1)": torch.float32})
    hint = capsys.readouterr().out.split("hint", 1)[1]
    assert "cpu_bf16" in " ".join(hint.split()) and "generated on this device" not in hint
    with pytest.raises(ExerciseError):
        exercises.check_autocast_dtypes({**RIGHT, "x @ w": torch.float32}, "cpu", torch.float16)
    assert "cpu_fp16" in capsys.readouterr().out


def test_the_cpu_table_the_hint_names_is_in_chapter_3():
    import json
    from pathlib import Path
    cells = json.loads((Path(__file__).parents[2] / "chapters/03_torch_amp_api.ipynb").read_text())["cells"]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert 'cpu_bf16 = autocast_ops.op_table("cpu", torch.bfloat16)' in code
    assert 'cpu_fp16 = autocast_ops.op_table("cpu", torch.float16)' in code


# --- chapter 3's prose about what its cells do (audit items): read from the chapter, checked against the code ---

def _markdown(name: str) -> list[str]:
    import json
    from pathlib import Path
    cells = json.loads((Path(__file__).parents[2] / f"chapters/{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def test_chapter_3_says_which_dtype_cuda_autocast_uses(monkeypatch):
    """pick(precision='amp') is bf16 on GPUs with native bf16 (Ampere+), fp16 before: the opening says both."""
    from ampcourse import device
    for native, want in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(device, "native_bf16", lambda dev, native=native: native)
        assert device._amp_precision(torch.device("cuda", 0)) == want
    opening = " ".join(_markdown("03_torch_amp_api")[0].split())
    assert "CUDA autocast (fp16)" not in opening
    assert "in bf16 on GPUs with bf16 units (Ampere and newer) and fp16 on older ones" in opening


def test_chapter_3_cross_reference_to_the_weight_cast_cache_names_its_section():
    import re
    text = _markdown("03_torch_amp_api")
    section, home = None, None
    for cell in text:  # the section whose cells introduce cache_enabled
        for m in re.finditer(r"^## (\d+\.\d+) ", cell, re.M):
            section = m.group(1)
        if "cache_enabled" in cell and "cached inside a region" in cell:
            home = section
    refs = [m.group(1) for cell in text for m in re.finditer(r"weight-cast cache \(section (\d+\.\d+)\)", cell)]
    assert home == "3.1" and refs and set(refs) == {home}
