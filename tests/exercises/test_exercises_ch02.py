"""Chapter 2 checkers accept right answers and reject wrong ones with feedback."""

import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("wrong", [
    lambda m: float(right_adam_bytes(m)),                       # the right value as a float
    lambda m: torch.tensor(float(right_adam_bytes(m))),         # ... as a float tensor
    lambda m: torch.tensor(right_adam_bytes(m)) > 0,            # a boolean tensor
    lambda m: True,
])
def test_adam_bytes_refuses_a_non_integer_type_with_its_own_verdict(wrong, capsys):
    """The type first: a right value as 110752.0 got the bf16 hint, a tensor the element_size hint."""
    with pytest.raises(ExerciseError, match="expected: an int"):
        exercises.check_adam_bytes(wrong)
    out = capsys.readouterr().out
    assert "bf16" not in out.split("hint", 1)[1] and "element_size 2" not in " ".join(out.split())
    assert "whole number of bytes" in out


def test_adam_bytes_accepts_what_operator_index_accepts(capsys):
    exercises.check_adam_bytes(lambda m: np.int64(right_adam_bytes(m)))
    exercises.check_adam_bytes(lambda m: torch.tensor(right_adam_bytes(m)))
    assert capsys.readouterr().out.count("✅") == 2


def test_adam_bytes_bf16_hint_only_for_the_bf16_model(capsys):
    """16 bytes per parameter is wrong only for the bf16 model: the hint names bf16 there and only there."""
    with pytest.raises(ExerciseError, match="mlp stored in bf16"):
        exercises.check_adam_bytes(lambda m: sum(16 * p.numel() for p in m.parameters()))
    assert "stored in bf16 (element_size 2)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(ExerciseError, match="for the mlp \\("):  # an fp32 model's wrong count: no bf16 talk
        exercises.check_adam_bytes(lambda m: sum(3 * p.numel() * p.element_size() for p in m.parameters()))
    assert "bf16" not in capsys.readouterr().out.split("hint", 1)[1]


# --- chapter 2's prose about its own cells (audit items): read from the chapter, run against fakes ---

def _chapter_2_cells(kind: str) -> list[str]:
    import json
    from pathlib import Path
    cells = json.loads((Path(__file__).parents[2] / "chapters/02_why_mixed_precision.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == kind]


def test_every_bench_command_in_chapter_2_parses(monkeypatch, tmp_path):
    """`python -m ampcourse.bench` needs --out: a command in the prose without it fails for the learner."""
    import re
    import shlex

    from ampcourse import bench

    class Parsed(Exception):
        pass

    def stop(*args, **kwargs):
        raise Parsed  # the arguments parsed: stop before a minute of measuring

    monkeypatch.setattr(bench, "run", stop)
    commands = [m.group(1) for cell in _chapter_2_cells("markdown")
                for m in re.finditer(r"`!\{sys\.executable\} -m ampcourse\.bench([^`]*)`", cell)]
    assert len(commands) >= 2
    for tail in commands:
        argv = [str(tmp_path / a) if a == "bench-out" else a for a in shlex.split(tail)]
        with pytest.raises(Parsed):
            bench.main(argv)


def _run_comparison_cell(size: str, batch: int, capsys) -> tuple[list, str]:
    """Chapter 2's measured-vs-predicted cell with 2.1's STEP_SIZE/STEP_BATCH, plan and make_task recorded."""
    from types import SimpleNamespace

    cell = next(s for s in _chapter_2_cells("code") if "measured = next(" in s)
    planned, made = [], []

    def fake_plan(model, inputs, **kw):
        planned.append((model, inputs.shape[0]))
        return SimpleNamespace(speedup=lambda p: 7.0)

    def make_task(name, n=1024, seed=0, size="tiny"):
        made.append((name, n, size))
        return SimpleNamespace(model=f"{size} model", data=SimpleNamespace(tensors=(torch.zeros(n, 4), None)),
                               loss_fn=None)

    tiny_task = SimpleNamespace(data=[None] * 32)
    namespace = {"steps": [{"model": "mlp"}, {"model": "transformer", "size": size, "batch": batch,
                                               "precision": "bf16", "amp_over_fp32": 0.5}],
                 "STEP_SIZE": size, "STEP_BATCH": batch, "amp": SimpleNamespace(device_type="cuda"),
                 "task": tiny_task, "tiny": SimpleNamespace(speedup=lambda p: 0.6),
                 "h100": SimpleNamespace(speedup=lambda p: 6.0), "plan": fake_plan,
                 "models": SimpleNamespace(make_task=make_task)}
    exec(cell, namespace)  # noqa: S102 - the chapter's own cell
    return made, capsys.readouterr().out


def test_chapter_2_compares_the_measured_model_with_a_plan_of_the_same_model(capsys):
    """On a GPU 2.1 times the large transformer at batch 64: the prediction beside it must be of that model."""
    made, out = _run_comparison_cell("large", 64, capsys)
    assert made == [("transformer", 64, "large")]
    assert "the large transformer, batch 64" in out and "the same large transformer, batch 64" in out
    assert f"{1 / 7.0:.2f}x the fp32 step" in out
    made, out = _run_comparison_cell("tiny", 32, capsys)  # a CPU: the tiny plan above is the measured model
    assert made == [] and "the same tiny transformer, batch 32" in out and f"{1 / 0.6:.2f}x" in out
