"""Chapter 8 exercises: an init_scale from the largest gradient, fp32 islands chosen with the doctor."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import formats
from ._core import failed, passed

__all__ = ["check_init_scale", "check_fp32_islands"]

_ERRORS = ("nonfinite", "activation_overflow", "precision_loss")  # what an fp32 island can cure


def check_init_scale(scale: Any, max_grad: float, margin: float = 8.0) -> None:
    """Exercise 8.1: the largest power of two s with max_grad * s * margin <= fp16's max."""
    title = "Exercise 8.1 (an init_scale from the largest gradient)"
    top = formats.spec("fp16").max
    try:
        s = float(scale)
    except (TypeError, ValueError):
        failed(title, "a number such as 2.0**10", repr(scale)[:80], "answer with a power of two")
    want = 2.0 ** math.floor(math.log2(top / (max_grad * margin)))
    k = int(math.log2(want))
    if math.isfinite(s) and s == int(s) and int(s) == k:
        # the exponent itself (14 for 2**14): right number, wrong quantity
        failed(title, f"the scale 2.0**{k} = {want:g}", f"{s:g}", f"{s:g} is the exponent k, not the scale: "
               f"init_scale is 2.0**k, here 2.0**{k}")
    if not (math.isfinite(s) and s > 0) or math.frexp(s)[0] != 0.5:
        hint = ("GradScaler's scales are powers of two: write 2.0**k" if not (math.isfinite(s) and s == int(s)
                                                                             and 0 < s < 128)
                else f"{s:g} looks like an exponent: the scale is 2.0**k (2.0**{int(s)} = {2.0 ** int(s):g})")
        failed(title, "a positive power of two", s, hint)
    if max_grad * s * margin > top:
        failed(title, f"max_grad x scale x {margin:g} <= {top:g}", f"{max_grad:.4g} x {s:g} x {margin:g} = "
               f"{max_grad * s * margin:.4g}", "too large: the largest gradient would overflow once it grows a little")
    if s < want:
        failed(title, f"the largest such power of two (at least 2**{int(math.log2(s)) + 1})", f"2**{int(math.log2(s))}",
               "too small: every halving flushes more small gradients; take the largest scale that keeps the margin")
    passed(title, f"2**{int(math.log2(s))}: max|grad| x scale = {max_grad * s:.4g}, {top / (max_grad * s):.3g}x below "
           f"{top:g} (at least {margin:g}x asked; one doubling more would leave {top / (2 * max_grad * s):.3g}x).")


def check_fp32_islands(names: Any, make_model: Callable, inputs, targets, loss_fn: Callable) -> None:
    """Exercise 8.2: the fewest modules to run in fp32 so that fp16 autocast examines clean.

    Judged by the outcome, not by matching one list: any set of modules that leaves no error under fp16 and is
    no larger than the doctor's own ``fp32_modules`` passes. An island upstream can cure a module too (the
    layer that feeds a naive norm, in fp32, hands it fp32 inputs), so ``['up', 'boost']`` is as right as the
    doctor's ``['norm', 'boost']`` for the chapter's twin.
    """
    from ..doctor import examine
    from ..policy import apply_policy

    title = "Exercise 8.2 (fp32 islands)"
    if isinstance(names, str) or not isinstance(names, (list, tuple, set)) or not all(isinstance(n, str) for n in names):
        failed(title, "a list of module names", repr(names)[:80], "module names as model.named_modules() gives them, "
               "e.g. ['blocks.0.norm']")
    model = make_model()
    known = dict(model.named_modules())
    unknown = [n for n in names if n not in known or n == ""]
    if unknown:
        failed(title, "names of submodules", unknown, f"the model's modules are {[n for n in known if n][:8]}")
    if names:
        apply_policy(model, {n: "fp32" for n in names})
    report = examine(model, inputs, targets, loss_fn=loss_fn, precisions=("fp16",))
    if not report.is_clean("fp16"):  # the doctor's own verdict: the checker never calls clean what it refuses
        left = ([f for f in report.findings if f.kind in _ERRORS and f.severity in ("error", "warning")]
                or [f for f in report.findings if f.severity in ("error", "warning")])
        got = f"{left[0].kind} at {left[0].module!r}: {left[0].message}" if left else report.verdicts["fp16"].line()
        failed(title, "fp16 clean (report.is_clean('fp16'))", got,
               "run examine() on the model, keep each module it names in fp32, and run it again until it is clean")
    need = examine(make_model(), inputs, targets, loss_fn=loss_fn, precisions=("fp16",)).fp32_modules
    if len(set(names)) > len(need):
        failed(title, f"{len(need)} module(s)", f"{len(set(names))}: {sorted(set(names))}",
               "every island runs in slow fp32 and converts its inputs: keep only the modules the doctor names")
    other = "" if set(names) == set(need) else (
        f" The doctor named {sorted(need)}; yours cures the same problems with as few islands.")
    passed(title, f"fp16 is clean with {sorted(set(names))} in fp32.{other}")
