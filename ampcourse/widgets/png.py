"""A fast, lossless PNG encoder for chapter 6's figure widgets: PNG's "Up" filter in numpy, zlib, changed bands only.

``_png`` encodes one RGBA image; ``_PngFrames`` encodes the frames of one figure and deflates again only the bands of
rows that changed since the last frame (benchmarks/README.md, widget section). Standard library and numpy only.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np


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
