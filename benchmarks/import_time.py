"""How long `import ampcourse` takes on top of `import torch`: fresh interpreters, interleaved, repeated.

    .venv/bin/python benchmarks/import_time.py --repeats 15

Each variant runs in a new `python -c` process (so nothing is cached in the interpreter; the OS file
cache is warm after the first round, as it is for a learner re-running a notebook). Reported: the
median wall and CPU (user + system) time of the whole process per variant, the median of the
per-round CPU differences to `import torch` (CPU time: other jobs on a shared machine do not count),
and `python -X importtime`'s slowest top-level imports.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "python (nothing)": "pass",
    "import torch": "import torch",
    "import torch, ampcourse": "import torch, ampcourse",
    "import ampcourse (alone)": "import ampcourse",
    "torch + ampcourse's core modules": "import torch\nfrom ampcourse import device, formats, models, train, checkpoint, scaling",
    "torch + core + widgets": "import torch\nfrom ampcourse import device, formats, models, train, checkpoint, scaling, widgets",
}


def run_once(code: str) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) for a fresh interpreter to run code and exit."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def importtime(code: str) -> list[tuple[str, int]]:
    """Top-level imports (what the code itself imported, not their children) with cumulative microseconds."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1")).stderr
    top = []
    for line in out.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m:
            top.append((m.group(2), int(m.group(1))))
    return sorted(top, key=lambda kv: -kv[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    for code in VARIANTS.values():  # warm the file cache
        run_once(code)
    times = {name: [] for name in VARIANTS}
    for r in range(args.repeats):
        names = list(VARIANTS)
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run_once(VARIANTS[name]))
    print(f"{args.repeats} interleaved rounds, fresh interpreter each, {os.cpu_count()} CPUs (shared: read the CPU column)")
    print("| variant | median wall s | median CPU s | CPU over `import torch` (median of per-round differences) |")
    print("|---|---|---|---|")
    base = [c for _, c in times["import torch"]]
    for name, ts in times.items():
        diff = statistics.median(c - b for (_, c), b in zip(ts, base))
        print(f"| {name} | {statistics.median(w for w, _ in ts):.3f} | {statistics.median(c for _, c in ts):.3f} "
              f"| {diff * 1e3:+.0f} ms |")
    print("\npython -X importtime, torch + core + widgets: the slowest top-level imports (cumulative ms):")
    for mod, us in importtime(VARIANTS["torch + core + widgets"])[:8]:
        print(f"  {mod:32s} {us / 1e3:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
