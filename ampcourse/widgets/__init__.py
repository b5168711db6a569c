"""Interactive explorers for chapters 1, 6 and 9 (ipywidgets 8 + matplotlib).

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
(``w.image``); a move redraws only what changed (see ``figure._FigureImage``). ``python -m
ampcourse.widgets --bench`` times slider moves (benchmarks/README.md).

Two rules every widget here keeps (``common._Guarded``): an observer never raises (a value the widget cannot
use, typed or set from code, shows a message in the widget and the control goes back to its last good
value), and a stored notebook says "run the cells above" where the live widget will appear.

One file per part, lowest first:
    common    _Guarded, STORED_HINT, parse_number / parse_scale / parse_steps, small formatters
    png       the PNG encoder (_png, _PngFrames): numpy and zlib only
    figure    _FigureImage: an Agg figure in an ipywidgets.Image, cached static parts, blitting
    bits      chapter 1: FormatExplorer, format_explorer
    ranges    chapter 6: RangeExplorer, range_explorer
    scaler    chapter 6: ScalerSimulator, scaler_simulator
    outlier   chapter 9: OutlierExplorer, outlier_explorer
    cli       python -m ampcourse.widgets --bench: benchmark, simulation_benchmark, main
"""

from __future__ import annotations

# Every name that chapters, tests, benchmarks and tools import from ampcourse.widgets stays importable here
# (tests/course/test_package_map.py checks): the public ones, STORED_HINT, and _main (benchmarks/widget_update.py).
from .bits import FormatExplorer, format_explorer
from .cli import _main, benchmark, main, simulation_benchmark
from .common import STORED_HINT, parse_number, parse_scale, parse_steps
from .outlier import OutlierExplorer, outlier_explorer
from .ranges import RangeExplorer, range_explorer
from .scaler import ScalerSimulator, scaler_simulator

# Kept as it was before the split (tests/widgets/test_widgets_robust.py discovers the factories from it).
__all__ = ["format_explorer", "range_explorer", "scaler_simulator", "parse_number", "parse_scale", "parse_steps",
           "RangeExplorer", "ScalerSimulator", "benchmark", "OutlierExplorer", "outlier_explorer"]
