"""Interactive explorers for the chapters (ipywidgets 8 + matplotlib).

Each function returns a widget (display it, or leave it as a cell's last line). Its controls and
results are attributes, so tests drive it without a browser:

    >>> w = format_explorer(1.0001)
    >>> w.text.value = "70000"            # what a learner types
    >>> w.rows["fp16"]["value"]           # inf
"""

from __future__ import annotations

import html
import math

import ipywidgets as W

from . import formats

__all__ = ["format_explorer", "parse_number"]

_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def parse_number(text: str) -> float:
    """Parse what a learner typed ('1e-8', '65504', '-inf'); ValueError with a hint otherwise."""
    try:
        return float(str(text).strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a number; type something like 1.0001, 7e4, 1e-8 or inf") from None


def _bits_html(d: formats.Decomposed) -> str:
    """The sign, exponent and mantissa fields as coloured monospace bits."""
    sign, exp, man = d.bits.split(" ")
    parts = [(sign, "sign"), (exp, "exponent"), (man, "mantissa")]
    spans = "&#8239;".join(f'<span style="color:{_COLORS[k]}">{b}</span>' for b, k in parts)
    return f'<code style="font-size:110%">{spans}</code>'


def _fmt(v: float) -> str:
    """A float shown with enough digits to see the rounding."""
    return repr(v) if not math.isfinite(v) else f"{v:.10g}"


class FormatExplorer(W.VBox):
    """Type or slide a value; see its bits, rounded value and error in every format."""

    def __init__(self, value: float = 1.0001, fmts: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")):
        self.fmts = tuple(formats.spec(f).name for f in fmts)
        self.text = W.Text(value=repr(float(value)), description="value", continuous_update=False)
        self.slider = W.FloatSlider(value=_log10_or(value, 0.0), min=-9.0, max=6.0, step=0.05,
                                    description="log10 |x|", readout_format=".2f", continuous_update=True)
        self.message = W.HTML()
        self.table = W.HTML()
        self.rows: dict[str, dict] = {}
        self.x = math.nan
        self._syncing = False
        self.text.observe(self._on_text, names="value")
        self.slider.observe(self._on_slider, names="value")
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
        self.message.value = ""
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


def _row(x: float, fmt: str) -> dict:
    """What one format does to x."""
    d = formats.decompose(x, fmt)
    return {"bits": d.bits, "value": d.value, "kind": d.kind, "rel_error": d.rel_error,
            "overflow": d.overflow, "underflow": d.underflow, "html": _bits_html(d)}


def _table_html(x: float, rows: dict[str, dict]) -> str:
    """An HTML table: format, bits, stored value, relative error, what happened."""
    head = "<tr><th>format</th><th>sign exponent mantissa</th><th>stored value</th><th>rel. error</th><th>note</th></tr>"
    body = []
    for f, r in rows.items():
        note = "overflow" if r["overflow"] else "flushed to zero" if r["underflow"] else r["kind"]
        err = "" if math.isnan(r["rel_error"]) else f"{r['rel_error']:.2e}"
        body.append(f"<tr><td>{f}</td><td>{r['html']}</td><td><code>{_fmt(r['value'])}</code></td>"
                    f"<td>{err}</td><td>{note}</td></tr>")
    return f"<b>x = {html.escape(_fmt(x))}</b><table>{head}{''.join(body)}</table>"


def format_explorer(value: float = 1.0001, fmts: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")) -> FormatExplorer:
    """A bit explorer: type or slide a value, see how each format stores it."""
    return FormatExplorer(value, fmts)
