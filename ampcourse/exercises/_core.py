"""What every exercise checker shares: feedback lines, the ExerciseError they raise, and how a notebook shows it.

A checker (`check_*`) prints ``passed(...)`` or calls ``failed(...)``, which prints the verdict
(expected / got / hint) and raises :class:`ExerciseError` to stop the checker. What the caller sees
depends on where it runs (:func:`checker` wraps every exported ``check_*``):

- in a Jupyter/IPython kernel the wrapper swallows the error after the verdict is printed, so the cell
  ends without a traceback and "Run All" goes on to the next exercise;
- anywhere else (scripts, pytest), inside ``with raising():``, and where the environment sets
  ``AMPCOURSE_CHECKERS_RAISE=1`` (``make gpu-test`` does, for the kernels lax nbval starts: lax mode compares
  no outputs, so a checker that rejects a chapter's own solution must fail the cell), the ExerciseError
  propagates, so tests can prove that every checker rejects wrong answers.

Each checker's latest verdict is kept (per process) for :func:`summary`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["ExerciseError", "passed", "failed", "call_learner", "same_float", "number_list", "checker", "raising", "summary"]


class ExerciseError(AssertionError):
    """A wrong answer to an exercise (the message says what was expected and gives a hint)."""


_results: dict[str, bool] = {}   # checker name -> whether its latest call passed
_titles: dict[str, str] = {}     # checker name -> the title its passed()/failed() line used
_last_title: list[str] = []      # the title of the latest passed()/failed(), read by the wrapper
_force_raise = 0                 # > 0 inside `with raising():`


def passed(title: str, detail: str = "") -> None:
    """Print the success line."""
    _last_title[:] = [title]
    print(f"✅ {title}: correct." + (f" {detail}" if detail else ""))


def failed(title: str, expected: Any, got: Any, hint: str) -> None:
    """Print what went wrong and raise ExerciseError."""
    _last_title[:] = [title]
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


def number_list(title: str, values: Any, n: int, type_hint: str, length_hint: str) -> list[float]:
    """The learner's sequence as n floats (one scale per step), or the verdict that says what it should be."""
    try:
        got = [float(v) for v in values]
    except (TypeError, ValueError):
        failed(title, f"a list of {n} numbers", repr(values)[:80], type_hint)
    if len(got) != n:
        failed(title, f"{n} scales (one per step)", f"{len(got)} values", length_hint)
    return got


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """Inside this block a wrong answer raises ExerciseError even in a notebook (tests, learner scripts)."""
    global _force_raise
    _force_raise += 1
    try:
        yield
    finally:
        _force_raise -= 1


def _in_notebook() -> bool:
    """Whether we run in a Jupyter kernel (JupyterLab, Colab, VS Code), where a verdict must not end the cell in error."""
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None  # a kernel's shell; not a bare InteractiveShell in a test


def _must_raise() -> bool:
    """Whether a verdict raises here: inside `with raising():`, outside a kernel, or when AMPCOURSE_CHECKERS_RAISE=1."""
    return bool(_force_raise) or os.environ.get("AMPCOURSE_CHECKERS_RAISE") == "1" or not _in_notebook()


def _label(fn: Callable) -> str:
    """'Exercise 6.1' from a checker's docstring ('Exercise 6.1: ...'), else the function's name."""
    first = (fn.__doc__ or "").strip().split("\n")[0]
    return first.split(":")[0] if first.startswith("Exercise") else fn.__name__


def checker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a check_* function: record its verdict, and in a notebook show a failure without raising."""
    if getattr(fn, "_ampcourse_checker", False):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        name = fn.__name__
        _last_title.clear()
        try:
            out = fn(*args, **kwargs)
        except ExerciseError:  # the verdict is already printed
            _results[name] = False
            _titles[name] = _last_title[0] if _last_title else _label(fn)
            if _must_raise():
                raise
            return None
        except Exception as err:  # an answer the checker cannot even use (e.g. `...` left in a stub)
            _results[name] = False
            _titles.setdefault(name, _label(fn))
            if _must_raise():
                raise
            hint = ("replace the `raise NotImplementedError` stub with your code" if isinstance(err, NotImplementedError)
                    else "replace the `...` with your answer" if any(a is ... for a in (*args, *kwargs.values()))
                    else "check the type and shape of what you passed")
            print(f"❌ {_titles[name]}: not yet.\n   expected: an answer the checker can use\n"
                  f"   got:      {type(err).__name__}: {err}\n   hint:     {hint}")
            return None
        _results[name] = True
        _titles[name] = _last_title[0] if _last_title else _label(fn)
        return out

    run._ampcourse_checker = True  # type: ignore[attr-defined]
    return run


def summary(names: Sequence[str] | None = None) -> None:
    """Print which exercises pass (names: the checkers of one notebook; default: every checker run so far)."""
    exported = vars(sys.modules[__package__])  # ampcourse.exercises: the labels of exercises not run yet
    names = list(_results) if names is None else list(names)
    unknown = [n for n in names if n not in _titles and not callable(exported.get(n))]
    if unknown:
        raise ValueError(f"names: unknown checkers {unknown}; allowed: the check_* functions of ampcourse.exercises")
    done = sum(_results.get(n, False) for n in names)
    print(f"Exercises done: {done} of {len(names)}")
    for n in names:
        title = _titles.get(n) or _label(exported[n])
        mark, state = {True: ("✅", "done"), False: ("❌", "not yet")}.get(_results.get(n), ("·", "not run yet"))
        print(f"  {mark} {title}: {state}")
