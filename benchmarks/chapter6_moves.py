"""Chapter 6's widget moves, timed as a learner makes them: scale slider, format dropdown, backoff, steps.

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> .venv/bin/python benchmarks/chapter6_moves.py 5   # rounds

One process per tree; alternate two trees (main, branch, main, branch) to compare. The format switches come
after ``prerender()`` where the widget has it (what a kernel does once the widget's cell is done).
Recorded in benchmarks/README.md, widget section, 2026-12-02.
"""
import statistics, sys, time
import numpy as np
from ampcourse import widgets
def t(f):
    s = time.perf_counter(); f(); return 1000 * (time.perf_counter() - s)
res = {}
r = widgets.range_explorer()
if hasattr(r, "prerender"):
    r.prerender()  # what the kernel does once the widget's cell is done
s = widgets.scaler_simulator()
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for v in range(-4, 30, 2):
        res.setdefault("range_explorer: log2 scale slider", []).append(t(lambda: setattr(r.slider, "value", v)))
    for f in ["bf16", "fp8_e4m3", "fp8_e5m2", "fp16"]:
        res.setdefault("range_explorer: format dropdown", []).append(t(lambda: setattr(r.fmt_select, "value", f)))
    for v in (0.25, 0.5, 0.3, 0.45):
        res.setdefault("scaler_simulator: backoff_factor", []).append(t(lambda: setattr(s.backoff_factor, "value", v)))
    res.setdefault("scaler_simulator: steps 6000 -> 20000", []).append(t(lambda: setattr(s.steps, "value", 20000)))
    res.setdefault("scaler_simulator: steps 20000 -> 6000", []).append(t(lambda: setattr(s.steps, "value", 6000)))
for k, v in res.items():
    print(f"| {k} | {statistics.median(v):.1f} ({np.percentile(v, 90):.1f}) |")
