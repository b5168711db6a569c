"""Every widget, whatever a learner types or code sets: observers never raise, the last good state stays,
figures are laid out to be read (full labels, sharp pixels, nothing overprinted or clipped).

The observer test discovers the widgets from `ampcourse.widgets.__all__` (every factory that builds a
widget with no arguments), so a new widget is held to the same rule as soon as it is exported.
"""

import math

import ipywidgets as W
import numpy as np
import pytest
from traitlets import TraitError
from matplotlib.backends.backend_agg import FigureCanvasAgg

from ampcourse import plots, widgets
from ampcourse.widgets.common import _LABEL, _Guarded, _plural

BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1, 0, 10**30, -(10**30), 2**63, 1e-300]
BAD_TEXT = ["", "nan", "-1", "1e999", "abc", "2**9999", "0", "1-", "-5--3", " " * 3]
OUTPUTS = (W.HTML, W.Image, W.Label, W.Output)


def factories() -> list[str]:
    """The public functions of ampcourse.widgets that build a widget with no arguments."""
    names = []
    for name in widgets.__all__:
        obj = getattr(widgets, name)
        if callable(obj) and not isinstance(obj, type) and name[0].islower() and not name.startswith(("parse_", "benchmark")):
            names.append(name)
    return names


def controls(widget: W.Widget) -> list[W.ValueWidget]:
    """Every input control inside a widget (sliders, boxes, dropdowns), depth first."""
    found = []
    for child in getattr(widget, "children", ()):
        if isinstance(child, W.ValueWidget) and not isinstance(child, OUTPUTS):
            found.append(child)
        found += controls(child)
    return found


def state(widget: W.Widget) -> tuple:
    """What a learner sees: every control's value, the messages aside, and every output."""
    values = tuple(repr(c.value) for c in controls(widget))
    shown = tuple(bytes(c.value) if isinstance(c, W.Image) else c.value
                  for c in _outputs(widget) if not (isinstance(c, W.HTML) and c is getattr(widget, "message", None)))
    return values, shown


def _outputs(widget: W.Widget) -> list[W.Widget]:
    """Output widgets (HTML, images) inside a widget."""
    found = []
    for child in getattr(widget, "children", ()):
        if isinstance(child, OUTPUTS):
            found.append(child)
        found += _outputs(child)
    return found


@pytest.fixture(scope="module")
def small_grads():
    rng = np.random.default_rng(1)
    return rng.standard_normal(2000) * 2.0 ** rng.uniform(-30, -2, 2000)


def build(name: str, small_grads):
    """A widget from its factory (range_explorer on small data, so the test stays quick)."""
    return widgets.range_explorer(small_grads) if name == "range_explorer" else getattr(widgets, name)()


def test_the_widgets_are_discovered():
    assert {"format_explorer", "range_explorer", "scaler_simulator"} <= set(factories())


@pytest.mark.parametrize("name", factories())
def test_no_value_makes_an_observer_raise_and_the_last_good_state_stays(name, small_grads):
    w = build(name, small_grads)
    assert isinstance(w, _Guarded), f"{name}: derive the widget from widgets.common._Guarded and observe with _watch"
    for control in controls(w):
        if isinstance(control, (W.Dropdown, W.Checkbox, W.ToggleButton)):
            continue  # the trait itself refuses anything outside the options
        good = control.value
        bad = BAD_TEXT if isinstance(control.value, str) else BAD_NUMBERS
        for value in bad:
            before = control.value
            try:
                control.value = value  # an observer that raised would propagate here
            except TraitError:
                continue  # the control's own type refused it before any observer ran
            if "Kept" in w.message.value:  # refused by the widget: the control shows the last good value again
                assert control.value == before, (name, control.description, value)
        control.value = good
        assert w.message.value == "", (name, control.description, w.message.value)
    w.message.value = "stale"  # a good move by the learner ...
    controls(w)[0].value = good_value_nearby(controls(w)[0])
    assert state(w)[1] and isinstance(state(w), tuple)


def good_value_nearby(control: W.ValueWidget):
    """Another valid value for a control (to show the widget still responds)."""
    options = list(getattr(control, "options", ()))
    if options:  # a dropdown: another of its options
        return next((o[1] if isinstance(o, tuple) else o for o in options
                     if (o[1] if isinstance(o, tuple) else o) != control.value), control.value)
    if isinstance(control.value, str):
        return control.value + "0" if control.value[-1:].isdigit() else control.value
    return control.max if hasattr(control, "max") else control.value


def test_scaler_seed_of_minus_one_is_refused_in_the_widget_and_later_moves_work():
    s = widgets.scaler_simulator(steps=500)
    before = state(s)
    s.seed.value = -1
    assert s.seed.value == 0 and "seed must be an int &gt;= 0" in s.message.value and "Kept 0" in s.message.value
    assert state(s) == before, "the figure or summary changed for a value that was refused"
    s.growth_interval.value = 50  # the next move works and clears the message
    assert s.message.value == "" and state(s) != before


def test_scaler_nan_factor_set_from_code_is_refused_in_the_widget():
    s = widgets.scaler_simulator(steps=500)
    before = state(s)
    s.growth_factor.value = math.nan
    assert s.growth_factor.value == 2.0 and "growth_factor" in s.message.value
    assert state(s) == before


def test_a_huge_integer_gradient_is_a_value_error_naming_grads():
    with pytest.raises(ValueError, match="grads must be"):
        widgets.range_explorer([10**400])


@pytest.mark.parametrize("name", factories())
def test_a_stored_widget_output_says_run_the_cells_above(name, small_grads):
    bundle = build(name, small_grads)._repr_mimebundle_()
    assert widgets.STORED_HINT in bundle["text/plain"] and "application/vnd.jupyter.widget-view+json" in bundle


# --- readable figures and labels ------------------------------------------------------------------

def test_scaler_labels_are_wide_enough_for_gradscalers_argument_names():
    s = widgets.scaler_simulator()
    for c in (s.init_log2, s.growth_factor, s.backoff_factor, s.growth_interval):
        assert c.style.description_width == _LABEL["description_width"]
        name = c.description.removeprefix("log2 ")
        assert name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
        # 8.5em holds 15 characters of the widgets' proportional font with room to spare
        assert len(c.description) <= 15


@pytest.mark.parametrize("make", [lambda g: widgets.range_explorer(g), lambda g: widgets.scaler_simulator()])
def test_figure_is_shown_at_its_own_width_with_twice_the_pixels(make, small_grads):
    w = make(small_grads)
    css = int(w.image.layout.width.removesuffix("px"))
    png = bytes(w.image.value)
    width = int.from_bytes(png[16:20], "big")  # the PNG header's IHDR width
    assert width == 2 * css and w.image.layout.max_width == "100%"


def _extents(fig):
    """Draw the figure; return its renderer."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _overlap(a, b) -> bool:
    """Whether two display boxes intersect."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_zone_labels_never_overprint_and_stay_in_the_axes(fmt, small_grads):
    w = widgets.range_explorer(small_grads, fmt=fmt)
    renderer = _extents(w.fig)
    ax_box = w.ax.get_window_extent(renderer)
    labels = [t for t in w.ax.texts if t.get_text() in plots.ZONE_COLORS]
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert len(labels) >= 3
    for i, a in enumerate(boxes):
        assert ax_box.x0 <= a.x0 and a.x1 <= ax_box.x1, f"{labels[i].get_text()} leaves the axes"
        for b in boxes[i + 1:]:
            assert not _overlap(a, b), f"zone labels overprint in {fmt}"


@pytest.mark.parametrize("make", [lambda g: widgets.range_explorer(g), lambda g: widgets.scaler_simulator()])
def test_tick_labels_are_inside_the_figure_and_the_legend_off_the_data(make, small_grads):
    w = make(small_grads)
    renderer = _extents(w.fig)
    fig_box = w.fig.bbox
    shown = [t.label1 for axis, (lo, hi) in ((w.ax.xaxis, w.ax.get_xlim()), (w.ax.yaxis, w.ax.get_ylim()))
             for t in axis.get_major_ticks() if min(lo, hi) <= t.get_loc() <= max(lo, hi)]  # the ticks drawn
    assert shown
    for label in shown:
        if label.get_visible() and label.get_text():
            box = label.get_window_extent(renderer)
            assert fig_box.x0 <= box.x0 and box.x1 <= fig_box.x1 + 0.5, f"tick {label.get_text()!r} is clipped"
    legend = w.ax.get_legend()
    if legend is not None:
        assert not _overlap(legend.get_window_extent(renderer), w.ax.get_window_extent(renderer))


def test_one_step_is_singular():
    assert _plural(1, "step") == "1 step" and _plural(2, "step") == "2 steps"
    s = widgets.scaler_simulator(steps=100, probability=1e-5, burst="50")
    s.growth_interval.value = 1  # one clean step after the overflow restores the scale
    assert s.summary["recovery_steps"] == 1 and "1 step<" in s.summary_html.value
