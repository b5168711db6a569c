"""`python -m ampcourse.widgets`: the course's CLI style (issue 31): bad input is one line on stderr and exit status 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampcourse.widgets import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["--bench", "--repeats", "0"], "--repeats must be an int >= 1"),
    (["--repeats", "-3"], "got -3"),
    (["--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--repeats", "5"], "--repeats only counts moves for --bench"),  # was the help, status 0, no hint
])
def test_bad_flags_are_one_line_and_status_2_from_a_shell(argv, message):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "ampcourse.widgets", *argv], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert len(lines) == 1 and lines[0].startswith("ampcourse.widgets: error:") and message in lines[0], run.stderr


def test_main_returns_the_status_and_the_old_entry_point_still_exits(capsys):
    assert cli.main(["--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ampcourse.widgets: error: --repeats must be an int >= 1 (at most 2**63 - 1), got 0"]
    with pytest.raises(SystemExit) as info:  # _main: benchmarks/widget_update.py's entry point, as before the split
        cli._main(["--bench", "--repeats", "0"])
    assert info.value.code == 2
    assert cli.main([]) == 0 and "--bench" in capsys.readouterr().out  # no --bench: the help, nothing timed
    assert cli.main(["--help"]) == 0


def test_bench_prints_one_table_row_per_timed_control(monkeypatch, capsys):
    """The table's wiring (the timing itself runs in benchmarks/widget_update.py: ~15 s even at 2 repeats)."""
    asked = []

    def fake_benchmark(repeats):
        asked.append(("benchmark", repeats))
        return {"a: slider": {"median_ms": 1.0, "p90_ms": 2.0, "full_redraw_median_ms": 4.0, "speedup": 4.0},
                "b: box": {"median_ms": 3.0, "p90_ms": 5.0, "full_redraw_median_ms": 3.0, "speedup": 1.0}}

    def fake_simulation(repeats):
        asked.append(("simulation", repeats))
        return {"per step": 10.0, "per event": 0.5}

    monkeypatch.setattr(cli, "benchmark", fake_benchmark)
    monkeypatch.setattr(cli, "simulation_benchmark", fake_simulation)
    assert cli.main(["--bench", "--repeats", "7"]) == 0
    assert asked == [("benchmark", 7), ("simulation", 7)]
    out = capsys.readouterr().out
    assert "| a: slider | 1.0 | 2.0 | 4.0 | 4.0x |" in out and "| b: box | 3.0 | 5.0 | 3.0 | 1.0x |" in out
    assert "per step 10.0 ms, per event 0.50 ms (20x)" in out


def test_widgets_with_no_figure_print_n_a_for_full_redraw_and_speedup(monkeypatch, capsys):
    def fake_benchmark(repeats):
        return {"fig: slider": {"median_ms": 1.0, "p90_ms": 2.0, "full_redraw_median_ms": 4.0, "speedup": 4.0},
                "html: slider": {"median_ms": 0.2, "p90_ms": 0.4, "full_redraw_median_ms": None, "speedup": None}}

    monkeypatch.setattr(cli, "benchmark", fake_benchmark)
    monkeypatch.setattr(cli, "simulation_benchmark", lambda repeats: {"per step": 10.0, "per event": 0.5})
    assert cli.main(["--bench", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| html: slider | 0.2 | 0.4 | n/a | n/a (no figure) |" in out
    assert "| fig: slider | 1.0 | 2.0 | 4.0 | 4.0x |" in out


def test_benchmark_gives_no_speedup_for_the_html_widgets():
    """One real move per control (a few seconds): the HTML-only widgets have no full redraw to compare."""
    out = cli.benchmark(1)
    for name, r in out.items():
        figure = not name.startswith(("format_explorer", "outlier_explorer"))
        assert (r["speedup"] is not None) == figure and (r["full_redraw_median_ms"] is not None) == figure, name
