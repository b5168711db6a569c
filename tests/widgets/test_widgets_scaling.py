"""The chapter-6 widgets, driven headlessly: set control values, check counts, figure data and messages."""

import math

import numpy as np
import pytest

from ampcourse import formats, widgets
from ampcourse.scaling import range_counts, simulate_scale
from ampcourse.widgets import parse_scale, parse_steps, range_explorer, scaler_simulator
from ampcourse.widgets.common import _when_idle
from ampcourse.widgets.scaler import _axis_end

PNG = b"\x89PNG\r\n\x1a\n"


def png(w) -> bytes:
    """The bytes of a widget's rendered figure (ipywidgets stores them as a memoryview)."""
    return bytes(w.image.value)


@pytest.fixture(scope="module")
def grads():
    rng = np.random.default_rng(0)
    return rng.standard_normal(20000) * 2.0 ** rng.uniform(-40, -2, 20000)


def test_range_explorer_slider_moves_histogram_and_counts(grads):
    w = range_explorer(grads)
    base_edges = w._stairs.get_data().edges.copy()
    first_png = png(w)
    assert first_png.startswith(PNG) and w.counts == range_counts(grads, 1.0, "fp16")
    assert w.counts["underflow"] > 0  # these gradients need scaling in fp16
    w.slider.value = 16
    assert w.scale == 2.0**16 and w.text.value == "2**16"
    assert w.counts == range_counts(grads, 2.0**16, "fp16")
    np.testing.assert_array_equal(w._stairs.get_data().edges, base_edges + 16)
    assert png(w) != first_png and png(w).startswith(PNG)
    assert f"{w.counts['underflow']:,}" in w.counts_html.value and "flush to zero" in w.counts_html.value
    pct = 100 * w.counts["fine"] / grads.size
    assert f"{pct:.2f}%" in w.counts_html.value
    assert w.ax.title.get_text().startswith("loss scale 65536 = 2^16")


def test_range_explorer_histogram_is_the_data(grads):
    w = range_explorer(grads)
    data = w._stairs.get_data()
    assert math.isclose(data.values.sum(), 100.0)  # no zeros or infs in these grads: all values binned
    heights, _ = np.histogram(np.log2(np.abs(grads)), data.edges)
    np.testing.assert_allclose(data.values, 100 * heights / grads.size)


def test_range_explorer_text_box(grads):
    w = range_explorer(grads)
    w.text.value = "2^10"
    assert w.slider.value == 10 and w.scale == 1024.0
    w.text.value = "1000"
    assert w.scale == 1000.0 and w.slider.value == 10 and w.counts == range_counts(grads, 1000.0)
    for bad, msg in [("lots", "not a loss scale"), ("-4", "positive"), ("0", "positive"), ("inf", "positive"), ("", "not a loss scale")]:
        w.text.value = bad
        assert msg in w.message.value and w.scale == 1000.0  # nothing raised, nothing changed
    w.slider.value = 3
    assert w.message.value == "" and w.scale == 8.0


def test_range_explorer_format_switch(grads):
    w = range_explorer(grads)
    w.fmt_select.value = "bf16"
    assert w.fmt == "bf16" and w.counts == range_counts(grads, 1.0, "bf16")
    assert w.counts["underflow"] == 0 and w.counts["subnormal"] == 0  # bf16 has fp32's range
    assert w.ax.get_xlim()[0] < -140
    w.fmt_select.value = "fp8_e4m3"
    w.slider.value = 40
    assert w.counts == range_counts(grads, 2.0**40, "fp8_e4m3")


@pytest.mark.parametrize("values", [np.zeros(100), np.full(50, np.inf), np.array([np.nan, 1.0]), np.array([]),
                                    np.array([1e-300, 1e300, -0.0])])
def test_range_explorer_extremes_never_raise(values):
    w = range_explorer(values)
    for k in (-24, 40, 0):
        w.slider.value = k
        assert sum(w.counts.values()) == values.size
        assert png(w).startswith(PNG)
    if values.size and np.isinf(values).all():
        assert w.counts["overflow"] == values.size and "100.00%" in w.counts_html.value


def test_range_explorer_css_classes_and_repr(grads):
    w = range_explorer(grads)
    assert "ampcourse-range-counts" in w.counts_html._dom_classes
    assert "ampcourse-range-figure" in w.image._dom_classes
    assert repr(w) == "RangeExplorer(fmt='fp16', scale=1.0, values=20000)"
    with pytest.raises(ValueError, match="unknown format"):
        range_explorer(grads, fmt="fp12")


def test_range_explorer_defaults_to_course_gradients():
    w = range_explorer()
    assert w.values.size > 100_000 and sum(w.counts.values()) == w.values.size
    assert w.counts["subnormal"] > 0  # real gradients reach into fp16's subnormals


def test_parse_scale():
    assert parse_scale("2**16") == 65536.0 and parse_scale(" 2^-3 ") == 0.125 and parse_scale("1e4") == 1e4
    for bad in ["two", "2**", "-1", "nan", "0"]:
        with pytest.raises(ValueError):
            parse_scale(bad)


# -- scaler simulator -------------------------------------------------------------------------------

def _expected(w):
    return simulate_scale(w.pattern(), 2.0 ** w.init_log2.value, w.growth_factor.value, w.backoff_factor.value,
                          w.growth_interval.value)


def test_scaler_simulator_draws_simulate_scale():
    w = scaler_simulator(steps=3000, probability=1e-3, burst="1000-1004", seed=1)
    assert w.scales == _expected(w) and len(w.scales) == 3000
    assert all(w.overflows[999:1004])
    x, y = w._line.get_data()  # a step plot drawn from the change points only
    assert len(x) < len(w.scales) / 10
    steps = np.arange(1, len(w.scales) + 1)
    np.testing.assert_array_equal(np.asarray(y)[np.searchsorted(x, steps, side="right") - 1], np.log2(w.scales))
    sx, _ = w._skips.get_data()
    np.testing.assert_array_equal(sx, np.nonzero(w.overflows)[0] + 1)
    assert w.summary["skipped"] == sum(w.overflows) and png(w).startswith(PNG)
    assert f"{w.summary['skipped']} of 3000 steps skipped" in w.ax.title.get_text()


@pytest.mark.parametrize("control, value", [("init_log2", 3), ("growth_factor", 3.5), ("backoff_factor", 0.1),
                                            ("growth_interval", 50), ("steps", 500), ("probability", 0.01), ("seed", 7)])
def test_scaler_simulator_each_control_changes_the_trajectory(control, value):
    w = scaler_simulator(steps=2000, probability=1e-3, burst="100-103")
    w.growth_interval.value = 300  # so that growth happens within the run
    before = list(w.scales)
    getattr(w, control).value = value
    assert w.scales == _expected(w) and w.scales != before


def test_scaler_simulator_recovery_and_burst_text():
    w = scaler_simulator(steps=400, probability=1e-5, burst="100", seed=0)
    w.growth_interval.value = 10
    w.init_log2.value = 10
    assert sum(w.overflows) == 1 and w.overflows[99]
    # the overflow at step 100 halves the scale, 10 clean steps double it back
    assert w.scales[99] == w.scales[98] / 2 and w.scales[109] == w.scales[98]
    assert w.summary["recovery_steps"] == 10 and "10 steps" in w.summary_html.value
    w.burst.value = "oops"
    assert "not a step or a range" in w.message.value
    w.burst.value = "20-10"
    assert "backwards" in w.message.value
    w.burst.value = "200-209, 300"
    assert w.message.value == "" and all(w.overflows[199:209]) and w.overflows[299]


def test_scaler_simulator_extremes_never_raise():
    w = scaler_simulator(steps=500)
    w.probability.value = 1.0  # every step overflows: the scale collapses to exactly 0
    assert w.scales[-1] == 0.0 and png(w).startswith(PNG)
    assert np.isfinite(w._line.get_data()[1]).all()
    w.probability.value = 1e-5
    w.burst.value = ""
    w.init_log2.value, w.growth_interval.value, w.growth_factor.value = 40, 1, 8.0
    assert w.scales[-1] == simulate_scale([False] * 500, 2.0**40, 8.0, 0.5, 1)[-1] and math.isfinite(w.scales[-1])
    w.init_log2.value = -24
    w.steps.value = 10
    assert len(w.scales) == 10
    assert repr(w).startswith("ScalerSimulator(init_scale=2**-24")


def test_parse_steps():
    assert parse_steps("5-7, 2", 10) == [2, 5, 6, 7]
    assert parse_steps("9-20", 10) == [9, 10] and parse_steps("", 10) == []
    for bad in ["a", "1-", "3-1", "1.5"]:
        with pytest.raises(ValueError):
            parse_steps(bad, 10)


def test_zone_shading_matches_formats():
    from ampcourse import plots
    zones = {name: (lo, hi) for name, lo, hi in plots.format_zones("fp16")}
    f = formats.spec("fp16")
    assert zones["subnormal"][0] == math.log2(f.min_subnormal / 2) and zones["normal"][0] < -13.99
    assert 15.99 < zones["overflow"][0] < 16


# --- issue 28, item 16: chapter 6's widgets, fast and legible ----------------------------------------------

def _em(width: str) -> float:
    assert width.endswith("em"), width
    return float(width[:-2])


def test_the_format_dropdown_and_the_scale_slider_are_wide_enough():
    r = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 500))
    assert _em(r.fmt_select.layout.width) >= 16  # "fp8_e4m3" was cut to "fp8_e4" at 12em
    values = r.slider.max - r.slider.min + 1
    track_em = _em(r.slider.layout.width) - _em(r.slider.style.description_width) - 4  # 4em: the readout
    assert track_em * 14 / (values - 1) >= 5, "a slider track with under 5 px per power of two"  # 14 px per em


def test_a_refused_scale_says_what_the_plot_still_shows_and_a_format_switch_clears_it():
    r = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 500))
    r.slider.value = 16
    r.text.value = "-1"
    assert "still show 2**16" in r.message.value and r.scale == 2.0**16
    r.fmt_select.value = "bf16"
    assert r.message.value == ""


def test_a_refused_burst_says_which_burst_the_plot_shows():
    s = widgets.scaler_simulator(steps=2000, burst="1000-1002")
    s.burst.value = "oops"
    assert "still shows the burst at steps 1000, 1001, 1002" in s.message.value and s._burst_steps == [1000, 1001, 1002]


def test_format_switches_after_prerender_and_revisited_states_are_moves_not_full_redraws():
    r = widgets.range_explorer(np.geomspace(1e-8, 1e-2, 500))
    assert not _when_idle(lambda: None)  # not in a kernel: nothing is scheduled; prerender by hand
    assert r.prerender() == len(r.fmt_select.options) - 1
    draws = r._figure.full_draws
    for name in ["bf16", "fp8_e4m3", "fp16", "fp8_e5m2", "fp16"]:
        r.fmt_select.value = name
    assert r._figure.full_draws == draws
    s = widgets.scaler_simulator(steps=6000)
    s.steps.value = 20000
    draws = s._figure.full_draws
    for steps in (19000, 18010, 17510, 20000):  # one axis end (20000): moves
        s.steps.value = steps
    s.steps.value = 6000
    s.steps.value = 20000  # both drawn before
    assert s._figure.full_draws == draws and s.ax.get_xlim() == (0, 20000)


@pytest.mark.parametrize("steps, end", [(10, 10), (11, 12), (6000, 6000), (6010, 7000), (12500, 12500),
                                         (19990, 20000), (2010, 2500), (8010, 10000)])
def test_the_step_axis_ends_on_a_round_number_the_run_fills_mostly(steps, end):
    assert _axis_end(steps) == end and 0.8 * end <= steps <= end
    assert all(0.8 * _axis_end(n) <= n for n in range(10, 20001, 10))  # every value the slider can take


def test_in_a_kernel_the_formats_are_prerendered_once_the_widgets_cell_is_done(tmp_path):
    """_when_idle: the cell that makes the widget returns first; the next cell finds every format drawn."""
    import nbformat
    from nbclient import NotebookClient

    code = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [code("import numpy as np\nfrom ampcourse.widgets import range_explorer\n"
                     "r = range_explorer(np.geomspace(1e-8, 1e-2, 500))\nprint(sorted(r._figure._backgrounds))"),
                code("print(sorted(r._figure._backgrounds))")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    first, second = ("".join(o.get("text", "") for o in c.outputs).strip() for c in nb.cells)
    assert first == "['fp16']"  # the widget's own cell did not wait for the other formats
    assert second == str(sorted(widgets.range_explorer(np.geomspace(1e-8, 1e-2, 50)).fmt_select.options))


def _chapter6_cell(start: str) -> str:
    import nbformat

    path = __import__("pathlib").Path(__file__).resolve().parents[2] / "chapters" / "06_loss_scaling.ipynb"
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and start in c.source)


def test_chapter_6s_check_cells_leave_the_learners_widgets_as_they_were():
    """Issue 28 item 16's "the check cell moves the learner's slider", in chapter 6: the cells that drive the widgets
    from code put the learner's settings back."""
    g = np.geomspace(1e-8, 1e-2, 500)
    explorer = widgets.range_explorer(g)
    explorer.slider.value, explorer.fmt_select.value = -3, "fp8_e5m2"  # where the learner left it
    exec(_chapter6_cell("range_counts(grads, 2.0**best)"), {"explorer": explorer, "best": 10, "grads": g,
                                                            "range_counts": range_counts})
    assert (explorer.slider.value, explorer.fmt_select.value) == (-3, "fp8_e5m2")
    simulator = widgets.scaler_simulator(steps=2000, burst="1000-1002")
    simulator.growth_interval.value = 77
    exec(_chapter6_cell("simulator.growth_interval.value = 500"), {"simulator": simulator, "simulate_scale": simulate_scale,
                                                                   "print": lambda *a, **k: None})
    assert simulator.growth_interval.value == 77
