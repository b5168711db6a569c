"""What every explorer of chapters 1, 6 and 9 shares: the guarded observers, the stored-notebook hint, parsers.

``_Guarded`` keeps the two rules of every widget in this package (an observer never raises; a stored notebook says
"run the cells above" where the live widget will appear); ``parse_number``, ``parse_scale`` and ``parse_steps`` read
what a learner types into a box; the rest are small formatters the explorers' HTML shares.
"""

from __future__ import annotations

import functools
import html
import math
import re

import ipywidgets as W

__all__ = ["parse_number", "parse_scale", "parse_steps", "STORED_HINT"]


def parse_number(text: str) -> float:
    """Parse what a learner typed ('1e-8', '65504', '-inf'); ValueError with a hint otherwise."""
    try:
        return float(str(text).strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a number; type something like 1.0001, 7e4, 1e-8 or inf") from None


def _fmt(v: float) -> str:
    """A float shown with enough digits to see the rounding."""
    return repr(v) if not math.isfinite(v) else f"{v:.10g}"


def _plural(n: int, word: str) -> str:
    """'1 step', '2 steps'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# Labels wide enough for GradScaler's argument names ("log2 init_scale", "growth_interval"): the
# default width cuts them to "log2 init_s...".
_LABEL = {"description_width": "8.5em"}
_WIDE = {"width": "24em"}
# What a stored notebook shows where a widget will be (its saved output has no widget state, so
# JupyterLab would otherwise say "Error displaying widget: model not found").
STORED_HINT = "(an interactive widget: run this cell and the cells above it to use it)"


class _Guarded:
    """Mixin for the widgets: observers that never raise, and a text/plain that tells a reader what to do.

    ``self._watch(control, handler)`` observes ``value``. If the handler raises (a seed of -1, a NaN
    factor set from code, ...), the control goes back to its previous value (which redraws the last good
    state) and the error is shown in ``self.message``; the next good change clears it.
    """

    message: W.HTML
    _reverting = False      # True while a refused value is being put back
    _reverting_owner = None  # the control being put back: only its own observer runs meanwhile
    _guard_error = False    # the message shows an error from _recover (the next good change clears it)

    def _watch(self, control: W.Widget, handler) -> None:
        """Observe control's value through handler, guarded."""
        control.observe(functools.partial(self._guarded, handler), names="value")

    def _guarded(self, handler, change) -> None:
        """Run handler; on an error, restore the control's last good value and say why."""
        if self._reverting and change.get("owner") is not self._reverting_owner:
            return
        try:
            handler(change)
        except Exception as err:  # noqa: BLE001 (a widget callback must never raise into the kernel)
            self._recover(change, err)
            return
        if self._guard_error and not self._reverting:
            self._guard_error = False
            self.message.value = ""

    def _recover(self, change, err: Exception) -> None:
        """Put the control back to its previous value (redrawing that state) and show the error."""
        owner, old = change.get("owner"), change.get("old")
        kept = ""
        if owner is not None and not self._reverting:
            self._reverting, self._reverting_owner = True, owner
            try:
                owner.value = old
                kept = f" Kept {html.escape(repr(old))}."
            except Exception:  # noqa: BLE001 (the old value may be refused too: the message is all that is left)
                pass
            finally:
                self._reverting, self._reverting_owner = False, None
        self._guard_error = True
        self.message.value = _error_html(err, kept)

    def _repr_mimebundle_(self, **kwargs):
        """The widget view plus a text/plain that says how to see it (shown where no widget state is stored)."""
        data = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data["text/plain"] = f"{data.get('text/plain', repr(self))}\n{STORED_HINT}"
        return data


def _error_html(err: Exception, then: str = "") -> str:
    """A visible, escaped error line for the widget (learners see it instead of a traceback); then: HTML after it."""
    return f'<span style="color:#d62728">{html.escape(str(err))}{then}</span>'


#: Cell padding for the widgets' HTML tables: without it JupyterLab sets the columns edge to edge.
_CELL = 'style="padding:2px 14px 2px 0;text-align:left"'
_NUM = 'style="padding:2px 14px 2px 0;text-align:right"'


_SCALE_RE = re.compile(r"^\s*2\s*(?:\*\*|\^)\s*(-?\d+(?:\.\d+)?)\s*$")


def parse_scale(text: str) -> float:
    """Parse a loss scale ('65536', '2**16', '2^-3', '1e4'); ValueError with a hint unless positive and finite."""
    m = _SCALE_RE.match(str(text))
    if m:
        try:
            value = 2.0 ** float(m.group(1))
        except OverflowError:
            value = math.inf  # 2**2000: reported below as not finite
    else:
        try:
            value = parse_number(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a loss scale; type something like 65536, 2**16 or 1e4") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the loss scale must be a positive finite number, got {text!r}")
    return value


def parse_steps(text: str, n_steps: int) -> list[int]:
    """Parse scripted overflow steps ('1000-1020, 4000'); ValueError with a hint on anything else."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", part)
        if not m:
            raise ValueError(f"{part!r} is not a step or a range; type steps like 1000-1020, 4000")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise ValueError(f"range {part!r} runs backwards; write it as {b}-{a}")
        steps.update(range(a, min(b, n_steps) + 1))
    return sorted(s for s in steps if 1 <= s <= n_steps)


def _when_idle(callback) -> bool:
    """Run callback after the current cell, when the kernel's event loop is free (False: not in a kernel, not run).

    A Jupyter kernel runs cells inside its asyncio loop; ``call_soon`` runs the callback once the cell's code has
    returned, so a widget's display is not delayed by work it can do afterwards. A failing callback is dropped.
    """
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # a script or a test: nothing runs later
        return False

    def guarded() -> None:
        try:
            callback()
        except Exception:  # noqa: BLE001 (an optional speed-up must never raise into the kernel)
            pass

    loop.call_soon(guarded)
    return True
