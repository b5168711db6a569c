"""Static figures: lines that coincide stay visible, legends never cover data."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from ampcourse import models, plots  # noqa: E402
from ampcourse.train import train  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    data = models.make_dataset("mlp", n=256, seed=0, size="tiny")
    cfg = dict(steps=8, lr=3e-3, seed=0, device="cpu", batch_size=32, size="tiny", progress=False)
    return {"fp32": train("mlp", data, "fp32", **cfg), "bf16": train("mlp", data, "bf16", **cfg),
            "fp16": train("mlp", data, "fp16", **cfg, scaler_kwargs={"init_scale": 2.0**30, "growth_interval": 10})}


def test_training_monitor_draws_every_run_in_its_own_style(runs):
    fig = plots.training_monitor(runs)
    loss_ax = fig.axes[0]
    lines = loss_ax.get_lines()
    assert [ln.get_label() for ln in lines] == list(runs)
    # identical data would hide one line under another unless width, dash or marker differ
    styles = {(ln.get_linewidth(), ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(styles) == len(lines)
    assert lines[0].get_linewidth() > max(ln.get_linewidth() for ln in lines[1:])  # the one underneath is widest
    assert list(lines[0].get_ydata()) == runs["fp32"].loss
    with pytest.raises(ValueError, match="scaled must name one of the runs"):
        plots.training_monitor(runs, scaled="fp8")


@pytest.mark.parametrize("make", [plots.ulp_staircase, plots.relative_error,
                                  lambda: plots.scale_trajectories({"a": ([1.0, 2.0], [False, True])})])
def test_legends_sit_beside_the_axes(make):
    fig = make()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend, box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    assert legend.x0 >= box.x1 and legend.x1 <= fig.bbox.x1 + 0.5  # right of the axes, inside the figure


def test_training_monitor_draws_a_run_alike_in_every_panel(runs):
    fig = plots.training_monitor(runs)
    loss_ax, norm_ax = fig.axes[0], fig.axes[2]
    look = lambda ln: (ln.get_color(), ln.get_linewidth(), ln.get_linestyle(), ln.get_marker())  # noqa: E731
    assert {ln.get_label(): look(ln) for ln in norm_ax.get_lines()} == {ln.get_label(): look(ln) for ln in loss_ax.get_lines()}
    skipped = [k for k, s in enumerate(runs["fp16"].skipped) if s]
    fp16_norm = next(ln for ln in norm_ax.get_lines() if ln.get_label() == "fp16")
    assert skipped and not set(skipped) & set(fp16_norm.get_xdata())  # skipped steps left out, not drawn as gaps


# -- audit of the widgets and plots: bit layouts, zones and zero scales drawn as the formats have them -------------

def test_bit_layouts_draw_only_the_fields_a_format_has():
    import numpy as np

    from ampcourse import formats

    names = formats.names(narrow=True)
    fig = plots.bit_layouts(names)
    ax = fig.axes[0]
    for row, name in enumerate(names):
        f, y = formats.spec(name), len(names) - 1 - row
        bars = [p for p in ax.patches if np.isclose(p.get_y() + p.get_height() / 2, y)]
        assert sum(p.get_width() for p in bars) == f.bits, name  # e8m0: 8 bits, not a sign bit plus 8
        assert len(bars) == int(f.signed) + 1 + int(f.mantissa_bits > 0), name
        labels = [t.get_text() for t in ax.texts if np.isclose(t.get_position()[1], y) and t.get_text() != name]
        assert "0" not in labels, name  # no label for a field of no bits


def test_format_zones_name_saturation_and_the_missing_zero_as_formats_has_them():
    from ampcourse import formats

    for name in formats.names(narrow=True):
        f = formats.spec(name)
        zones = [z[0] for z in plots.format_zones(name)]
        assert zones[-1] == ("saturated" if f.saturates else "overflow"), name
        no_zero = bool(formats.quantize([0.0], name)[0] != 0.0)  # e8m0: 0 is NaN
        assert zones[0] == ("clamped up" if no_zero else "underflow"), name
        assert set(zones) <= set(plots.ZONE_COLORS)
    assert [z[0] for z in plots.format_zones("fp16")] == ["underflow", "subnormal", "normal", "overflow"]


def test_gradient_histogram_title_says_saturate_for_e4m3():
    import numpy as np

    fig = plots.gradient_histogram(np.full(10, 1e4), "fp8_e4m3", log2_scales=(0,))
    title = fig.axes[0].get_title()
    assert "100.0% saturated" in title and "overflow" not in title


def test_skipped_steps_at_a_zero_scale_stay_on_the_log_plots():
    from types import SimpleNamespace

    import numpy as np

    fig = plots.scale_trajectories({"a": ([65536.0, 0.0, 0.0], [False, True, True])})
    dots = fig.axes[0].get_lines()[1]
    assert list(dots.get_xdata()) == [2, 3] and np.isfinite(dots.get_ydata()).all()  # log2(0) = -inf was dropped
    run = SimpleNamespace(loss=[1.0, 1.0, 1.0], scale=[65536.0, 0.0, 0.0], skipped=[False, True, True],
                          grad_norm=[1.0, float("inf"), float("inf")])
    fig = plots.training_monitor({"fp16": run})
    marks = fig.axes[1].collections[0].get_offsets()
    assert len(marks) == 2 and (np.asarray(marks)[:, 1] > 0).all()  # a log axis hides y <= 0
    assert (np.asarray(fig.axes[1].get_lines()[0].get_ydata()) > 0).all()
