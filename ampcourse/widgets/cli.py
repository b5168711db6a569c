"""The widgets' command line (chapters 1, 6 and 9): ``python -m ampcourse.widgets --bench [--repeats N]``.

Times slider moves of every explorer (benchmarks/README.md, widget section) and prints them as a Markdown table.
Bad input is one line on stderr and exit status 2, as in the course's other command lines.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence

import numpy as np

from .. import _args, scaling
from .bits import format_explorer
from .outlier import outlier_explorer
from .ranges import RangeExplorer, range_explorer
from .scaler import _scale_trajectory, scaler_simulator

__all__ = ["main", "benchmark", "simulation_benchmark"]

_PROG = "ampcourse.widgets"


def benchmark(repeats: int = 60) -> dict[str, dict[str, float]]:
    """Milliseconds per slider move (median, p90) while dragging each control, cached axes vs full redraws, interleaved.

    A widget with no figure (format_explorer, outlier_explorer: HTML tables) has no full redraw: its
    ``full_redraw_median_ms`` and ``speedup`` are None.
    """
    repeats = _args.integer(repeats, "repeats", low=1)  # numpy ints and 0-d tensors too
    drag = lambda lo, hi, step: [round(lo + i * step, 10) for i in range(int(round((hi - lo) / step)) + 1)]
    cases = {"format_explorer: log10 abs(x) slider": (format_explorer(), "slider", drag(-9, 6, 0.25)),
             "range_explorer: log2 scale slider": (range_explorer(), "slider", drag(-24, 40, 1)),
             "scaler_simulator: backoff_factor": (scaler_simulator(), "backoff_factor", drag(0.05, 0.95, 0.05)),
             "scaler_simulator: growth_interval": (scaler_simulator(), "growth_interval", drag(1500, 2100, 10)),
             "scaler_simulator, 20k steps: growth_interval": (scaler_simulator(steps=20000), "growth_interval",
                                                              drag(100, 400, 5)),
             "outlier_explorer: log2 outlier slider": (outlier_explorer(), "magnitude", drag(0, 16, 1)),
             # issue 28 item 16: a format switch (prerendered, as in a kernel) and a steps drag across axis ends
             "range_explorer: format dropdown": (_prerendered(range_explorer()), "fmt_select",
                                                 ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]),
             "scaler_simulator: steps slider": (scaler_simulator(), "steps", drag(5000, 20000, 500))}
    out = {}
    for name, (w, attr, values) in cases.items():
        control, times = getattr(w, attr), {"cached": [], "full": []}
        # format_explorer and outlier_explorer are HTML only: no axes to cache, so no full redraw and no speedup
        modes = ("cached", "full") if hasattr(w, "_figure") else ("cached",)
        path = values + values[-2:0:-1]  # drag right, then back left
        for i in range(repeats):
            for mode in modes:  # interleaved, so machine noise hits both alike
                kept = None
                if mode == "full":
                    # as if every move changed the axes: no bitmap for this move, the others kept for the next
                    kept, w._figure._backgrounds = w._figure._backgrounds, {}
                t = time.perf_counter()
                control.value = path[(2 * i + (mode == "full")) % len(path)]
                times[mode].append(1000 * (time.perf_counter() - t))
                if kept is not None:
                    w._figure._backgrounds = {**kept, **w._figure._backgrounds}
        med = {m: float(np.median(t)) for m, t in times.items() if t}
        full = med.get("full")  # None: a widget with no figure
        out[name] = {"median_ms": med["cached"], "p90_ms": float(np.percentile(times["cached"], 90)),
                     "full_redraw_median_ms": full, "speedup": None if full is None else full / med["cached"],
                     "moves": repeats}
    return out


def _prerendered(w: RangeExplorer) -> RangeExplorer:
    """w with every format drawn ahead, as a kernel does once the widget's cell is done."""
    w.prerender()
    return w


def simulation_benchmark(repeats: int = 20, steps: int = 20000) -> dict[str, float]:
    """Milliseconds (median) of the scaler simulator's simulation alone, per step (scaling.simulate_scale) vs per
    event (_scale_trajectory), interleaved on the same 20k-step pattern and a growth_interval drag."""
    repeats = _args.integer(repeats, "repeats", low=1)
    over = scaler_simulator(steps=steps)._pattern()
    times: dict[str, list[float]] = {"per step": [], "per event": []}
    for i in range(repeats):
        interval = 100 + 5 * (i % 60)
        t = time.perf_counter()
        scaling.simulate_scale(over.tolist(), 2.0**16, 2.0, 0.5, interval)
        times["per step"].append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        _scale_trajectory(over, 2.0**16, 2.0, 0.5, interval)
        times["per event"].append(1000 * (time.perf_counter() - t))
    return {k: float(np.median(v)) for k, v in times.items()}


def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.widgets."""
    ap = _args.OneLineParser(prog="python -m ampcourse.widgets", description=__doc__.split("\n\n")[0],
                             error_prefix=_PROG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="store_true", help="time slider moves of every explorer (a Markdown table)")
    ap.add_argument("--repeats", type=int, default=None, help="moves per control, with --bench (default 60)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the widgets' command line; 0 on success, 2 with one line on stderr for bad input.

    Args:
        argv: the arguments, as after ``python -m ampcourse.widgets`` (default: ``sys.argv[1:]``).

    Example:
        >>> main(["--bench", "--repeats", "5"])  # prints the benchmark table
        0
    """
    ap = _parser()
    args = ap.parse_or_status(argv)
    if isinstance(args, int):  # --help (0), or a bad flag (2) whose one line is already on stderr
        return args
    try:
        repeats = _args.integer(60 if args.repeats is None else args.repeats, "--repeats", low=1)
        if args.repeats is not None and not args.bench:  # it would be ignored: say so rather than print the help
            raise ValueError(f"--repeats only counts moves for --bench: run python -m ampcourse.widgets --bench "
                             f"--repeats {repeats}")
    except ValueError as err:
        print(f"{_PROG}: error: {_args.first_line(err)}", file=sys.stderr)
        return 2
    if not args.bench:
        ap.print_help()
        return 0
    print(f"widget update benchmark: {repeats} moves per control (dragged one step at a time), "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    print("| widget: control dragged | median ms | p90 ms | full redraw median ms | speedup from cached axes |")
    print("|---|---|---|---|---|")
    for name, r in benchmark(repeats).items():
        full = "n/a" if r["full_redraw_median_ms"] is None else f"{r['full_redraw_median_ms']:.1f}"
        speedup = "n/a (no figure)" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(f"| {name} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {full} | {speedup} |")
    sim = simulation_benchmark(repeats)
    print(f"\nscaler_simulator, 20k steps, the simulation alone (median): per step {sim['per step']:.1f} ms, "
          f"per event {sim['per event']:.2f} ms ({sim['per step'] / sim['per event']:.0f}x)")
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    """main(argv), but bad input ends with SystemExit(2) as before the package split (one line on stderr now).

    The old entry point's contract, kept for benchmarks/widget_update.py and for callers that expect a refused
    command line to exit (tests/test_bad_inputs.py's CLI table); new code calls ``main``.
    """
    code = main(argv)
    if code:
        raise SystemExit(code)
    return code
