"""The explorers at the edges of the formats: what a learner sees is what the format does (audit of chapters 1, 6, 9).

NaN in formats with no NaN encoding (fp6, fp4), bursts past the current run, saturating and zero-less formats
in the range explorer, rows that do not split into NVFP4's blocks, and values float64 itself changes.
"""

import math

import numpy as np
import pytest
import torch

from ampcourse import formats
from ampcourse.widgets import format_explorer, outlier_explorer, range_explorer, scaler_simulator

NO_NAN = [n for n in formats.names(narrow=True) if not formats.spec(n).has_nan]  # fp6, fp4: read from the registry


@pytest.fixture(scope="module")
def grads():
    rng = np.random.default_rng(1)
    return rng.standard_normal(2000) * 2.0 ** rng.uniform(-30, -2, 2000)


# -- 1. the bit explorer and NaN -------------------------------------------------------------------------------

@pytest.mark.parametrize("typed", ["nan", "-nan"])
def test_nan_shows_every_row_and_the_no_nan_formats_say_they_cannot_store_it(typed):
    assert NO_NAN, "the registry has formats without NaN (fp6, fp4): this test is about them"
    w = format_explorer(1.0, fmts=tuple(formats.names(narrow=True)))
    w.text.value = "3"
    w.text.value = typed
    assert w.text.value == typed and w.message.value == "" and math.isnan(w.x)  # the typed text stays
    assert list(w.rows) == formats.names(narrow=True)  # every row, not a refused table
    for f, r in w.rows.items():
        if f in NO_NAN:
            assert r["bits"] == "" and r["html"] == "" and not r["stored"]
        else:  # fp32 ... e8m0 have NaN encodings: their bits are shown
            assert r["kind"] == "nan" and r["bits"] == formats.decompose(w.x, f).bits and r["stored"]
    table = w.table.value
    assert table.count("no NaN encoding (cannot be stored)") == len(NO_NAN)
    assert "quantize" not in table + w.message.value and "pass a" not in table + w.message.value  # not API wording


@pytest.mark.parametrize("fmts", [("fp4_e2m1",), "fp4_e2m1", ("fp16", "fp4_e2m1")])
def test_a_nan_start_value_builds_the_widget(fmts):
    w = format_explorer(float("nan"), fmts=fmts)  # raised a ValueError in the constructor
    assert math.isnan(w.x) and "no NaN encoding" in w.table.value


def test_a_nan_set_on_the_slider_from_code_is_refused_with_a_clear_message():
    w = format_explorer(3.0, fmts=("fp16", "fp4_e2m1"))
    before = (w.slider.value, w.table.value)
    w.slider.value = float("nan")
    assert (w.slider.value, w.table.value) == before and w.x == 3.0 and float(w.text.value) == 3.0
    assert "log10 |x| must be a finite number" in w.message.value and "Kept" in w.message.value
    w.text.value = "nan"  # the way to a NaN: the box
    assert math.isnan(w.x) and w.message.value == ""


# -- 6. notes that say what happened ---------------------------------------------------------------------------

def test_a_value_clamped_up_in_a_format_with_no_zero_is_not_called_normal():
    w = format_explorer(1e-50, fmts=("fp16", "fp8_e8m0"))
    smallest = formats.spec("fp8_e8m0").min_normal
    assert w.rows["fp8_e8m0"]["value"] == smallest and w.rows["fp8_e8m0"]["clamped_up"]
    assert "clamped up to the smallest value" in w.table.value
    assert w.rows["fp16"]["underflow"] and not w.rows["fp16"]["clamped_up"]  # fp16 has a zero: it flushes
    w.text.value = "4e-39"  # above 2**-128: rounds to 2**-127 as the nearest value, not a clamp
    assert w.rows["fp8_e8m0"]["value"] == smallest and not w.rows["fp8_e8m0"]["clamped_up"]


@pytest.mark.parametrize("typed, said", [("1e999", "read as inf"), ("-1e999", "read as inf"),
                                         ("1e-999", "read as 0")])
def test_a_number_beyond_float64_is_said_to_be_read_as_inf_or_0(typed, said):
    w = format_explorer(1.0)
    w.text.value = typed
    assert said in w.message.value and "color:#d62728" not in w.message.value  # a note, not an error
    for quiet in ("inf", "-inf", "0", "0e5", "1e308"):  # typed as they are: nothing to say
        w.text.value = quiet
        assert w.message.value == "", quiet


# -- 2. the scaler's burst past the run ------------------------------------------------------------------------

@pytest.mark.parametrize("typed_first", [True, False])
def test_a_burst_past_the_run_comes_back_when_the_run_grows(typed_first):
    if typed_first:
        s = scaler_simulator(steps=6000, probability=1e-5)
        s.burst.value = "8000-8005"
    else:
        s = scaler_simulator(steps=6000, probability=1e-5, burst="8000-8005")
    assert len(s.overflows) == 6000  # beyond this run: not in it
    s.steps.value = 10000
    assert s.overflows[7999:8005] == [True] * 6 and s.summary["skipped"] >= 6
    s.steps.value = 7000
    assert len(s.overflows) == 7000 and s.message.value == ""


# -- 3 and 7. the range explorer -------------------------------------------------------------------------------

def _labels(w) -> dict[str, str]:
    """The counts table's label per category (data-category attribute -> first cell)."""
    import re

    return dict(re.findall(r'data-category="(\w+)"><td>([^<]*)</td>', w.counts_html.value))


@pytest.mark.parametrize("fmt", [n for n in formats.names(narrow=True) if formats.spec(n).bits < 32])
def test_range_explorer_names_what_each_format_does_past_its_range(fmt, grads):
    f = formats.spec(fmt)
    w = range_explorer(grads, fmt=fmt)
    w.slider.value = 40  # most values past the top
    top, bottom = _labels(w)["overflow"], _labels(w)["underflow"]
    past = float(formats.quantize([2 * f.max], fmt)[0])  # what quantize makes of a value past the range
    if past == f.max:
        assert top.startswith("saturated") and "inf" not in top and "NaN" not in top, top
    else:
        assert top == ("overflow (inf)" if math.isinf(past) else "overflow (NaN)"), top
    zero = float(formats.quantize([0.0], fmt)[0])
    assert ("flush to zero" in bottom) == (zero == 0.0), bottom  # e8m0 has no zero: nothing flushes to it


def test_range_explorer_e4m3_overflow_is_called_saturated(grads):
    w = range_explorer(grads, fmt="fp8_e4m3")
    w.slider.value = 24
    assert "saturated (clamped to ±max)" in w.counts_html.value and "inf/NaN" not in w.counts_html.value
    w.fmt_select.value = "fp16"
    assert "overflow (inf)" in w.counts_html.value


def test_a_refused_scale_does_not_stay_in_the_box_after_a_format_switch(grads):
    w = range_explorer(grads)
    w.slider.value = -3
    w.text.value = "abc"
    assert "not a loss scale" in w.message.value and w.text.value == "abc"
    w.fmt_select.value = "bf16"
    assert w.text.value == "2**-3" and w.message.value == "" and "loss scale 0.125" in w.ax.title.get_text()
    w.text.value = "1e3"  # a good scale typed its own way stays as typed
    w.fmt_select.value = "fp16"
    assert w.text.value == "1e3" and w.scale == 1000.0


# -- 5. the outlier explorer and NVFP4's blocks ----------------------------------------------------------------

@pytest.mark.parametrize("cols", [8, 24, 40])
def test_rows_that_do_not_split_into_16s_work_for_fp4_without_an_nvfp4_row(cols):
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(0))
    w = outlier_explorer(x=x, element="fp4_e2m1", block_size=8)  # raised for the default element
    assert "nvfp4" not in w.results and set(w.results) == {"tensor", "row", "block fp32", "block e8m0"}
    w = outlier_explorer(x=x, element="fp8_e4m3", block_size=8)
    w.element.value = "fp4_e2m1"  # was refused: "pick another granularity", a control the widget lacks
    assert w.element.value == "fp4_e2m1" and w.message.value == "" and "nvfp4" not in w.results
    assert "granularity" not in w.table.value


def test_rows_of_16s_keep_the_nvfp4_row():
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(0))
    assert "nvfp4" in outlier_explorer(x=x, element="fp4_e2m1", block_size=16).results
