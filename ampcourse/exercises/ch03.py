"""Chapter 3 exercises: predict autocast's output dtypes; reimplement GradScaler's scale update."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ._core import call_learner, failed, passed

__all__ = ["AUTOCAST_QUESTIONS", "autocast_answers", "check_autocast_dtypes", "check_scale_update"]


def _inputs() -> dict[str, torch.Tensor]:
    """The fp32 tensors every question starts from: x (4x8), w (8x8), b (8,), y (4,) class targets."""
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 8, generator=gen), "w": torch.randn(8, 8, generator=gen),
            "b": torch.randn(8, generator=gen), "y": torch.arange(4)}


#: Expressions (as a learner would write them) -> how to run them; x, w, b are fp32, y holds class indices.
AUTOCAST_QUESTIONS: dict[str, Callable[[dict], torch.Tensor]] = {
    "x @ w": lambda t: t["x"] @ t["w"],
    "x + b": lambda t: t["x"] + t["b"],
    "(x @ w) + x": lambda t: (t["x"] @ t["w"]) + t["x"],
    "torch.softmax(x @ w, dim=-1)": lambda t: torch.softmax(t["x"] @ t["w"], dim=-1),
    "F.layer_norm(x @ w, (8,))": lambda t: F.layer_norm(t["x"] @ t["w"], (8,)),
    "F.cross_entropy(x @ w, y)": lambda t: F.cross_entropy(t["x"] @ t["w"], t["y"]),
    "F.relu(x @ w).sum()": lambda t: F.relu(t["x"] @ t["w"]).sum(),
}


def autocast_answers(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    """Run every question under torch.amp.autocast(device_type, dtype) and return the output dtypes."""
    tensors = {k: v.to(device_type) for k, v in _inputs().items()}
    with torch.amp.autocast(device_type=device_type, dtype=dtype):
        return {q: fn(tensors).dtype for q, fn in AUTOCAST_QUESTIONS.items()}


def _as_dtype(value: Any) -> torch.dtype | None:
    """Accept torch.bfloat16 or a name such as 'bfloat16', 'bf16', 'torch.float32'."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().removeprefix("torch.")
        key = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(key, key)
        found = getattr(torch, key, None)
        return found if isinstance(found, torch.dtype) else None
    return None


def check_autocast_dtypes(predictions: Mapping[str, Any], device_type: str = "cpu",
                          dtype: torch.dtype = torch.bfloat16) -> None:
    """Exercise 3.1: predict the output dtype of each AUTOCAST_QUESTIONS expression under CPU bf16 autocast."""
    title = f"Exercise 3.1 (dtypes under {device_type} {str(dtype).removeprefix('torch.')} autocast)"
    if not isinstance(predictions, Mapping):
        failed(title, "a dict {expression: dtype}", type(predictions).__name__, "fill in the dict in the cell above")
    missing = [q for q in AUTOCAST_QUESTIONS if q not in predictions]
    if missing:
        failed(title, "a prediction for every expression", f"missing {missing}", "copy the keys from AUTOCAST_QUESTIONS")
    truth = autocast_answers(device_type, dtype)
    wrong = {q: predictions[q] for q in truth if _as_dtype(predictions[q]) != truth[q]}
    if wrong:
        # Name the expressions to rethink, never the dtypes they give: that would hand over the answer.
        q, got = next(iter(wrong.items()))
        unreadable = [w for w in wrong.values() if _as_dtype(w) is None]
        hint = (f"{unreadable[0]!r} is not a dtype: write torch.bfloat16, 'float32', 'bf16', ..." if unreadable else
                "for each, ask which list autocast puts the op on (low precision, fp32, or none: then type promotion "
                f"or the input's dtype decides); {_table_hint(device_type, dtype)}")
        failed(title, f"the dtype torch gives for each expression ({len(truth) - len(wrong)} of {len(truth)} right)",
               f"{len(wrong)} wrong: {', '.join(wrong)} (first: you said {got})", hint)
    passed(title, "You can read an autocast region the way torch runs it.")


def _table_hint(device_type: str, dtype: torch.dtype) -> str:
    """Where chapter 3 prints the op table for this exercise's autocast (section 3.4's names for it).

    Section 3.4's first table is the chapter's device's: CUDA's on a GPU, where softmax, layer_norm and sum run in
    fp32, while this exercise asks about ``device_type`` (CPU by default). So the hint names the table built for it.

    Args:
        device_type: the exercise's autocast device ("cpu" or "cuda").
        dtype: the exercise's autocast dtype.

    Example:
        >>> "cpu_bf16" in _table_hint("cpu", torch.bfloat16)
        True
    """
    if device_type == "cpu":
        name = "cpu_bf16" if dtype == torch.bfloat16 else "cpu_fp16"
        return (f"section 3.4's CPU table {name} has every op (print(autocast_ops.format_table({name}))); "
                "not the section's first table, which is the chapter's device's: CUDA's on a GPU")
    short = str(dtype).removeprefix("torch.")
    return (f"section 3.4's CUDA table has every op (print(autocast_ops.format_table(autocast_ops.op_table('cuda', "
            f"torch.{short}))))")


def _torch_scales(found_inf: list[bool], init_scale: float, growth_interval: int) -> list[tuple[float, int]]:
    """(scale, growth tracker) after each step of a real GradScaler('cpu'), given which steps had inf gradients.

    The tracker is read from the scaler's state_dict (``_growth_tracker``: clean steps since the last growth or
    backoff), which torch._amp_update_scale_ updates together with the scale.
    """
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    states = []
    for bad in found_inf:
        opt.zero_grad()
        scaler.scale((param * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        states.append((scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])))
    return states


def check_scale_update(update: Callable[[float, int, bool, int], tuple[float, int]]) -> None:
    """Exercise 3.2: update(scale, tracker, found_inf, growth_interval) -> (new scale, new tracker), like GradScaler.

    Both are compared step by step with a real ``torch.amp.GradScaler("cpu")``: the scale, and the tracker
    (GradScaler's ``_growth_tracker``), so an update that gets the scales right with a tracker that never goes
    back to 0 (growing whenever it is a multiple of growth_interval) is refused too.

    Args:
        update: the learner's function of (scale, tracker, found_inf, growth_interval).

    Example:
        >>> check_scale_update(lambda s, t, bad, n: (s * 0.5, 0) if bad else (s * 2.0, 0) if t + 1 == n else (s, t + 1))  # doctest: +ELLIPSIS
        ✅ Exercise 3.2 (GradScaler's scale update): correct. ...
    """
    title = "Exercise 3.2 (GradScaler's scale update)"
    cases = [
        ([False] * 5, 1024.0, 2),
        ([False, True, False, False, False], 1024.0, 3),
        ([True, True, False, True, False, False], 65536.0, 2),
        ([False, False, True, False, False, False, False], 8.0, 1),
    ]
    for found_inf, init, interval in cases:
        want = _torch_scales(found_inf, init, interval)
        scale, tracker, got = init, 0, []
        for bad in found_inf:
            result = call_learner(title, update, scale, tracker, bad, interval)
            if not (isinstance(result, tuple) and len(result) == 2):
                failed(title, "a tuple (scale, tracker)", repr(result), "return both the new scale and the new tracker")
            scale, tracker = result
            got.append((scale, tracker))
        if [float(s) for s, _ in got] != [s for s, _ in want]:
            failed(title, f"scales {[s for s, _ in want]} for found_inf={found_inf}, growth_interval={interval}",
                   [s for s, _ in got], "on inf: scale * 0.5 and tracker back to 0; otherwise tracker + 1, and when it "
                   "reaches growth_interval: scale * 2 and tracker back to 0")
        if [_tracker(t) for _, t in got] != [t for _, t in want]:
            failed(title, f"trackers {[t for _, t in want]} (GradScaler's _growth_tracker) for found_inf={found_inf}, "
                   f"growth_interval={interval}", [t for _, t in got],
                   "the tracker counts clean steps since the last change of the scale: back to 0 after an inf "
                   "and after the scale grows")
    passed(title, "Your update matches torch.amp.GradScaler step for step, scale and growth tracker.")


def _tracker(t: Any) -> int | float | None:
    """A learner's tracker as a number to compare (an int, a float such as 1.0, a one-element tensor); None if not one."""
    try:
        v = float(t)
    except (TypeError, ValueError, RuntimeError):
        return None
    return int(v) if v.is_integer() else v
