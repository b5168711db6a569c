"""The range explorer: slide the loss scale, watch a gradient histogram cross a format's zones (chapter 6).

    >>> r = range_explorer(grads)          # gradient histogram vs a format's zones
    >>> r.slider.value = 16                # loss scale 2**16
    >>> r.counts["underflow"]              # values that still flush to zero
"""

from __future__ import annotations

import functools
import html
import math

import ipywidgets as W
import numpy as np

from .. import formats, plots, scaling
from .common import _LABEL, _Guarded, _error_html, _when_idle, parse_scale
from .figure import _FigureImage

__all__ = ["RangeExplorer", "range_explorer"]


@functools.cache
def _course_gradients() -> np.ndarray:
    """Real gradients of the course's tiny transformer: parameters and activations, one batch."""
    from ..models import make_task

    task = make_task("transformer", n=64, seed=0)
    x, y = task.data[:64]
    rec = scaling.record_gradients(task.model, x, y, task.loss_fn, activations=True)
    return rec.values("all").double().numpy()


def _as_values(grads) -> np.ndarray:
    """Gradients given as a tensor, an array, a list of tensors, a GradientRecord or None (the course model)."""
    if grads is None:
        return _course_gradients()
    if isinstance(grads, scaling.GradientRecord):
        return grads.values("all").double().numpy()
    if isinstance(grads, (list, tuple)) and grads and all(hasattr(g, "detach") for g in grads):
        return np.concatenate([g.detach().cpu().double().numpy().ravel() for g in grads])
    if hasattr(grads, "detach"):
        return grads.detach().cpu().double().numpy().ravel()
    try:
        return np.asarray(grads, dtype=np.float64).ravel()
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float64 (10**400)
        shown = repr(grads) if len(repr(grads)) <= 60 else repr(grads)[:57] + "..."
        raise ValueError("grads must be a tensor, an array of numbers, a list of tensors or a GradientRecord, "
                         f"got {shown}") from None


class RangeExplorer(_Guarded, W.VBox):
    """Slide the loss scale; watch the gradient histogram move across a format's zones, with live counts."""

    BINS_PER_OCTAVE = 4

    def __init__(self, grads=None, fmt: str = "fp16"):
        self.values = _as_values(grads)
        self.counter = scaling.RangeCounter(self.values)
        self.fmt = formats.spec(fmt).name
        nz = self.counter.sorted
        # Histogram once on a grid aligned to whole octaves: scaling by 2**k then only shifts the edges.
        lo = math.floor(math.log2(nz[0])) if nz.size else 0
        hi = math.ceil(math.log2(nz[-1])) + 1 if nz.size else 1
        self._edges = np.arange(lo, hi + 1e-9, 1 / self.BINS_PER_OCTAVE)
        hist, _ = np.histogram(np.log2(nz) if nz.size else nz, self._edges)
        self._percent = 100 * hist / max(self.values.size, 1)

        # the registry's training formats narrower than fp32: the ones a loss scale is for
        names = list(dict.fromkeys([self.fmt, *(n for n in formats.names() if formats.spec(n).bits < 32)]))
        # wide enough for the longest name ("fp8_e4m3" was cut to "fp8_e4" at 12em)
        self.fmt_select = W.Dropdown(options=names, value=self.fmt, description="format", layout={"width": "17em"})
        # 65 powers of two: about 7 px each on this track (24em held them in 100 px, 1.5 px each)
        self.slider = W.IntSlider(value=0, min=-24, max=40, description="log2 scale", continuous_update=True,
                                  style=_LABEL, layout={"width": "46em"})
        self.text = W.Text(value="1", description="loss scale", continuous_update=False, layout={"width": "14em"})
        self.message = W.HTML()
        self.counts_html = W.HTML()
        self.counts_html.add_class("ampcourse-range-counts")
        self._figure = _FigureImage((7, 2.6), css_class="ampcourse-range-figure")
        self.fig, self.image = self._figure.fig, self._figure.image
        self.ax = self.fig.add_subplot()
        self.scale = 1.0
        self.counts: dict[str, int] = {}
        self._syncing = False
        self._built_fmt: str | None = None  # the format whose zones the axes hold now
        self._build_axes()
        self._watch(self.slider, self._on_slider)
        self._watch(self.text, self._on_text)
        self._watch(self.fmt_select, self._on_fmt)
        super().__init__([self.slider, W.HBox([self.text, self.fmt_select]), self.message, self.image,
                          self.counts_html])
        self._update()
        _when_idle(self.prerender)

    def prerender(self) -> int:
        """Draw the zones of every format in the dropdown not drawn yet (without showing them); return how many.

        A switch in the dropdown is then a cached bitmap and a move (about 40 ms), not a full redraw (110-250
        ms: issue 28, item 16). In a kernel it runs once the cell that made the widget has finished
        (``_when_idle``), so the cell does not wait for it; elsewhere (tests, scripts) call it yourself.
        """
        shown, drawn = self.fmt, 0
        for name in self.fmt_select.options:
            if not self._figure.cached(name):
                self.fmt = name
                self._build_axes()
                self._figure.render(send=False)
                drawn += 1
        self.fmt = self._figure.key = shown
        if drawn:  # the axes hold the last format drawn: the shown one's again, drawn as a full redraw would
            self._build_axes()
            self._update()
        return drawn

    def __repr__(self) -> str:
        return f"RangeExplorer(fmt={self.fmt!r}, scale={self.scale!r}, values={self.values.size})"

    def _build_axes(self) -> None:
        """Axes, zones and an empty histogram for the current format (redone only when the format changes)."""
        ax = self.ax
        ax.clear()
        ax.set_xlim(*plots.log2_window(self.fmt))
        ax.set_ylim(0, max(float(self._percent.max(initial=0)) * 1.4, 1.0))  # headroom for two rows of zone labels
        plots.shade_zones(ax, self.fmt)
        self._stairs = ax.stairs(self._percent, self._edges, fill=True, color="#1f77b4", alpha=0.85)
        ax.set_xlabel(f"log2 |gradient x scale|   (zones: {self.fmt})")
        ax.set_ylabel("% of values")
        ax.set_title(" ", fontsize=9)
        self._figure.dynamic = [self._stairs, ax.title]
        self._figure.key, self._built_fmt = self.fmt, self.fmt
        self._figure.forget(self.fmt)

    def _on_slider(self, change) -> None:
        """Slider moved: the scale is 2**value."""
        if self._syncing:
            return
        self.scale = 2.0 ** change["new"]
        self._syncing = True
        try:
            self.text.value = f"2**{change['new']}"
        finally:
            self._syncing = False
        self.message.value = ""
        self._update()

    def _on_text(self, change) -> None:
        """A scale was typed: show why it is not one, or use it (the slider follows to the nearest power of two)."""
        if self._syncing:
            return
        try:
            scale = parse_scale(change["new"])
        except ValueError as err:
            # The plot and counts still show the last good scale: say which (the typed text stays, to be fixed).
            self.message.value = _error_html(err, f" The plot and counts still show {html.escape(self._scale_text())}.")
            return
        self.message.value = ""
        self.scale = scale
        self._syncing = True
        try:
            self.slider.value = int(min(max(round(math.log2(scale)), self.slider.min), self.slider.max))
        finally:
            self._syncing = False
        self._update()

    def _scale_text(self) -> str:
        """The current scale as the learner would type it ('2**16', or '1000')."""
        return f"2**{math.log2(self.scale):g}" if math.log2(self.scale).is_integer() else f"{self.scale:g}"

    def _on_fmt(self, change) -> None:
        """Another format: its zones (drawn once per format; a format seen before is a cached bitmap)."""
        self.message.value = ""  # a refused scale's message would outlive what it was about
        if self.text.value != self._scale_text():  # ... and so would its text: the box shows the scale drawn again
            try:
                parse_scale(self.text.value)
            except ValueError:
                self._syncing = True
                try:
                    self.text.value = self._scale_text()
                finally:
                    self._syncing = False
        self.fmt = change["new"]
        self._figure.key = self.fmt
        if self._figure.cached():
            self.ax.set_xlim(*plots.log2_window(self.fmt))  # where the cached axes have it: the histogram lands right
        self._update()

    def _update(self) -> None:
        """Shift the histogram, recount, redraw."""
        if not self._figure.cached() and self._built_fmt != self.fmt:  # no bitmap of these zones: draw them
            self._build_axes()
        self.counts = self.counter.counts(self.scale, self.fmt)
        self._stairs.set_data(self._percent, self._edges + math.log2(self.scale))
        self.ax.title.set_text(f"loss scale {self.scale:.6g} = 2^{math.log2(self.scale):.4g} in {self.fmt}")
        self.counts_html.value = self._counts_html()
        self._figure.render()

    def _counts_html(self) -> str:
        """The live counts and percentages, one line per category."""
        n = self.values.size
        if n == 0:
            return "<i>no gradient values</i>"
        labels = {"overflow": _top_label(self.fmt), "subnormal": "subnormal (precision lost)",
                  "underflow": _bottom_label(self.fmt), "fine": "fine (normal)", "zero": "exactly zero already"}
        rows = "".join(f'<tr data-category="{k}"><td>{labels[k]}</td><td style="text-align:right">{self.counts[k]:,}</td>'
                       f'<td style="text-align:right">{100 * self.counts[k] / n:.2f}%</td></tr>' for k in labels)
        return f"<table>{rows}</table>"


def _top_label(fmt: str) -> str:
    """What the values past fmt's largest become, read from formats: clamped to +-max, inf or NaN.

    Args:
        fmt: a format name.

    Example:
        >>> _top_label("fp16"), _top_label("fp8_e4m3")
        ('overflow (inf)', 'saturated (clamped to ±max)')
    """
    f = formats.spec(fmt)
    if f.saturates:  # e4m3, fp6, fp4: quantize and torch>=2.13's e4m3 cast give +-max, not inf or NaN
        return "saturated (clamped to ±max)"
    return "overflow (inf)" if f.has_inf else "overflow (NaN)"  # e8m0 has no inf: quantize gives NaN


def _bottom_label(fmt: str) -> str:
    """What the values below fmt's smallest become: flushed to zero, or clamped up where fmt has no zero (e8m0).

    Args:
        fmt: a format name.

    Example:
        >>> _bottom_label("fp16"), _bottom_label("fp8_e8m0")
        ('flush to zero', 'clamped up to the smallest value (no zero)')
    """
    return "flush to zero" if plots.has_zero(fmt) else "clamped up to the smallest value (no zero)"


def range_explorer(grads=None, fmt: str = "fp16") -> RangeExplorer:
    """Histogram of gradient magnitudes against a format's range, with a loss-scale slider and live counts."""
    return RangeExplorer(grads, fmt)
