"""What every exercise checker shares: feedback lines and the ExerciseError they raise."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["ExerciseError", "passed", "failed", "call_learner", "same_float"]


class ExerciseError(AssertionError):
    """A wrong answer to an exercise (the message says what was expected and gives a hint)."""


def passed(title: str, detail: str = "") -> None:
    """Print the success line."""
    print(f"✅ {title}: correct." + (f" {detail}" if detail else ""))


def failed(title: str, expected: Any, got: Any, hint: str) -> None:
    """Print what went wrong and raise ExerciseError."""
    msg = f"❌ {title}: not yet.\n   expected: {expected}\n   got:      {got}\n   hint:     {hint}"
    print(msg)
    raise ExerciseError(msg)


def call_learner(title: str, fn: Callable, *args) -> Any:
    """Call the learner's function, turning its exceptions into feedback."""
    if not callable(fn):
        failed(title, "a function", f"{type(fn).__name__} {fn!r}", "pass the function itself, without calling it")
    try:
        return fn(*args)
    except NotImplementedError:
        failed(title, "an implementation", "NotImplementedError", "replace the `raise NotImplementedError` stub with your code")
    except Exception as err:  # the learner's code: report any failure as feedback
        failed(title, f"a number for {args!r}", f"{type(err).__name__}: {err}", "run your function on that input and read the error")


def same_float(a: float, b: float) -> bool:
    """Equal, or both NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))
