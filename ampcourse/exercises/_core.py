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

Every checker also runs in a known state, whatever the learner's notebook did before (:func:`checker`):
torch's default dtype float32, gradients on, autocast off (restored afterwards, so the learner's state
is left as it was); a placeholder answer (``...``) is "not answered yet"; a learner function that calls
``sys.exit()`` or runs longer than the checker's time limit (``time_limit_s``, default
:data:`TIME_LIMIT_S`) gets a verdict instead of escaping the checker or blocking the notebook.

Each checker's latest verdict is kept (per process) for :func:`summary`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import math
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["ExerciseError", "passed", "failed", "call_learner", "same_float", "number_list", "checker", "raising", "summary",
           "known_torch_state", "time_limit", "TIME_LIMIT_S", "NOT_ANSWERED"]

#: Seconds an in-process checker (with the learner's code it calls) may run before the verdict says so.
#: Generous: the slowest in-process checker takes a few seconds on a busy 2-core machine. A checker sets
#: its own with a ``time_limit_s`` attribute (None: unbounded, e.g. the torchrun checkers, which bound
#: their launches themselves).
TIME_LIMIT_S = 120.0
#: What "got" says for a placeholder answer (the learner copy's ``name = ...`` stub).
NOT_ANSWERED = "not answered yet (still `...`)"
#: Verdict lines are wrapped at this width, between words: JupyterLab breaks longer lines anywhere,
#: even mid-word ("befor e").
_WIDTH = 100
_INDENT = " " * 13  # under the text after "   expected: "


class ExerciseError(AssertionError):
    """A wrong answer to an exercise (the message says what was expected and gives a hint)."""


_results: dict[str, bool] = {}   # checker name -> whether its latest call passed
_titles: dict[str, str] = {}     # checker name -> the title its passed()/failed() line used
_last_title: list[str] = []      # the title of the latest passed()/failed(), read by the wrapper
_force_raise = 0                 # > 0 inside `with raising():`


def _wrap(text: str, first: str, indent: str = _INDENT) -> str:
    """`first` + text, each line wrapped at _WIDTH between words (lines the text breaks itself are kept)."""
    lines = str(text).split("\n")
    out = [textwrap.fill(lines[0], _WIDTH, initial_indent=first, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) if lines[0] else first.rstrip()]
    out += [textwrap.fill(line, _WIDTH, initial_indent="" if line.startswith(" ") else indent,
                          subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
            for line in lines[1:]]
    return "\n".join(out)


def _shown(got: Any) -> Any:
    """What the verdict prints for an answer: a placeholder `...` reads as not answered."""
    return NOT_ANSWERED if got is ... else got


def verdict_text(title: str, expected: Any, got: Any, hint: str, wrap: bool = True) -> str:
    """The four lines of a wrong answer's verdict, wrapped between words (wrap=False: one line each)."""
    fields = [("   expected: ", expected), ("   got:      ", _shown(got)), ("   hint:     ", hint)]
    return "\n".join([f"❌ {title}: not yet."] + [_wrap(v, k) if wrap else f"{k}{v}" for k, v in fields])


def passed(title: str, detail: str = "") -> None:
    """Print the success line."""
    _last_title[:] = [title]
    print(_wrap(f"✅ {title}: correct." + (f" {detail}" if detail else ""), "", "   "))


def failed(title: str, expected: Any, got: Any, hint: str) -> None:
    """Print what went wrong and raise ExerciseError."""
    _last_title[:] = [title]
    print(verdict_text(title, expected, got, hint))
    raise ExerciseError(verdict_text(title, expected, got, hint, wrap=False))  # unwrapped: for code that reads it


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


def _function_tree(fn: Callable) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of a function's definition (None without source: a builtin, code typed into exec)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)


def _title_assignment(fn: Callable) -> tuple[list[ast.stmt], ast.expr] | None:
    """The statements before a checker's ``title = ...`` line and that line's value (None if it has none)."""
    func = _function_tree(fn)
    if func is None:
        return None
    before: list[ast.stmt] = []
    for stmt in func.body:
        if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == ["title"]:
            return before, stmt.value
        if not (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)) and not (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):  # docstring
            return None  # a branch or a call statement first: the title depends on more than plain assignments
        before.append(stmt)
    return None


def _root_name(node: ast.expr) -> str | None:
    """The name an expression such as ``a.b[0].c`` starts from ('a'), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _declared_title(fn: Callable, args: tuple, kwargs: dict) -> str | None:
    """The title a checker's verdicts use ('Exercise 1.2 (largest exact integer in bf16)'), worked out without running it.

    Every checker starts with ``title = "Exercise N.M (...)"`` (an f-string of its arguments at most, after a
    few plain assignments such as ``f = formats.spec(fmt)``). A placeholder answer is refused before the
    checker runs, so its verdict would otherwise carry only the docstring's "Exercise N.M". Those first
    assignments are evaluated with the call's arguments; one that would call an argument (the learner's
    function) or reads a placeholder is not, and None means: use the docstring's label.
    """
    found = _title_assignment(fn)
    if found is None:  # a checker that hands its title on (`_launch_and_judge("Exercise 7.3 (...)", ...)`)
        label = _label(fn)
        return next((n.value for n in ast.walk(_function_tree(fn) or ast.Module([], []))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(label + " (")),
                    None)
    before, value = found
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    params = dict(bound.arguments)
    for stmt in [*before, ast.Assign(targets=[ast.Name("title", ast.Store())], value=value)]:
        if isinstance(stmt, ast.Expr):
            continue
        reads = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
        calls = {_root_name(n.func) for n in ast.walk(stmt.value) if isinstance(n, ast.Call)}
        if calls & set(bound.arguments) or any(_placeholder(params[r]) for r in reads if r in params):
            return None  # never call the learner's code (or feed it `...`) just to name the exercise
        try:
            result = eval(compile(ast.Expression(stmt.value), "<title>", "eval"), fn.__globals__, params)  # noqa: S307
        except Exception:  # noqa: BLE001 (an argument the title cannot use: the docstring's label will do)
            return None
        params[stmt.targets[0].id] = result
    title = params.get("title")
    return title if isinstance(title, str) and title.startswith(_label(fn)) else None


@contextlib.contextmanager
def known_torch_state() -> Iterator[None]:
    """Run a block with torch's defaults (float32 default dtype, grad mode on, autocast off), then restore the caller's.

    A learner's notebook may have called ``torch.set_default_dtype(torch.float64)``,
    ``torch.set_grad_enabled(False)`` or left a ``torch.autocast`` open: a checker's reference values
    and the learner's correct answer must not change with that.

        >>> torch.set_grad_enabled(False)
        >>> with known_torch_state():
        ...     assert torch.is_grad_enabled()
        >>> torch.is_grad_enabled()
        False
    """
    import torch  # here, not at import: `from ampcourse import exercises` stays cheap

    dtype = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device in ("cpu", "cuda"):  # only where autocast is on: CUDA's needs no GPU to be switched off
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(dtype)


class _TimeLimit(BaseException):
    """Raised inside the learner's code when a checker ran past its time limit (a BaseException, so a learner's
    `except Exception:` cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise _TimeLimit in this block after `seconds` (None: no limit).

    Uses SIGALRM, so it bounds only code running in the main thread on Unix (a Jupyter kernel runs cells
    there); elsewhere the block runs unbounded. A timer already running (pytest-timeout's, a learner's)
    keeps its deadline and its handler: it is put back afterwards with the time it had left.
    """
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    now = time.monotonic()
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_deadline = now + outer_left if outer_left > 0 else math.inf
    deadline = now + seconds

    def alarm(signum, frame):
        if time.monotonic() >= deadline - 1e-3:
            raise _TimeLimit()
        if callable(previous):  # the outer timer's turn came first: its handler, then our own deadline again
            previous(signum, frame)
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-3))

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(min(deadline, outer_deadline) - now, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_deadline < math.inf:
            signal.setitimer(signal.ITIMER_REAL, max(outer_deadline - time.monotonic(), 1e-3), outer_interval)


def _placeholder(value: Any, depth: int = 0) -> bool:
    """Whether an answer is (or holds) the learner copy's `...` placeholder."""
    if value is ...:
        return True
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_placeholder(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_placeholder(v, depth + 1) for v in value.values())
    return False


def _judged(fn: Callable[..., Any], title: Callable[[], str], args: tuple, kwargs: dict) -> Any:
    """Call checker fn in a known torch state, turning a placeholder, sys.exit() and a run past the limit into verdicts."""
    if any(_placeholder(a) for a in (*args, *kwargs.values())):
        failed(title(), "your answer", NOT_ANSWERED, "replace the `...` with your answer and run the cell again")
    limit = getattr(fn, "time_limit_s", TIME_LIMIT_S)
    try:
        with known_torch_state(), time_limit(limit):
            return fn(*args, **kwargs)
    except SystemExit as stop:
        failed(title(), "your function to return", f"sys.exit({stop.code!r}) (SystemExit)",
               "return the answer instead of exiting: sys.exit() / exit() would end a script, not a function")
    except _TimeLimit:
        failed(title(), f"an answer within {limit:g} s", "your code was still running",
               "look for a loop that never ends, a sleep or an input() in your function, then run the cell again")


def checker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a check_* function: record its verdict, and in a notebook show a failure without raising.

    The wrapped checker runs in a known torch state, bounded in time, and a placeholder answer, a
    sys.exit() or a learner function that never returns gets a verdict (see the module docstring).
    """
    if getattr(fn, "_ampcourse_checker", False):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        name = fn.__name__
        _last_title.clear()

        def title() -> str:
            """The title of the latest verdict, else the checker's own (worked out from its code), else its label."""
            return _last_title[0] if _last_title else (_declared_title(fn, args, kwargs) or _label(fn))

        try:
            out = _judged(fn, title, args, kwargs)
        except ExerciseError:  # the verdict is already printed
            _results[name] = False
            _titles[name] = title()
            if _must_raise():
                raise
            return None
        except Exception as err:  # an answer the checker cannot even use (e.g. `...` left in a stub)
            _results[name] = False
            _titles[name] = title()
            if _must_raise():
                raise
            hint = ("replace the `raise NotImplementedError` stub with your code" if isinstance(err, NotImplementedError)
                    else "replace the `...` with your answer" if any(a is ... for a in (*args, *kwargs.values()))
                    else "check the type and shape of what you passed")
            print(verdict_text(_titles[name], "an answer the checker can use", f"{type(err).__name__}: {err}", hint))
            return None
        _results[name] = True
        _titles[name] = title()
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
