"""The figure plumbing of chapter 6's widgets: an Agg figure (no pyplot) shown in an ipywidgets.Image, redrawn fast.

``_FigureImage`` caches each static state's bitmap and redraws only the moving artists (blitting); its PNGs come from
``png._PngFrames``.
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .png import _PngFrames


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
