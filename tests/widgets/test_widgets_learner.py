"""What a learner reads in the widgets (issue 20's learner path): chapter 9's outlier table carries 9.3's
typical-value error, the format explorer tells saturation from overflow and keeps its columns apart, the
explorers' format lists come from the `formats` registry, and the scaler simulator's fast path computes
exactly GradScaler's scales."""

import re

import numpy as np
import pytest
import torch

from ampcourse import formats, fp8, plots, scaling, widgets
from ampcourse.exercises import ch09
from ampcourse.widgets.scaler import _scale_trajectory


def test_outlier_table_shows_the_typical_value_error_that_jumps_as_the_outlier_grows():
    w = widgets.outlier_explorer(x=torch.randn(4, 256, generator=torch.Generator().manual_seed(0)), magnitude=2)
    x = w.tensor()
    r = fp8.quantize_scaled(x, "fp4_e2m1", "tensor")
    assert w.results["tensor"]["median_rel_error"] == fp8.median_relative_error(x, r.values)
    calm = w.results["tensor"]["median_rel_error"]
    w.magnitude.value = 16
    big = w.results["tensor"]
    # the prose's claim: per-tensor error jumps. The overall error falls (the outlier dominates it) ...
    assert big["rel_error"] < 0.01
    # ... while the typical element is flushed to zero: that is the column that jumps
    assert calm < 0.5 and big["median_rel_error"] == 1.0
    assert "typical error" in w.table.value and f"{big['median_rel_error']:.4f}" in w.table.value
    assert w.results["block e8m0"]["median_rel_error"] < 0.5  # small blocks keep the typical element


def test_format_explorer_says_saturated_for_e4m3_and_overflow_for_fp16():
    w = widgets.format_explorer(70000)
    cells = dict(re.findall(r"<tr><td[^>]*>(\w+)</td>.*?<td[^>]*>([^<]*)</td></tr>", w.table.value))
    assert w.rows["fp8_e4m3"]["value"] == 448.0
    assert cells["fp8_e4m3"].startswith("saturated") and "overflow" not in cells["fp8_e4m3"]
    assert cells["fp16"] == "overflow" and cells["fp8_e5m2"] == "overflow"



def _notes(w) -> dict[str, str]:
    """The explorer table's note column, by format."""
    return dict(re.findall(r"<tr><td[^>]*>(\w+)</td>.*?<td[^>]*>([^<]*)</td></tr>", w.table.value))


@pytest.mark.parametrize("typed", ["inf", "-inf", "70000", "1e30"])
def test_format_explorer_says_saturated_for_an_infinity_clamped_to_max(typed):
    """inf on e4m3 (no inf encoding) becomes 448 like 70000 does: a saturation, not a 'normal' value."""
    w = widgets.format_explorer(1.0, fmts=formats.names(narrow=True))
    w.text.value = typed
    notes = _notes(w)
    for name in ("fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"):  # the saturating formats
        assert abs(w.rows[name]["value"]) == formats.spec(name).max
        assert notes[name].startswith("saturated"), (typed, name, notes[name])
    assert notes["fp16"] == ("inf" if "inf" in typed else "overflow")  # an inf given is no overflow
    assert not w.rows["fp8_e4m3"]["overflow"] or typed not in ("inf", "-inf")  # decompose's field keeps its meaning


@pytest.mark.parametrize("fmts", [("fp8_e8m0",), tuple(formats.names(narrow=True)), ("fp4_e2m1", "fp8_e8m0")])
def test_format_explorer_shows_formats_without_a_sign_or_a_mantissa(fmts):
    """e8m0 has no sign bit and no mantissa: its bits are one exponent field, coloured as the exponent."""
    w = widgets.format_explorer(1.5, fmts)
    assert set(w.rows) == set(fmts)
    if "fp8_e8m0" in fmts:
        e8 = w.rows["fp8_e8m0"]
        assert e8["bits"] == "10000000" and e8["value"] == 2.0  # 1.5 is a tie: it rounds up to 2**1
        assert e8["html"].count("<span") == 1 and "#1f77b4" in e8["html"]
    for name in fmts:
        f = formats.spec(name)
        assert w.rows[name]["html"].count("<span") == int(f.signed) + 1 + int(f.mantissa_bits > 0)
    w.text.value = "-3"  # e8m0 has no sign: NaN, still a row and no error
    assert w.message.value == "" and set(w.rows) == set(fmts)

def test_format_explorer_columns_are_padded():
    table = widgets.format_explorer(1.0).table.value
    cells = re.findall(r"<t[dh]( [^>]*)?>", table)
    assert cells and all("padding" in (attrs or "") for attrs in cells)


def test_a_new_format_in_the_registry_reaches_the_explorers(monkeypatch):
    new = formats.FormatSpec("fp8_e3m4", 3, 4, has_inf=False, saturates=True)
    monkeypatch.setitem(formats.FORMATS, "fp8_e3m4", new)
    monkeypatch.setattr(formats, "_CLASSIC", (*formats._CLASSIC, "fp8_e3m4"))
    assert "fp8_e3m4" in widgets.format_explorer(1.0).rows
    assert "fp8_e3m4" in widgets.range_explorer(np.array([1e-3, 1.0])).fmt_select.options
    fig = plots.bit_layouts()
    assert "fp8_e3m4" in [t.get_text() for t in fig.axes[0].texts]


def test_a_new_narrow_format_is_an_element_of_the_outlier_explorer_and_exercise_9_1(monkeypatch):
    """The element lists are read from the registry (formats.mx_elements), not copied: a format added to it
    shows up in chapter 9's outlier explorer and among exercise 9.1's cases; the unsigned scale format does not."""
    elements = formats.mx_elements()
    assert {"fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"} <= set(elements)
    assert "fp8_e8m0" not in elements and "fp16" not in elements
    new = formats.FormatSpec("fp8_e3m4", 3, 4, has_inf=False, saturates=True)
    monkeypatch.setitem(formats.FORMATS, "fp8_e3m4", new)
    assert "fp8_e3m4" in widgets.outlier_explorer(np.ones((2, 32))).element.options
    assert "fp8_e3m4" in {el for _, el in ch09._mx_cases()}


@pytest.mark.parametrize("seed", range(6))
def test_the_scaler_simulators_event_path_is_simulate_scale(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(1, 4000))
        over = rng.random(n) < float(rng.choice([0.0, 1e-3, 0.05, 0.5, 1.0]))
        args = (2.0 ** int(rng.integers(-30, 127)), float(rng.choice([1.05, 2.0, 8.0])),
                float(rng.choice([0.05, 0.5, 0.95])), int(rng.choice([1, 2, 3, 100, 2000])))
        assert _scale_trajectory(over, *args).tolist() == scaling.simulate_scale(over.tolist(), *args)


def test_the_scaler_simulator_still_draws_simulate_scale():
    w = widgets.scaler_simulator(steps=5000)
    w.growth_interval.value = 137
    want = scaling.simulate_scale(w.pattern(), 2.0**16, 2.0, 0.5, 137)
    assert w.scales == want and w.summary["final_scale"] == want[-1]
