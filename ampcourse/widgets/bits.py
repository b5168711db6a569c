"""The bit explorer: type or slide a value, see its sign, exponent and mantissa bits in every format (chapter 1).

    >>> w = format_explorer(1.0001)
    >>> w.text.value = "70000"            # what a learner types
    >>> w.rows["fp16"]["value"]           # inf
"""

from __future__ import annotations

import html
import math
import re

import ipywidgets as W

from .. import _args, formats
from .common import _CELL, _NUM, _Guarded, _fmt, parse_number

__all__ = ["FormatExplorer", "format_explorer"]

_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def _bits_html(d: formats.Decomposed) -> str:
    """The fields of d.bits as coloured monospace bits: sign, exponent, mantissa, or fewer where a format has none.

    e8m0 has no sign bit and no mantissa (its bits are the exponent alone); every other format has all three.

    Args:
        d: a value decomposed in its format (``formats.decompose``).

    Example:
        >>> "#1f77b4" in _bits_html(formats.decompose(1.0, "fp8_e8m0"))  # exponent blue, nothing else
        True
    """
    f = formats.spec(d.fmt)
    kinds = (["sign"] if f.signed else []) + ["exponent"] + (["mantissa"] if f.mantissa_bits else [])
    fields = d.bits.split(" ")  # Decomposed.bits leaves out the fields a format does not have, in this order
    spans = "&#8239;".join(f'<span style="color:{_COLORS[k]}">{b}</span>' for b, k in zip(fields, kinds, strict=True))
    return f'<code style="font-size:110%">{spans}</code>'


class FormatExplorer(_Guarded, W.VBox):
    """Type or slide a value; see its bits, rounded value and error in every format."""

    def __init__(self, value: float = 1.0001, fmts: tuple[str, ...] | None = None):
        fmts = tuple(formats.names()) if fmts is None else fmts  # the registry's training formats
        fmts = (fmts,) if isinstance(fmts, str) else fmts  # one name alone, not its letters
        if not isinstance(fmts, (tuple, list)) or not fmts:
            raise ValueError(f"fmts must be a non-empty tuple of format names ({', '.join(formats.FORMATS)}), got {fmts!r}")
        self.fmts = tuple(formats.spec(f).name for f in fmts)
        value = parse_number(_args.scalar(value))  # a numpy scalar or 0-d tensor: the number it holds
        self.text = W.Text(value=repr(value), description="value", continuous_update=False)
        self.slider = W.FloatSlider(value=_log10_or(value, 0.0), min=-9.0, max=6.0, step=0.05,
                                    description="log10 |x|", readout_format=".2f", continuous_update=True)
        self.message = W.HTML()
        self.table = W.HTML()
        self.rows: dict[str, dict] = {}
        self.x = math.nan
        self._syncing = False
        self._watch(self.text, self._on_text)
        self._watch(self.slider, self._on_slider)
        super().__init__([W.HBox([self.text, self.slider]), self.message, self.table])
        self._update(self.text.value)

    def __repr__(self) -> str:
        return f"FormatExplorer(x={self.x!r}, formats={list(self.fmts)})"

    def _on_text(self, change) -> None:
        """A learner typed a value."""
        if not self._syncing:
            self._update(change["new"])

    def _on_slider(self, change) -> None:
        """A learner moved the slider: keep the sign of the current value."""
        if self._syncing:
            return
        if abs(change["new"] - change["old"]) < self.slider.step / 2:
            # The browser snapped the slider to its step grid (log10 70000 = 4.845 -> 4.85) and sent
            # that back: not a learner's move, so the value typed in the text box stands.
            return
        if not math.isfinite(change["new"]):  # only code can set this (a learner's slider stays in its range)
            raise ValueError(f"log10 |x| must be a finite number, got {change['new']!r}; "
                             "type nan or inf in the value box.")
        sign = -1.0 if math.copysign(1.0, self.x if not math.isnan(self.x) else 1.0) < 0 else 1.0
        self._syncing = True
        try:
            self.text.value = f"{sign * 10 ** change['new']:.6g}"
        finally:
            self._syncing = False
        self._update(self.text.value)

    def _update(self, text: str) -> None:
        """Recompute every row for the value in the text box (or show why it is not a number)."""
        try:
            x = parse_number(text)
        except ValueError as err:
            self.message.value = f'<span style="color:#d62728">{html.escape(str(err))}</span>'
            return
        self._guard_error = False  # this message is the update's own: _Guarded must not clear it afterwards
        self.message.value = _read_as(text, x)
        self.x = x
        self._syncing = True
        try:
            self.slider.value = min(max(_log10_or(x, self.slider.value), self.slider.min), self.slider.max)
        finally:
            self._syncing = False
        self.rows = {f: _row(x, f) for f in self.fmts}
        self.table.value = _table_html(x, self.rows)


def _log10_or(x: float, default: float) -> float:
    """log10|x| for finite non-zero x, else default."""
    return math.log10(abs(x)) if math.isfinite(x) and x != 0 else default


def _read_as(text: str, x: float) -> str:
    """A grey note when float64 itself changed the typed number (1e999 is inf, 1e-999 is 0), else "".

    Why: the table then shows what float64 made of the text, and without the note 1e999 would look like a typed inf.

    Args:
        text: what the learner typed.
        x: parse_number(text).

    Example:
        >>> "read as inf" in _read_as("1e999", math.inf), _read_as("inf", math.inf)
        (True, '')
    """
    digits = re.split(r"[eE]", str(text))[0]  # the significand: a non-zero digit there means a non-zero number
    if math.isinf(x) and "inf" not in str(text).lower():
        what = "beyond float64's largest value: read as inf"
    elif x == 0 and re.search(r"[1-9]", digits):
        what = "below float64's smallest value: read as 0"
    else:
        return ""
    return f'<span style="color:#666">{html.escape(str(text).strip())} is {what}</span>'


def _row(x: float, fmt: str) -> dict:
    """What one format does to x (a NaN in a format with no NaN encoding, fp6/fp4: a row that says so, blank bits).

    Args:
        x: the value typed (float64).
        fmt: a format name.

    Example:
        >>> _row(math.nan, "fp4_e2m1")["stored"], _row(70000.0, "fp16")["value"]
        (False, inf)
    """
    f = formats.spec(fmt)
    if math.isnan(x) and not f.has_nan:  # every bit pattern is a number: the NaN has nowhere to go
        return {"bits": "", "value": math.nan, "kind": "unencodable", "rel_error": math.nan, "overflow": False,
                "saturated": False, "underflow": False, "clamped_up": False, "stored": False, "html": ""}
    d = formats.decompose(x, fmt)
    # decompose's overflow is about finite x only; an infinity clamped to max by a saturating format (e4m3,
    # fp6, fp4 have no inf) is a saturation too, and the note must not call its max "normal"
    saturated = formats.spec(fmt).saturates and math.isfinite(d.value) and (d.overflow or math.isinf(d.x))
    # a format with no zero (e8m0) lifts what would flush to zero up to its smallest value: not a "normal" rounding
    clamped_up = math.isfinite(x) and 0 < abs(x) < f.min_subnormal / 2 and d.value != 0
    return {"bits": d.bits, "value": d.value, "kind": d.kind, "rel_error": d.rel_error,
            "overflow": d.overflow, "saturated": saturated, "underflow": d.underflow, "clamped_up": clamped_up,
            "stored": True, "html": _bits_html(d)}


def _note(fmt: str, r: dict) -> str:
    """What happened to x in this format: a saturating format clamps (its max is a value, not an overflow)."""
    if not r["stored"]:
        return "no NaN encoding (cannot be stored)"
    if r["saturated"]:
        return "saturated (clamped to the largest value)"
    if r["overflow"]:
        return "overflow"
    if r["clamped_up"]:
        return "clamped up to the smallest value (there is no zero)"
    return "flushed to zero" if r["underflow"] else r["kind"]


def _table_html(x: float, rows: dict[str, dict]) -> str:
    """An HTML table: format, bits, stored value, relative error, what happened."""
    head = "".join(f"<th {_CELL}>{h}</th>" for h in ("format", "sign exponent mantissa", "stored value", "rel. error",
                                                     "note"))
    body = []
    for f, r in rows.items():
        err = "" if math.isnan(r["rel_error"]) else f"{r['rel_error']:.2e}"
        stored = _fmt(r["value"]) if r["stored"] else ""  # a NaN fp6/fp4 cannot hold: no stored value to show
        body.append(f"<tr><td {_CELL}>{f}</td><td {_CELL}>{r['html']}</td><td {_CELL}><code>{stored}</code></td>"
                    f"<td {_NUM}>{err}</td><td {_CELL}>{_note(f, r)}</td></tr>")
    return f"<b>x = {html.escape(_fmt(x))}</b><table><tr>{head}</tr>{''.join(body)}</table>"


def format_explorer(value: float = 1.0001, fmts: tuple[str, ...] | None = None) -> FormatExplorer:
    """A bit explorer: type or slide a value, see how each format stores it (default: formats.names())."""
    return FormatExplorer(value, fmts)
