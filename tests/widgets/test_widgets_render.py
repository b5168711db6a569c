"""How the figure widgets draw: the fast PNG encoder is lossless and valid, and a move that redraws only
the changing artists over the cached axes shows exactly what a full redraw would."""

import io
import zlib

import numpy as np
import PIL.Image
import pytest

from ampcourse import widgets
from ampcourse.widgets.figure import _FigureImage
from ampcourse.widgets.png import _PngFrames, _adler32_combine, _png


def decode(png: bytes) -> np.ndarray:
    """The pixels of a PNG as a height x width x 4 array (Pillow decodes, checking every chunk's CRC)."""
    im = PIL.Image.open(io.BytesIO(png))
    im.load()
    return np.asarray(im.convert("RGBA"))


def test_png_is_lossless_on_random_and_flat_images():
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 4), (3, 5, 4), (97, 131, 4)]:
        noisy = rng.integers(0, 256, shape, dtype=np.uint8)  # every byte difference wraps modulo 256
        np.testing.assert_array_equal(decode(_png(noisy)), noisy)
    flat = np.full((200, 300, 4), 255, np.uint8)
    png = _png(flat)
    np.testing.assert_array_equal(decode(png), flat)
    assert len(png) < 2000  # the Up filter turns repeated rows into zeros that deflate to almost nothing


def test_png_of_a_figure_matches_the_canvas_and_is_small():
    w = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 5000))
    rgba = np.asarray(w.fig.canvas.buffer_rgba())
    png = bytes(w.image.value)
    np.testing.assert_array_equal(decode(png), rgba)
    assert len(png) < rgba.nbytes / 10
    w.slider.value = 12  # a move: only the bands that changed are deflated again
    assert 0 < w._figure._png.bands_deflated < rgba.shape[0] / 16
    np.testing.assert_array_equal(decode(bytes(w.image.value)), np.asarray(w.fig.canvas.buffer_rgba()))
    zlib.decompress(idat(bytes(w.image.value)))  # a strict decoder checks the Adler-32 too


@pytest.mark.parametrize("bad", [np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4, 4), np.float32),
                                 np.zeros((0, 4, 4), np.uint8), np.zeros((16,), np.uint8)])
def test_png_refuses_what_is_not_rgba_bytes(bad):
    with pytest.raises(ValueError, match="height x width x 4 uint8"):
        _png(bad)


def _frame(w) -> np.ndarray:
    return decode(bytes(w.image.value))


def _full_redraw(w) -> np.ndarray:
    """What the figure shows when everything is drawn again (no cached axes)."""
    w._figure._backgrounds.clear()  # what invalidate() does (a test below patches invalidate out)
    w._figure.render()
    return _frame(w)


RANGE_MOVES = [("slider", v) for v in (0, 5, 16, 40, -24, 3)] + [("fmt_select", "bf16"), ("slider", 7),
                                                                   ("fmt_select", "fp8_e4m3"), ("slider", 30)]
SCALER_MOVES = [("growth_interval", 500), ("backoff_factor", 0.05), ("backoff_factor", 0.5), ("steps", 3000),
                ("growth_factor", 4.0), ("init_log2", 30), ("growth_interval", 400), ("probability", 0.01),
                ("burst", "10-500"), ("seed", 3), ("init_log2", -20)]


def _drive(w, moves) -> None:
    """Make each move, then check the frame against a full redraw, pixel for pixel.

    The layout is frozen where the first draw put it: the constrained layout, re-run by a full redraw,
    can move the axes by a hundredth of a pixel, which moves a pixel-snapped marker by one pixel. A
    stale cached axes differs by whole tick labels, zones and grid lines.
    """
    w.fig.set_layout_engine("none")
    for name, value in moves:
        getattr(w, name).value = value
        shown = _frame(w)
        differ = np.flatnonzero((shown != _full_redraw(w)).any(axis=(1, 2)))
        assert differ.size == 0, f"after {name} = {value!r}, rows {differ[0]}..{differ[-1]} differ from a full redraw"


def test_range_explorer_moves_show_what_a_full_redraw_shows():
    _drive(widgets.range_explorer(np.geomspace(1e-8, 1e-2, 5000)), RANGE_MOVES)


def test_range_explorer_prerendered_formats_show_what_a_full_redraw_shows():
    """Every format drawn ahead (as a kernel does once the widget's cell is done): a switch is a cached bitmap."""
    w = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 5000))
    assert w.prerender() == len(w.fmt_select.options) - 1 and w.prerender() == 0
    moves = RANGE_MOVES[:7] + [("fmt_select", "fp16"), ("fmt_select", "fp8_e5m2")]
    draws = w._figure.full_draws
    _drive(w, moves)
    # _drive's own full redraws (one per move) forget the bitmaps; with none left, a switch draws again (3: the
    # three switches); what a learner sees without _drive is the next test
    assert w._figure.full_draws == draws + len(moves) + 3


def test_a_prerendered_format_switch_draws_nothing_new():
    w = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 5000))
    w.prerender()
    draws = w._figure.full_draws
    for name in [*w.fmt_select.options, "fp16"]:
        w.fmt_select.value = name
        w.slider.value += 1
    assert w._figure.full_draws == draws


def test_scaler_moves_show_what_a_full_redraw_shows():
    """Moves that keep the axes (only the trajectory and title drawn) and moves that change them alike."""
    _drive(widgets.scaler_simulator(steps=2000, burst="1000-1005"), SCALER_MOVES)


def test_a_stale_cached_axes_is_caught(monkeypatch):
    """The check above can fail: with the cache never invalidated, new limits show old ticks and zones."""
    monkeypatch.setattr(_FigureImage, "invalidate", lambda self: None)
    # and every state shares one bitmap (the key a widget names for its axes' state is ignored)
    monkeypatch.setattr(_FigureImage, "key", property(lambda self: None, lambda self, value: None), raising=False)
    with pytest.raises(AssertionError, match="differ from a full redraw"):
        _drive(widgets.scaler_simulator(steps=2000, burst="1000-1005"), SCALER_MOVES)


def test_a_move_changes_the_frame():
    s = widgets.scaler_simulator(steps=2000, burst="1000-1005")
    before = _frame(s)
    s.backoff_factor.value = 0.25
    assert not np.array_equal(before, _frame(s))


def idat(png: bytes) -> bytes:
    """The concatenated IDAT data of a PNG (the zlib stream)."""
    out, i = b"", 8
    while i < len(png):
        n = int.from_bytes(png[i:i + 4], "big")
        if png[i + 4:i + 8] == b"IDAT":
            out += png[i + 8:i + 8 + n]
        i += 12 + n
    return out


def test_adler32_combine_matches_zlib():
    rng = np.random.default_rng(1)
    for _ in range(100):
        a, b = rng.bytes(int(rng.integers(0, 500))), rng.bytes(int(rng.integers(0, 200_000)))
        assert _adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_png_frames_reencode_only_changed_bands_and_stay_lossless():
    rng = np.random.default_rng(2)
    frames = _PngFrames(band=16)
    img = np.full((100, 37, 4), 255, np.uint8)
    png = frames.encode(img)
    assert frames.bands_deflated == 7  # the first frame: every band (100 rows in bands of 16)
    for row in (0, 15, 16, 50, 99):  # band edges: row 15's change also changes row 16's Up filter
        img[row, rng.integers(0, 37)] = rng.integers(0, 256, 4)
        png = frames.encode(img)
        assert frames.bands_deflated == (2 if row == 15 else 1)
        np.testing.assert_array_equal(decode(png), img)
        zlib.decompress(idat(png))  # the stream, with its combined Adler-32, checks out
    frames.encode(img)
    assert frames.bands_deflated == 0  # nothing changed: every band's bytes reused
    other = rng.integers(0, 256, (30, 5, 4), dtype=np.uint8)  # a new size starts over
    np.testing.assert_array_equal(decode(frames.encode(other)), other)
    assert frames.bands_deflated == 2
