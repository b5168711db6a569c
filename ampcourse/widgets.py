"""Interactive explorers for the chapters (ipywidgets 8 + matplotlib).

Each function returns a widget (display it, or leave it as a cell's last line). Its controls and
results are attributes, so tests drive it without a browser:

    >>> w = format_explorer(1.0001)
    >>> w.text.value = "70000"            # what a learner types
    >>> w.rows["fp16"]["value"]           # inf
    >>> r = range_explorer(grads)          # chapter 6: gradient histogram vs a format's zones
    >>> r.slider.value = 16                # loss scale 2**16
    >>> r.counts["underflow"]              # values that still flush to zero
    >>> s = scaler_simulator()             # chapter 6: GradScaler's scale over steps
    >>> s.backoff_factor.value = 0.25; s.summary["skipped"]

The figure widgets draw on an Agg figure (``w.fig``) and send PNGs to an ``ipywidgets.Image``
(``w.image``); a move redraws only what changed (see ``_FigureImage``). ``python -m
ampcourse.widgets --bench`` times slider moves (benchmarks/README.md).

Two rules every widget here keeps (``_Guarded``): an observer never raises (a value the widget cannot
use, typed or set from code, shows a message in the widget and the control goes back to its last good
value), and a stored notebook says "run the cells above" where the live widget will appear.
"""

from __future__ import annotations

import functools
import html
import math
import re
import struct
import time
import zlib

import ipywidgets as W
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import _args, _scaler, formats, plots, scaling

__all__ = ["format_explorer", "range_explorer", "scaler_simulator", "parse_number", "parse_scale", "parse_steps",
           "RangeExplorer", "ScalerSimulator", "benchmark"]

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


#: Cell padding for the widgets' HTML tables: without it JupyterLab sets the columns edge to edge.
_CELL = 'style="padding:2px 14px 2px 0;text-align:left"'
_NUM = 'style="padding:2px 14px 2px 0;text-align:right"'


def _note(fmt: str, r: dict) -> str:
    """What happened to x in this format: a saturating format clamps (its max is a value, not an overflow)."""
    if r["overflow"]:
        return "saturated (clamped to the largest value)" if formats.spec(fmt).saturates else "overflow"
    return "flushed to zero" if r["underflow"] else r["kind"]


def _table_html(x: float, rows: dict[str, dict]) -> str:
    """An HTML table: format, bits, stored value, relative error, what happened."""
    head = "".join(f"<th {_CELL}>{h}</th>" for h in ("format", "sign exponent mantissa", "stored value", "rel. error",
                                                     "note"))
    body = []
    for f, r in rows.items():
        err = "" if math.isnan(r["rel_error"]) else f"{r['rel_error']:.2e}"
        body.append(f"<tr><td {_CELL}>{f}</td><td {_CELL}>{r['html']}</td><td {_CELL}><code>{_fmt(r['value'])}</code></td>"
                    f"<td {_NUM}>{err}</td><td {_CELL}>{_note(f, r)}</td></tr>")
    return f"<b>x = {html.escape(_fmt(x))}</b><table><tr>{head}</tr>{''.join(body)}</table>"


def format_explorer(value: float = 1.0001, fmts: tuple[str, ...] | None = None) -> FormatExplorer:
    """A bit explorer: type or slide a value, see how each format stores it (default: formats.names())."""
    return FormatExplorer(value, fmts)


# -- shared by the figure widgets -------------------------------------------------------------------------

def _error_html(err: Exception, then: str = "") -> str:
    """A visible, escaped error line for the widget (learners see it instead of a traceback); then: HTML after it."""
    return f'<span style="color:#d62728">{html.escape(str(err))}{then}</span>'


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, tag, data, CRC of tag + data."""
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _check_rgba(rgba) -> np.ndarray:
    """rgba as a C-contiguous height x width x 4 uint8 array, or ValueError saying what it must be."""
    rgba = np.asarray(rgba)
    if rgba.dtype != np.uint8 or rgba.ndim != 3 or rgba.shape[2] != 4 or 0 in rgba.shape:
        raise ValueError(f"rgba must be a non-empty height x width x 4 uint8 array, got {rgba.dtype} {rgba.shape}")
    return np.ascontiguousarray(rgba)


def _png_file(width: int, height: int, zdata: bytes) -> bytes:
    """A whole PNG file around zlib-compressed, filtered RGBA rows."""
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)  # 8 bits, truecolour + alpha, no interlace
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zdata) + _png_chunk(b"IEND", b"")


def _up_filter(rows: np.ndarray, start: int, stop: int) -> np.ndarray:
    """PNG's "Up" filter on rows[start:stop] (each row: its difference from the row above), type byte first."""
    out = np.empty((stop - start, 1 + rows.shape[1]), np.uint8)
    out[:, 0] = 2  # filter type "Up"; above the first row PNG reads zeros, so that row is stored as is
    if start == 0:
        out[0, 1:] = rows[0]
        np.subtract(rows[1:stop], rows[:stop - 1], out=out[1:, 1:])  # uint8 wraps modulo 256, as PNG's filter does
    else:
        np.subtract(rows[start:stop], rows[start - 1:stop - 1], out=out[:, 1:])
    return out


def _png(rgba: np.ndarray, level: int = 1) -> bytes:
    """Encode one RGBA image (height x width x 4 uint8) as a PNG, fast and lossless (a one-frame ``_PngFrames``).

    Every row uses PNG's "Up" filter (its difference from the row above, one numpy pass), then zlib
    deflates it. A figure's rows mostly repeat the one above (white, axes, shading), so the filtered
    bytes are mostly zeros: about 2x less CPU than Pillow's encoder, which tries five filters on every
    row and needs the alpha dropped first (benchmarks/README.md, widget section). The alpha channel is
    kept (the figures are opaque): dropping it would cost a copy as long as the deflate it saves.

    Args:
        rgba: the pixels, e.g. ``np.asarray(canvas.buffer_rgba())``.
        level: zlib's compression level, 0 (stored) to 9; 1 is the fastest that still compresses.

    Example:
        >>> png = _png(np.full((2, 3, 4), 255, np.uint8))
        >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n", int.from_bytes(png[16:20], "big")
        (True, 3)
    """
    return _PngFrames(level=level).encode(rgba)


_ADLER_BASE = 65521  # the largest prime below 2**16 (RFC 1950)


def _adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """The Adler-32 of a + b from those of a and b (len2 = len(b)); zlib's adler32_combine, which Python lacks."""
    rem = len2 % _ADLER_BASE
    sum1 = ((adler1 & 0xFFFF) + (adler2 & 0xFFFF) - 1) % _ADLER_BASE
    sum2 = (rem * (adler1 & 0xFFFF) + (adler1 >> 16) + (adler2 >> 16) - rem) % _ADLER_BASE
    return sum1 | (sum2 << 16)


class _PngFrames:
    """PNG frames of one figure: a frame deflates again only the bands of rows that changed since the last.

    A slider move changes about half of a figure's rows (the title and the data; not the labels, ticks or
    the rows above and below the data). Each band of ``band`` rows is deflated on its own, ending on a
    full flush (byte-aligned, no reference to earlier bands), so a band whose filtered bytes are unchanged
    reuses its compressed bytes; the zlib stream is the bands in order, an empty final block and the
    Adler-32 of the whole, combined from the bands'. Same pixels as ``_png``; a slightly larger file.

    Example:
        >>> frames = _PngFrames()
        >>> first = frames.encode(np.full((40, 8, 4), 255, np.uint8))
        >>> frames.encode(np.full((40, 8, 4), 255, np.uint8)) == first, frames.bands_deflated
        (True, 0)
    """

    def __init__(self, band: int = 16, level: int = 1):
        self.band, self.level = band, level
        self.bands_deflated = 0  # in the last frame: how many bands were deflated again (for tests)
        self._last: np.ndarray | None = None  # the last frame's pixels, one uint32 per pixel
        self._pieces: list[tuple[bytes, int, int]] = []  # per band: deflated bytes, Adler-32, raw length

    def encode(self, rgba: np.ndarray) -> bytes:
        """The PNG of rgba (height x width x 4 uint8), re-deflating only the bands that changed."""
        rgba = _check_rgba(rgba)
        height, width = rgba.shape[:2]
        pixels = rgba.view(np.uint32).reshape(height, width)
        starts = range(0, height, self.band)
        if self._last is None or self._last.shape != pixels.shape:
            dirty = [True] * len(starts)
            self._last, self._pieces = pixels.copy(), [(b"", 1, 0)] * len(starts)
        else:
            changed = (pixels != self._last).any(axis=1)
            changed[1:] |= changed[:-1].copy()  # a row's Up filter reads the row above: it changes with it
            dirty = np.logical_or.reduceat(changed, np.asarray(starts)).tolist()
            np.copyto(self._last, pixels)
        rows = rgba.reshape(height, -1)
        for i, start in enumerate(starts):
            if dirty[i]:
                raw = _up_filter(rows, start, min(start + self.band, height))
                z = zlib.compressobj(self.level, zlib.DEFLATED, -15)  # raw deflate: the zlib wrapper is ours
                self._pieces[i] = (z.compress(raw) + z.flush(zlib.Z_FULL_FLUSH), zlib.adler32(raw), raw.size)
        self.bands_deflated = sum(dirty)
        adler = 1
        for _, band_adler, size in self._pieces:
            adler = _adler32_combine(adler, band_adler, size)
        # zlib header (deflate, 32 KiB window, no dictionary), the bands, an empty final block, Adler-32
        zdata = b"\x78\x01" + b"".join(p for p, _, _ in self._pieces) + b"\x03\x00" + struct.pack(">I", adler)
        return _png_file(width, height, zdata)


class _FigureImage:
    """An Agg figure (no pyplot, no GUI) rendered into an ipywidgets.Image as PNG.

    Sharpness: the image is shown at a fixed CSS width (figsize x css_dpi pixels; a VBox would
    otherwise stretch it to the output's width, blurring it ~1.9x) and rendered at pixel_ratio times
    that, so it stays sharp on HiDPI screens. The layout is "constrained": tick labels at the edges
    and legends outside the axes are kept inside the figure whenever the static part is redrawn.

    Speed: the static part (axes, ticks, zones) is drawn once and cached as a bitmap; an update
    restores it and draws only the artists in ``dynamic`` (blitting). Call ``invalidate()`` after
    changing anything static (limits, labels, zones). The PNG is encoded by ``_PngFrames``, which
    deflates again only the bands of rows that changed since the last frame (about half of them per
    move); the figure is drawn once and encoded once per update.

    A widget whose static part takes a few states (a format, an axis range) names the current one in
    ``key``: each key's bitmap is kept, so going back to a state seen before costs a move, not a full
    redraw (chapter 6's format dropdown, the simulator's steps). And the constrained layout, about half of
    a full redraw, runs on the first draw and after ``relayout()`` only: the axes keep their place (the
    same figure size, labels of the same height), so a new key draws only the axes' contents.
    """

    def __init__(self, figsize: tuple[float, float], css_dpi: int = 96, pixel_ratio: int = 2, css_class: str = ""):
        self.fig = Figure(figsize=figsize, dpi=css_dpi * pixel_ratio, layout="constrained")
        FigureCanvasAgg(self.fig)
        width = f"{round(figsize[0] * css_dpi)}px"
        self.image = W.Image(format="png", layout=W.Layout(width=width, max_width="100%", height="auto",
                                                          align_self="flex-start"))
        if css_class:
            self.image.add_class(css_class)
        self.dynamic: list = []
        self.key = None  # the static state the next render shows (see the class docstring)
        self.full_draws = 0  # how many renders drew the static part (for tests and the benchmark)
        self._backgrounds: dict = {}
        self._layout = self.fig.get_layout_engine()  # constrained: put back by relayout()
        self._png = _PngFrames()

    def invalidate(self) -> None:
        """The static part changed for every key: redraw it on the next render."""
        self._backgrounds.clear()

    def forget(self, key=None) -> None:
        """The static part of one key (default: the current one) changed: redraw it when that key is shown."""
        self._backgrounds.pop(self.key if key is None else key, None)

    def cached(self, key=None) -> bool:
        """Whether a key's static part (default: the current key's) is drawn and kept."""
        return (self.key if key is None else key) in self._backgrounds

    def relayout(self) -> None:
        """Run the constrained layout again on the next full draw (tick labels of another width), for every key."""
        self.fig.set_layout_engine(self._layout)
        self.invalidate()

    def render(self, send: bool = True) -> None:
        """Redraw (blitting when the static part is cached) and send the PNG to the browser (send=False: only
        draw and keep the static part, to have a key ready before a learner asks for it)."""
        canvas = self.fig.canvas
        background = self._backgrounds.get(self.key)
        if background is None:
            for artist in self.dynamic:
                artist.set_animated(True)  # left out of canvas.draw(): drawn on top below
            canvas.draw()
            self.full_draws += 1
            if self.fig.get_layout_engine() is self._layout:
                self.fig.set_layout_engine("none")  # the axes stay where the layout put them
            self._backgrounds[self.key] = canvas.copy_from_bbox(self.fig.bbox)
        else:
            canvas.restore_region(background)
        if not send:
            return
        for artist in self.dynamic:
            self.fig.draw_artist(artist)
        # at 2x pixels the PNG encoding is half of a move's time: deflate only the rows that changed
        self.image.value = self._png.encode(np.asarray(canvas.buffer_rgba()))


# -- range explorer (chapter 6) ---------------------------------------------------------------------------

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


@functools.cache
def _course_gradients() -> np.ndarray:
    """Real gradients of the course's tiny transformer: parameters and activations, one batch."""
    from .models import make_task

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
        labels = {"overflow": "overflow (inf/NaN)", "subnormal": "subnormal (precision lost)",
                  "underflow": "flush to zero", "fine": "fine (normal)", "zero": "exactly zero already"}
        rows = "".join(f'<tr data-category="{k}"><td>{labels[k]}</td><td style="text-align:right">{self.counts[k]:,}</td>'
                       f'<td style="text-align:right">{100 * self.counts[k] / n:.2f}%</td></tr>' for k in labels)
        return f"<table>{rows}</table>"


def range_explorer(grads=None, fmt: str = "fp16") -> RangeExplorer:
    """Histogram of gradient magnitudes against a format's range, with a loss-scale slider and live counts."""
    return RangeExplorer(grads, fmt)


# -- scaler simulator (chapter 6) -------------------------------------------------------------------------

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


def _scale_trajectory(overflows: np.ndarray, init_scale: float, growth_factor: float, backoff_factor: float,
                      growth_interval: int) -> np.ndarray:
    """scaling.simulate_scale's scales (same float32 values), one update per event instead of one per step.

    The scale changes only at an overflow and at every growth_interval-th clean step in a row; between those
    it stays put. So this jumps from event to event and applies ``scaling._next_scale`` (the one home of the
    update rule) at each: a 20k-step drag costs a few hundred updates instead of 20k (benchmarks/README.md).
    """
    n = len(overflows)
    out = np.empty(n, dtype=np.float64)
    scale, tracker, i = scaling._float32(init_scale), 0, 0
    rule = dict(growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval)
    for nxt in [*np.flatnonzero(overflows).tolist(), n]:  # each overflow, then the end of the run
        while i < nxt:  # clean steps up to the next overflow: the scale grows every growth_interval of them
            grow_at = i + growth_interval - tracker - 1
            if grow_at >= nxt:
                out[i:nxt], tracker, i = scale, tracker + (nxt - i), nxt
                break
            out[i:grow_at] = scale
            scale, tracker = scaling._next_scale(scale, growth_interval - 1, False, **rule)
            out[grow_at], i = scale, grow_at + 1
        if i < n:
            scale, tracker = scaling._next_scale(scale, tracker, True, **rule)
            out[i], i = scale, i + 1
    return out


def _check_simulator_args(steps: int, probability: float, seed: int) -> None:
    """ValueError naming the argument unless each fits its control (a slider would clamp it without a word)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 10 <= steps <= 20000:
        raise ValueError(f"steps must be an int from 10 to 20000 (the steps slider's range), got {steps!r}")
    ok = isinstance(probability, (int, float)) and not isinstance(probability, bool) and 1e-5 <= probability <= 1
    if not ok:
        raise ValueError(f"probability must be a number from 1e-05 to 1 (the P(overflow) slider's range), got {probability!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


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


_AXIS_ENDS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)  # x-axis ends' mantissas: a run fills 80-100% of it


def _axis_end(n_steps: int) -> int:
    """The right end of the simulator's step axis: the smallest 'round' number >= n_steps (10, 12, 15, ..., 20000).

    A drag of the steps slider then changes the axes only when it crosses one of these (13 per decade),
    and each is drawn once (``_FigureImage.key``); the rest of the drag is a move. The run fills 80-100% of it.

        >>> _axis_end(6000), _axis_end(6010), _axis_end(20000)
        (6000, 7000, 20000)
    """
    n = max(int(n_steps), 1)
    decade = 10 ** (len(str(n)) - 1)
    return next(int(m * decade) for m in (*_AXIS_ENDS, 10) if m * decade >= n)


class ScalerSimulator(_Guarded, W.VBox):
    """GradScaler's four settings and an overflow pattern in, the scale over steps (skipped steps marked) out."""

    def __init__(self, steps: int = 6000, probability: float = 5e-4, burst: str = "3000-3005", seed: int = 0):
        steps, probability, seed = _args.scalar(steps), _args.scalar(probability), _args.scalar(seed)  # numpy, 0-d tensors
        _check_simulator_args(steps, probability, seed)
        label = dict(style=_LABEL, layout=_WIDE)
        self.init_log2 = W.IntSlider(value=16, min=-24, max=40, description="log2 init_scale", **label)
        self.growth_factor = W.FloatSlider(value=2.0, min=1.05, max=8.0, step=0.05, description="growth_factor", **label)
        self.backoff_factor = W.FloatSlider(value=0.5, min=0.05, max=0.95, step=0.05, description="backoff_factor",
                                            **label)
        self.growth_interval = W.IntSlider(value=2000, min=1, max=5000, description="growth_interval", **label)
        self.steps = W.IntSlider(value=steps, min=10, max=20000, step=10, description="steps", **label)
        self.probability = W.FloatLogSlider(value=probability, base=10, min=-5, max=0, description="P(overflow)",
                                            readout_format=".1e", **label)
        self.burst = W.Text(value=burst, description="burst steps", continuous_update=False,
                            placeholder="e.g. 1000-1020, 4000", **label)
        self.seed = W.IntText(value=seed, description="seed", **label)
        self.message = W.HTML()
        self.summary_html = W.HTML()
        self.summary_html.add_class("ampcourse-scaler-summary")
        self._figure = _FigureImage((7, 2.8), css_class="ampcourse-scaler-figure")
        self.fig, self.image = self._figure.fig, self._figure.image
        self.ax = self.fig.add_subplot()
        (self._line,) = self.ax.plot([], [], drawstyle="steps-post", lw=1.3, color="#1f77b4", label="scale")
        (self._skips,) = self.ax.plot([], [], "|", color="#d62728", ms=9, label="skipped step (overflow)")
        self.ax.set(xlabel="step", ylabel="log2(scale)")
        self.ax.set_title(" ", fontsize=9)
        # right of the axes: inside, the legend would cover the trajectory wherever the scale goes
        self.ax.legend(["scale", "skipped step\n(overflow)"], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       frameon=False, borderaxespad=0.0)
        self._figure.dynamic = [self._line, self._skips, self.ax.title]
        self.overflows: list[bool] = []
        self.scales: list[float] = []
        self.summary: dict = {}
        self._burst_steps: list[int] = parse_steps(burst, steps)
        controls = [self.init_log2, self.growth_factor, self.backoff_factor, self.growth_interval, self.steps,
                    self.probability, self.seed]
        for c in controls:
            self._watch(c, self._on_change)
        self._watch(self.burst, self._on_burst)
        super().__init__([W.HBox([W.VBox(controls[:4]), W.VBox(controls[4:] + [self.burst])]), self.message,
                          self.image, self.summary_html])
        self._update()

    def __repr__(self) -> str:
        return (f"ScalerSimulator(init_scale=2**{self.init_log2.value}, growth_factor={self.growth_factor.value}, "
                f"backoff_factor={self.backoff_factor.value}, growth_interval={self.growth_interval.value}, "
                f"steps={self.steps.value})")

    def _on_change(self, change) -> None:
        """Any slider moved."""
        self._update()

    def _on_burst(self, change) -> None:
        """Scripted overflow steps typed: show why they do not parse, or use them."""
        try:
            self._burst_steps = parse_steps(change["new"], self.steps.value)
        except ValueError as err:  # the plot still shows the last good burst: say which
            shown = ", ".join(map(str, self._burst_steps[:6])) + (", ..." if len(self._burst_steps) > 6 else "")
            self.message.value = _error_html(err, f" The plot still shows the burst at steps {html.escape(shown or 'none')}.")
            return
        self.message.value = ""
        self._update()

    def pattern(self) -> list[bool]:
        """The overflow pattern: random overflows with P(overflow), plus the scripted burst."""
        return self._pattern().tolist()

    def _pattern(self) -> np.ndarray:
        """pattern() as a boolean array."""
        n = self.steps.value
        rng = np.random.default_rng(self.seed.value)
        over = rng.random(n) < self.probability.value
        burst = np.asarray([s for s in self._burst_steps if s <= n], dtype=np.int64)
        over[burst - 1] = True
        return over

    def _check_controls(self) -> None:
        """ValueError naming the control whose value (typed, or set from code) the simulation cannot use."""
        _check_simulator_args(self.steps.value, self.probability.value, self.seed.value)
        _scaler.check_args(2.0 ** self.init_log2.value, self.growth_factor.value, self.backoff_factor.value,
                           self.growth_interval.value)

    def _update(self) -> None:
        """Simulate GradScaler's scale for the pattern and redraw."""
        self._check_controls()
        skipped = self._pattern()
        self.overflows = skipped.tolist()
        scales = _scale_trajectory(skipped, 2.0 ** self.init_log2.value, self.growth_factor.value,
                                   self.backoff_factor.value, self.growth_interval.value)
        self.scales = scales.tolist()
        steps = np.arange(1, len(scales) + 1)
        with np.errstate(divide="ignore"):
            y = np.log2(scales)
        y = np.maximum(y, -160.0)  # a scale that collapsed to 0 is drawn at the bottom, not dropped
        # A step plot only needs the steps where the scale changes (usually a few hundred of thousands).
        change = np.flatnonzero(np.diff(y, prepend=np.nan, append=np.nan) != 0)
        change = change[change < len(y)]
        self._line.set_data(np.append(steps[change], len(y) + 1), np.append(y[change], y[-1:] if len(y) else []))
        self._skips.set_data(steps[skipped], y[skipped])
        self._set_limits(len(steps), float(y.min(initial=0.0)), float(y.max(initial=1.0)))
        self.summary = self._summarize(skipped)
        self.ax.title.set_text(f"{self.summary['skipped']} of {_plural(len(steps), 'step')} skipped; "
                                     f"final scale {self.summary['final_scale']:.4g}")
        self.summary_html.value = self._summary_html()
        self._figure.render()

    def _set_limits(self, n_steps: int, y_min: float, y_max: float) -> None:
        """Change the axes only when the data leaves them or fills less than half (cached axes = fast redraws).

        Each (x range, y range) keeps its bitmap (``_FigureImage.key``): a steps value or scale range seen
        before is redrawn as a move. A new y range runs the layout again (its tick labels may be wider).
        """
        lo, hi = 8 * math.floor((y_min - 1) / 8), 8 * math.ceil((y_max + 1) / 8)  # whole multiples of 8 octaves
        cur_lo, cur_hi = self.ax.get_ylim()
        if lo < cur_lo or hi > cur_hi or (hi - lo) < 0.5 * (cur_hi - cur_lo):
            self.ax.set_ylim(lo, hi)
            if max(len(f"{lo:g}"), len(f"{hi:g}")) != max(len(f"{cur_lo:g}"), len(f"{cur_hi:g}")):
                self._figure.relayout()  # tick labels of another width: the axes may need another place
        right = _axis_end(n_steps)
        if self.ax.get_xlim() != (0, right):
            self.ax.set_xlim(0, right)
        self._figure.key = (self.ax.get_xlim(), self.ax.get_ylim())

    def _summarize(self, skipped: np.ndarray) -> dict:
        """Skipped steps, final/min/max scale, and how long the scale took to recover after the first overflow."""
        scales = np.asarray(self.scales, dtype=np.float64)
        init = float(np.float32(2.0 ** self.init_log2.value))
        recovery = None
        if skipped.any():
            first = int(np.argmax(skipped))
            before = scales[first - 1] if first > 0 else init
            later = np.nonzero(scales[first:] >= before)[0]
            recovery = int(later[0]) if later.size else None
        return {"skipped": int(skipped.sum()), "final_scale": float(scales[-1]) if scales.size else init,
                "min_scale": float(scales.min(initial=init)), "max_scale": float(scales.max(initial=init)),
                "recovery_steps": recovery}

    def _summary_html(self) -> str:
        """The summary as a small table."""
        s = self.summary
        rec = "never (within the run)" if s["recovery_steps"] is None and s["skipped"] else (
            "no overflow" if s["recovery_steps"] is None else _plural(s["recovery_steps"], "step"))
        rows = [("skipped steps", f"{s['skipped']}"), ("final scale", f"{s['final_scale']:.6g}"),
                ("min / max scale", f"{s['min_scale']:.3g} / {s['max_scale']:.3g}"),
                ("back to the pre-overflow scale after the first overflow", rec)]
        return "<table>" + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows) + "</table>"


def scaler_simulator(steps: int = 6000, probability: float = 5e-4, burst: str = "3000-3005", seed: int = 0) -> ScalerSimulator:
    """GradScaler's scale trajectory for chosen settings and an overflow pattern (simulate_scale, drawn live)."""
    return ScalerSimulator(steps, probability, burst, seed)


# -- benchmark --------------------------------------------------------------------------------------------

def benchmark(repeats: int = 60) -> dict[str, dict[str, float]]:
    """Milliseconds per slider move (median, p90) while dragging each control, cached axes vs full redraws, interleaved."""
    repeats = _args.integer(repeats, "repeats", low=1)  # numpy ints and 0-d tensors too
    drag = lambda lo, hi, step: [round(lo + i * step, 10) for i in range(int(round((hi - lo) / step)) + 1)]
    cases = {"format_explorer: log10 abs(x) slider": (format_explorer(), "slider", drag(-9, 6, 0.25)),
             "range_explorer: log2 scale slider": (range_explorer(), "slider", drag(-24, 40, 1)),
             "scaler_simulator: backoff_factor": (scaler_simulator(), "backoff_factor", drag(0.05, 0.95, 0.05)),
             "scaler_simulator: growth_interval": (scaler_simulator(), "growth_interval", drag(1500, 2100, 10)),
             "scaler_simulator, 20k steps: growth_interval": (scaler_simulator(steps=20000), "growth_interval",
                                                              drag(100, 400, 5)),
             "outlier_explorer: log2 outlier slider": (outlier_explorer(), "magnitude", drag(0, 16, 1)),
             # issue 28 item 16: a format switch (prerendered, as in a kernel) and a steps drag across axis ends
             "range_explorer: format dropdown": (_prerendered(range_explorer()), "fmt_select",
                                                 ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]),
             "scaler_simulator: steps slider": (scaler_simulator(), "steps", drag(5000, 20000, 500))}
    out = {}
    for name, (w, attr, values) in cases.items():
        control, times = getattr(w, attr), {"cached": [], "full": []}
        path = values + values[-2:0:-1]  # drag right, then back left
        for i in range(repeats):
            for mode in ("cached", "full"):  # interleaved, so machine noise hits both alike
                kept = None
                if mode == "full" and hasattr(w, "_figure"):  # format_explorer is HTML only: nothing to redraw
                    # as if every move changed the axes: no bitmap for this move, the others kept for the next
                    kept, w._figure._backgrounds = w._figure._backgrounds, {}
                t = time.perf_counter()
                control.value = path[(2 * i + (mode == "full")) % len(path)]
                times[mode].append(1000 * (time.perf_counter() - t))
                if kept is not None:
                    w._figure._backgrounds = {**kept, **w._figure._backgrounds}
        med = {m: float(np.median(t)) for m, t in times.items()}
        out[name] = {"median_ms": med["cached"], "p90_ms": float(np.percentile(times["cached"], 90)),
                     "full_redraw_median_ms": med["full"], "speedup": med["full"] / med["cached"], "moves": repeats}
    return out


def _prerendered(w: RangeExplorer) -> RangeExplorer:
    """w with every format drawn ahead, as a kernel does once the widget's cell is done."""
    w.prerender()
    return w


def simulation_benchmark(repeats: int = 20, steps: int = 20000) -> dict[str, float]:
    """Milliseconds (median) of the scaler simulator's simulation alone, per step (scaling.simulate_scale) vs per
    event (_scale_trajectory), interleaved on the same 20k-step pattern and a growth_interval drag."""
    repeats = _args.integer(repeats, "repeats", low=1)
    over = scaler_simulator(steps=steps)._pattern()
    times: dict[str, list[float]] = {"per step": [], "per event": []}
    for i in range(repeats):
        interval = 100 + 5 * (i % 60)
        t = time.perf_counter()
        scaling.simulate_scale(over.tolist(), 2.0**16, 2.0, 0.5, interval)
        times["per step"].append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        _scale_trajectory(over, 2.0**16, 2.0, 0.5, interval)
        times["per event"].append(1000 * (time.perf_counter() - t))
    return {k: float(np.median(v)) for k, v in times.items()}


def _main(argv: list[str] | None = None) -> int:
    """python -m ampcourse.widgets --bench: print the widget update benchmark as a Markdown table."""
    import argparse
    import os
    import platform

    ap = argparse.ArgumentParser(prog="python -m ampcourse.widgets", description=_main.__doc__)
    ap.add_argument("--bench", action="store_true", help="time slider moves of the figure widgets")
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.bench:
        ap.print_help()
        return 0
    print(f"widget update benchmark: {args.repeats} moves per control (dragged one step at a time), "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    print("| widget: control dragged | median ms | p90 ms | full redraw median ms | speedup from cached axes |")
    print("|---|---|---|---|---|")
    for name, r in benchmark(args.repeats).items():
        print(f"| {name} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {r['full_redraw_median_ms']:.1f} | {r['speedup']:.1f}x |")
    sim = simulation_benchmark(args.repeats)
    print(f"\nscaler_simulator, 20k steps, the simulation alone (median): per step {sim['per step']:.1f} ms, "
          f"per event {sim['per event']:.2f} ms ({sim['per step'] / sim['per event']:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())


# --- chapter 9: one outlier against the scaling granularity ---------------------------------------------
# Appended as its own section (imports local to it) so edits to the widgets above merge cleanly.

#: Element formats to scale: every signed format of 8 bits or fewer in the registry (fp8, fp6, fp4).


class OutlierExplorer(_Guarded, W.VBox):
    """Move one outlier and the block size; see each scaling granularity's error (chapter 9).

        >>> w = outlier_explorer()
        >>> w.magnitude.value = 10          # the outlier becomes 2**10
        >>> w.block.value = 16              # blocks of 16 for the two block schemes
        >>> w.results["tensor"]["rel_error"], w.results["block e8m0"]["underflowed"]
        >>> w.results["tensor"]["median_rel_error"]  # the typical element: 1.0 when flushed to zero

    Schemes (keys of ``results``): "tensor", "row", "block fp32" (fp32 scale per block), "block e8m0"
    (MX: power-of-two scale per block), and "nvfp4" when the element format is fp4_e2m1.
    """

    def __init__(self, x=None, element: str = "fp4_e2m1", magnitude: int = 8, position: int = 5, block_size: int = 32,
                 seed: int = 0):
        import torch

        magnitude = _args.integer(magnitude, "magnitude", low=0, high=16, what="an int from 0 to 16 (the slider's range)")
        position, block_size = _args.integer(position, "position", low=0), _args.integer(block_size, "block_size", low=1)
        if x is None:
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(_args.seed(seed)))
        x = formats._real_array(x, "x")  # numbers as float64, or ValueError naming x
        if x.ndim == 0 or x.size == 0:
            raise ValueError(f"x must be a non-empty array of numbers (rows of values), got shape {x.shape}")
        self.base = torch.as_tensor(x, dtype=torch.float64).reshape(-1, torch.as_tensor(x).shape[-1]).clone()
        cols = self.base.shape[1]
        blocks = [b for b in (8, 16, 32, 64, 128) if cols % b == 0]
        if not blocks:
            raise ValueError(f"x needs a row length divisible by 8, got {cols}")
        if block_size not in blocks:
            raise ValueError(f"block_size must be one of {blocks} for rows of {cols}, got {block_size!r}")
        element = formats.spec(element).name
        elements = formats.mx_elements()
        if element not in elements:
            raise ValueError(f"element must be one of {', '.join(elements)}, got {element!r}")
        if not 0 <= position < cols:
            raise ValueError(f"position must be in 0..{cols - 1}, got {position!r}")
        self.element = W.Dropdown(options=elements, value=element, description="element")
        self.magnitude = W.IntSlider(value=magnitude, min=0, max=16, description="log2 outlier")
        self.position = W.IntSlider(value=position, min=0, max=cols - 1, description="position")
        self.block = W.Dropdown(options=blocks, value=block_size, description="block size")
        self.table = W.HTML()
        self.table.add_class("ampcourse-outlier-table")  # for the browser test
        self.message = W.HTML()  # _Guarded: what a refused value shows
        self.results: dict[str, dict[str, float]] = {}
        for control in (self.element, self.magnitude, self.position, self.block):
            self._watch(control, lambda change: self._update())
        super().__init__([W.HBox([self.element, self.block]), W.HBox([self.magnitude, self.position]), self.message,
                          self.table])
        self._update()

    def __repr__(self) -> str:
        return (f"OutlierExplorer(element={self.element.value!r}, outlier=2**{self.magnitude.value}, "
                f"position={self.position.value}, block={self.block.value})")

    def tensor(self):
        """The tensor being quantized: the base values with row 0's element at `position` set to the outlier."""
        x = self.base.clone()
        x[0, self.position.value] = 2.0**self.magnitude.value
        return x

    def _update(self) -> None:
        """Quantize with every scheme and refresh results and the table."""
        from . import fp8

        x, el, b = self.tensor(), self.element.value, self.block.value
        schemes = {"tensor": ("tensor", None), "row": ("row", None), "block fp32": ("1x128", b), "block e8m0": ("mx", b)}
        if el == "fp4_e2m1":
            schemes["nvfp4"] = ("nvfp4", None)
        self.results = {}
        for name, (gran, size) in schemes.items():
            r = fp8.quantize_scaled(x, el, gran, block_size=size)
            self.results[name] = {"rel_error": fp8.relative_error(x, r.values),
                                  "median_rel_error": fp8.median_relative_error(x, r.values),
                                  "sqnr_db": fp8.sqnr_db(x, r.values),
                                  "underflowed": r.underflowed, "saturated": r.saturated}
        self.table.value = self._table_html()

    def _table_html(self) -> str:
        """The results as an HTML table, 9.3's columns, with a bar per scheme: the typical element's error (1 = flushed).

        Two errors, as in 9.3: ``relative error`` (||x - q|| / ||x||) is dominated by the largest values, so it
        can fall while the outlier grows; ``typical`` (the median of |x_i - q_i| / |x_i|) is what an ordinary
        element suffers, and it is what jumps when a coarse scale flushes the rest of the tensor to zero.
        """
        rows = []
        for name, r in self.results.items():
            width = int(160 * min(r["median_rel_error"], 1.0))
            rows.append(f"<tr><td {_CELL}>{html.escape(name)}</td><td {_NUM}>{r['median_rel_error']:.4f}</td>"
                        f"<td {_NUM}>{r['rel_error']:.4f}</td><td {_NUM}>{r['sqnr_db']:.1f}</td>"
                        f"<td {_NUM}>{r['underflowed']:,}</td><td {_NUM}>{r['saturated']:,}</td>"
                        f'<td {_CELL}><div style="background:#d62728;height:10px;width:{width}px"></div></td></tr>')
        head = "".join(f"<th {_CELL}>{h}</th>" for h in ("scheme", "typical error", "relative error", "SQNR dB",
                                                         "flushed to 0", "saturated", "typical error (bar: 1 = all lost)"))
        return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def outlier_explorer(x=None, element: str = "fp4_e2m1", magnitude: int = 8, position: int = 5,
                     block_size: int = 32) -> OutlierExplorer:
    """Chapter 9: one outlier, a block size, and the error of per-tensor, per-row and block scaling."""
    return OutlierExplorer(x, element, magnitude, position, block_size)


__all__ += ["OutlierExplorer", "outlier_explorer"]
