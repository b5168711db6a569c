"""A chapter's Run All on an idle and on a busy machine, with the kernel's OpenMP setting as `make lab` and
`make test` give it (OMP_NUM_THREADS=1) and with torch's default (one thread per core).

    .venv/bin/python benchmarks/busy_machine.py                      # chapters 02 and 03, 1 repeat
    .venv/bin/python benchmarks/busy_machine.py 02 04 --repeats 2
    .venv/bin/python benchmarks/busy_machine.py 00 01 02 03 04 05 06 07 08 09 --lab-only   # every chapter

"Busy" = two CPU-bound processes (`while True: pass`) running beside the notebook, as on a learner's
laptop with a build or another notebook going. Each run executes the whole chapter in a fresh kernel
(nbclient, kernel start included, cwd chapters/) from a child process whose environment the kernel
inherits, exactly as JupyterLab's kernels inherit `make lab`'s and nbval's inherit `make test`'s.
Variants are interleaved (idle/busy x setting) so drifting background load hits them alike; the load
average is printed, since the development machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"OMP_NUM_THREADS=1 (make lab/test)": "1", "torch default threads": None}
RUN_ONE = """
import sys, time, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
start = time.perf_counter()
NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
print(time.perf_counter() - start)
"""


def chapter(prefix: str) -> Path:
    """chapters/NN_*.ipynb for a prefix like '02'."""
    found = sorted((ROOT / "chapters").glob(f"{prefix}_*.ipynb"))
    if not found:
        raise SystemExit(f"no chapter {prefix}_*.ipynb in chapters/")
    return found[0]


def run_all(path: Path, omp: str | None) -> float:
    """Seconds to execute the whole notebook in a fresh kernel whose environment has OMP_NUM_THREADS=omp (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", RUN_ONE, str(path), str(path.parent)], env=env, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{path.name} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def burners(n: int) -> list[subprocess.Popen]:
    """n CPU-bound processes (a busy machine)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    """Measure and print a Markdown table: idle and busy seconds per chapter and setting, and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapters", nargs="*", default=["02", "03"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--lab-only", action="store_true", help="only the OMP_NUM_THREADS=1 setting (make lab/test)")
    args = ap.parse_args(argv)
    settings = dict(list(SETTINGS.items())[:1]) if args.lab_only else SETTINGS
    if args.repeats < 1 or args.burners < 0:
        ap.error("--repeats must be >= 1 and --burners >= 0")
    paths = [chapter(c) for c in args.chapters]
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()}", flush=True)
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.repeats):
        for path in paths:
            for label, omp in settings.items():
                for busy in (False, True):
                    procs = burners(args.burners) if busy else []
                    try:
                        time.sleep(1.0 if busy else 0.0)  # let the burners reach full speed
                        t = run_all(path, omp)
                    finally:
                        for p in procs:
                            p.kill()
                            p.wait()
                    times.setdefault((path.name, label, "busy" if busy else "idle"), []).append(t)
                    print(f"  {path.name}, {label}, {'busy' if busy else 'idle'}: {t:.1f} s "
                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"\n| chapter | kernel setting | idle s | busy s ({args.burners} CPU-bound processes) | busy / idle |")
    print("|---|---|---|---|---|")
    for path in paths:
        for label in settings:
            idle = statistics.median(times[path.name, label, "idle"])
            busy = statistics.median(times[path.name, label, "busy"])
            print(f"| {path.stem} | {label} | {idle:.1f} | {busy:.1f} | {busy / idle:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
