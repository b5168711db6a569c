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
