"""Chapter 4 checkers accept right answers and reject the usual wrong ones with a hint."""

import pytest
import torch

from ampcourse import exercises
from ampcourse.device import pick
from ampcourse.exercises import ExerciseError


# --- 4.1 clip after unscale_ ------------------------------------------------------------------

def make_clipped_step(order="right", autocast=None, zero=True, update=True, use_scaler_step=True, clip=True):
    """A family of step functions: the right one and the mistakes learners make."""

    def step(model, loss_fn, x, y, optimizer, scaler, max_norm):
        if zero:
            optimizer.zero_grad(set_to_none=True)
        with autocast() if autocast else torch.autocast("cpu", enabled=False):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if order == "right":
            scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if use_scaler_step:
            scaler.step(optimizer)  # for "clip_first", step() unscales the already-clipped scaled gradients
        else:
            optimizer.step()
        if update:
            scaler.update()
    return step


@pytest.mark.parametrize("autocast", [None, pick("cpu", "bf16").autocast, pick("cpu", "fp16").autocast])
def test_clip_accepts_right_answers(autocast, capsys):
    exercises.check_clip_after_unscale(make_clipped_step(autocast=autocast))
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,hint", [
    (make_clipped_step(order="clip_first"), "clipped the \\*scaled\\* gradients"),
    (make_clipped_step(clip=False), "used the whole gradient"),
    (make_clipped_step(update=False), "call scaler.update\\(\\) after scaler.step"),
    (make_clipped_step(use_scaler_step=False), "weights unchanged after an inf gradient"),
    (make_clipped_step(zero=False), "zero the gradients"),
    (lambda *a: (_ for _ in ()).throw(NotImplementedError()), "replace the `raise NotImplementedError`"),
    ("not a function", "pass the function itself"),
])
def test_clip_rejects_wrong_answers(wrong, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_clip_after_unscale(wrong)
    assert "❌" in capsys.readouterr().out


def test_clip_unscaling_twice_gets_the_unscale_hint_not_the_update_one():
    def twice(model, loss_fn, x, y, optimizer, scaler, max_norm):
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.unscale_(optimizer)  # raises: once per step
        scaler.step(optimizer)
        scaler.update()

    with pytest.raises(ExerciseError, match="call scaler.unscale_\\(optimizer\\) once per step") as err:
        exercises.check_clip_after_unscale(twice)
    assert "scaler.update()" not in str(err.value)


def test_clip_rejects_always_normalising():
    """Scaling every gradient to max_norm (instead of only the long ones) is caught by the small-gradient call."""

    def normalise(model, loss_fn, x, y, optimizer, scaler, max_norm):
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.unscale_(optimizer)
        g = model.weight.grad
        if torch.isfinite(g).all():
            g.mul_(max_norm / g.norm())
        scaler.step(optimizer)
        scaler.update()

    with pytest.raises(ExerciseError, match="only shrink gradients whose norm exceeds"):
        exercises.check_clip_after_unscale(normalise)


# --- 4.2 scheduler skip -----------------------------------------------------------------------

def make_sched_step(rule="right"):
    """The right answer and the wrong ways to decide whether to step the scheduler."""

    def step(model, loss_fn, x, y, optimizer, scaler, scheduler):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if rule == "before":
            scheduler.step()
        before = scaler.get_scale()
        result = scaler.step(optimizer)
        scaler.update()
        after = scaler.get_scale()
        # "right": a skip lowers the scale, except at 0, where it stays 0
        skipped = {"right": after < before or before == 0, "lower": after < before, "changed": after != before,
                   "always": False, "never": True, "loss": not torch.isfinite(loss).item(),
                   "stale": scaler.get_scale() < after, "retval": result is None, "before": False}[rule]
        if rule != "before" and not skipped:
            scheduler.step()
        return skipped
    return step


def test_scheduler_accepts_the_right_answer(capsys):
    exercises.check_scheduler_skip(make_sched_step("right"))
    assert "✅" in capsys.readouterr().out


def test_scheduler_accepts_a_tensor_flag(capsys):
    def step(*args):
        return torch.tensor(make_sched_step("right")(*args))
    exercises.check_scheduler_skip(step)
    assert "✅" in capsys.readouterr().out  # the verdict itself, not only "did not raise"


@pytest.mark.parametrize("rule,hint", [
    ("always", "the first step was skipped"),            # torch's own warning fires
    ("loss", "the first step was skipped"),               # the loss is finite; the gradients are not
    ("stale", "the first step was skipped"),              # compares the new scale with itself
    ("never", "step the scheduler after every step that was not skipped"),
    ("retval", "step the scheduler after every step"),    # optimizer.step() returns None either way
    ("before", "the first step was skipped"),
    ("changed", "the scale \\*grew\\* on this step"),          # a growth is no skip
    ("lower", "at a scale of 0 a skipped step leaves the scale at 0"),  # 0 * backoff is 0: no drop to see
])
def test_scheduler_rejects_wrong_answers(rule, hint, capsys):
    with pytest.raises(ExerciseError, match=hint):
        exercises.check_scheduler_skip(make_sched_step(rule))
    assert "❌" in capsys.readouterr().out


def test_scheduler_rejects_a_wrong_return_value():
    def step(*args):
        make_sched_step("right")(*args)
        return None

    with pytest.raises(ExerciseError, match="return True when the scaler skipped"):
        exercises.check_scheduler_skip(step)
