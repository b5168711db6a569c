"""The widgets' Python side, driven the way the browser drives it (tests/course/test_browser.py drives the page)."""

import math

import pytest

from ampcourse.widgets import format_explorer, parse_number


def test_typing_a_value_updates_every_format():
    w = format_explorer(1.0001)
    w.text.value = "70000"
    assert w.x == 70000.0 and math.isinf(w.rows["fp16"]["value"]) and w.rows["bf16"]["value"] == 70144.0
    assert "inf" in w.table.value and "overflow" in w.table.value


def test_moving_the_slider_sets_the_value_and_keeps_its_sign():
    w = format_explorer(-3.0)
    w.slider.value = 2.0
    assert w.x == -100.0 and w.text.value == "-100"


def test_the_browser_snapping_the_slider_to_its_step_does_not_change_the_value():
    """A browser rounds the slider to its step (log10 70000 = 4.845 -> 4.85) and echoes it back."""
    w = format_explorer(1.0001)
    w.slider.value = 0.0  # the echo right after the widget is displayed
    assert w.x == 1.0001 and w.text.value == "1.0001"
    w.text.value = "70000"
    w.slider.value = round(w.slider.value / w.slider.step) * w.slider.step
    assert w.x == 70000.0 and w.text.value == "70000"


def test_a_bad_value_shows_a_message_and_keeps_the_last_good_one():
    w = format_explorer(2.0)
    w.text.value = "seventy"
    assert w.x == 2.0 and "not a number" in w.message.value
    with pytest.raises(ValueError, match="'seventy' is not a number"):
        parse_number("seventy")
