"""Chapter 4 exercises: clip after unscale_, and keep the LR schedule on skipped steps."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from ._core import failed, passed

__all__ = ["check_clip_after_unscale", "check_scheduler_skip"]

# A linear model whose loss is (model(x) * y).sum(): the weight gradient is exactly y * x, whatever the
# weights are, so the checker knows the true gradient of every call.
_X = torch.tensor([[1.0, 2.0, 2.0, 4.0]])
_SCALE = 2.0**12


def _call(title: str, fn: Callable, *args):
    """Run the learner's step function, turning its exceptions into feedback with a hint."""
    if not callable(fn):
        failed(title, "a function", f"{type(fn).__name__} {fn!r}", "pass the function itself, without calling it")
    try:
        return fn(*args)
    except NotImplementedError:
        failed(title, "an implementation", "NotImplementedError",
               "replace the `raise NotImplementedError` stub with your code")
    except Exception as err:  # the learner's code: report any failure as feedback
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        failed(title, "your step function to run", f"{type(err).__name__}: {text}", _error_hint(text))


def _error_hint(text: str) -> str:
    """The hint for GradScaler's errors about the order of its calls (torch's wording, and LossScaler's).

    Args:
        text: the first line of the error message.

    Example::

        >>> _error_hint("unscale_() has already been called on this optimizer since the last update().")
        'call scaler.unscale_(optimizer) once per step, ...'
    """
    if "unscale_() has already been called" in text:  # before the "already been called" of step(), below
        return ("call scaler.unscale_(optimizer) once per step, after backward() and before clipping; "
                "scaler.step(optimizer) knows the gradients are unscaled and does not unscale them again")
    if "step()" in text or "already been called" in text:  # "unscale_() is being called after step()" too:
        # the step before did not end with update(), which starts the next one
        return "call scaler.update() after scaler.step(optimizer), once per step"
    return "run your step on a small model and read the error"


def _rounded(t: torch.Tensor) -> list[float]:
    """A short printable list."""
    return [float(f"{v:.4g}") for v in t.tolist()]


def _probe_model() -> nn.Linear:
    """Linear(4 -> 1), no bias, weights zero."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model


def _probe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(out * y).sum(): d loss / d weight = y * x."""
    return (out.float() * y).sum()


def _weights(model: nn.Module) -> torch.Tensor:
    """A detached copy of the weight row."""
    return model.weight.detach().clone().view(-1)


def check_clip_after_unscale(clipped_step: Callable) -> None:
    """Exercise 4.1: clipped_step(model, loss_fn, x, y, optimizer, scaler, max_norm) clips the true gradients."""
    title = "Exercise 4.1 (clip after unscale_)"
    model, lr, max_norm = _probe_model(), 0.1, 1.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=_SCALE)

    # 1) a big gradient (norm 12.5): the update must have norm lr * max_norm
    y = torch.tensor([[2.5]])
    grad = (y * _X).view(-1)
    before = _weights(model)
    _call(title, clipped_step, model, _probe_loss, _X, y, opt, scaler, max_norm)
    step = _weights(model) - before
    want = -lr * grad * (max_norm / grad.norm())
    if not torch.allclose(step, want, rtol=1e-2, atol=1e-6):
        got = step.norm().item()
        if math.isclose(got, lr * grad.norm().item(), rel_tol=1e-2):
            hint = "the step used the whole gradient: clip with torch.nn.utils.clip_grad_norm_(params, max_norm)"
        elif got < lr * max_norm / 100:
            hint = ("the step is ~scale times too small: you clipped the *scaled* gradients. "
                    "Call scaler.unscale_(optimizer) before clip_grad_norm_")
        else:
            hint = "clip the gradient norm to max_norm after scaler.unscale_(optimizer), then scaler.step(optimizer)"
        failed(title, f"weight update {_rounded(want)} (norm {lr * max_norm:g})",
               f"{_rounded(step)} (norm {got:.3g})", hint)

    # 2) an overflowing gradient: the scaler must skip the step and halve its scale
    before = _weights(model)
    _call(title, clipped_step, model, _probe_loss, _X, torch.tensor([[math.inf]]), opt, scaler, max_norm)
    if not torch.equal(_weights(model), before):
        failed(title, "weights unchanged after an inf gradient", _weights(model).tolist(),
               "let scaler.step(optimizer) take the step: it skips optimizer.step() when the gradients hold inf/nan")
    if scaler.get_scale() != _SCALE / 2:
        failed(title, f"scale {_SCALE / 2:g} after one overflow", scaler.get_scale(),
               "call scaler.update() after scaler.step(optimizer), every step")

    # 3) a small gradient (norm 0.125 < max_norm): no clipping, the plain SGD step
    y = torch.tensor([[0.025]])
    before = _weights(model)
    _call(title, clipped_step, model, _probe_loss, _X, y, opt, scaler, max_norm)
    want = -lr * (y * _X).view(-1)
    step = _weights(model) - before
    if not torch.allclose(step, want, rtol=1e-2, atol=1e-6):
        failed(title, f"weight update {_rounded(want)} (gradient below max_norm: unchanged)",
               _rounded(step),
               "zero the gradients at the start of each step, and only shrink gradients whose norm exceeds "
               "max_norm (clip_grad_norm_ does both right)")
    passed(title, "Clipping acts on true gradients, overflowing steps are skipped, small gradients pass untouched.")


def _schedule_hint(stepped: list[bool], pattern: list[bool], grew: list[bool], zero_step: int) -> str:
    """Why the scheduler stepped (or not) where it should not have, from the first step it got wrong.

    Args:
        stepped: whether the learner's function stepped the scheduler, per call.
        pattern: whether the scaler skipped the optimizer step, per call.
        grew: whether the scale grew during the call (after growth_interval clean steps).
        zero_step: the call made at a scale of 0.

    Example::

        >>> _schedule_hint([True, False], [False, False], [False, True], 5)   # a growth counted as a skip
    """
    for i, (s, skipped) in enumerate(zip(stepped, pattern)):
        if s == (not skipped):
            continue
        if grew[i]:
            return ("the scale *grew* on this step (it doubles after growth_interval clean steps): that is no skip. "
                    "Compare with `<`: a skipped step lowers the scale")
        if i == zero_step:
            return ("at a scale of 0 a skipped step leaves the scale at 0 (0 * backoff_factor is 0): count a scale "
                    "of 0 before scaler.step() as a skip too (`skipped = after < before or before == 0`)")
        if skipped:
            return ("compare scaler.get_scale() before scaler.step() with the value after scaler.update(): it drops "
                    "when the step was skipped (and stays 0 once it has reached 0)")
        return "step the scheduler after every step that was not skipped"
    return "step the scheduler once after each step that was not skipped, and not for a skipped one"


def check_scheduler_skip(step_with_schedule: Callable) -> None:
    """Exercise 4.2: step_with_schedule(model, loss_fn, x, y, optimizer, scaler, scheduler) -> skipped (bool);
    the scheduler steps only after steps that happened.

    The scaler grows its scale after 2 clean steps (so that a growth is seen), and the last step runs at a scale
    of 0, where a skip no longer lowers it.
    """
    title = "Exercise 4.2 (no scheduler step on a skipped step)"
    model = _probe_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    # growth_interval=2: the scale grows during the run, and an answer that takes any change of the scale for a
    # skip (`!=`) is caught; with GradScaler's default of 2000 it would never grow here.
    scaler = torch.amp.GradScaler("cpu", init_scale=_SCALE, growth_interval=2)
    overflow = {"now": False}
    # Inject inf into the gradient (the loss stays finite, as when fp16 activations overflow in backward).
    model.weight.register_hook(lambda g: g * math.inf if overflow["now"] else g)
    pattern = [True, False, False, True, False, False, True]
    zero_step = len(pattern) - 1
    returned, stepped, grew = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, skip in enumerate(pattern):
            if i == zero_step:  # where ~160 overflows in a row would take this scale: 2**12 * 0.5**162 is 0 in float32
                scaler.update(new_scale=0.0)
            overflow["now"] = skip
            epoch, scale = sched.last_epoch, scaler.get_scale()
            returned.append(_call(title, step_with_schedule, model, _probe_loss, _X, torch.tensor([[1.0]]),
                                  opt, scaler, sched))
            stepped.append(sched.last_epoch > epoch)
            grew.append(scaler.get_scale() > scale)
    early = [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    taken = pattern.count(False)
    if early:
        failed(title, "no warning from torch", f"UserWarning: {str(early[0].message).split('. ')[0]}",
               "the first step was skipped, so the scheduler must not step yet")
    if sched.last_epoch != taken or stepped != [not s for s in pattern]:
        failed(title, f"scheduler stepped {taken} times, after steps {[i for i, s in enumerate(pattern) if not s]} "
                      "(the steps that happened)",
               f"{sched.last_epoch} times, after steps {[i for i, s in enumerate(stepped) if s]}",
               _schedule_hint(stepped, pattern, grew, zero_step))
    flags = [bool(r) if isinstance(r, (bool, torch.Tensor)) and getattr(r, "numel", lambda: 1)() == 1 else r
             for r in returned]
    if flags != pattern:
        wrong = next(i for i, (f, p) in enumerate(zip(flags, pattern)) if f != p)
        hint = ("return True when the scaler skipped optimizer.step(), else False" if not isinstance(flags[wrong], bool)
                else _schedule_hint([not f for f in flags], pattern, grew, zero_step))
        failed(title, f"returned skipped flags {pattern}", returned, hint)
    passed(title, f"The LR decayed {taken} times over {len(pattern)} steps, {len(pattern) - taken} of them skipped "
                  "(one at a scale of 0), and a growth of the scale was not taken for a skip.")
