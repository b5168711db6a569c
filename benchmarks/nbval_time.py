"""Wall time of the notebook suite (`pytest chapters/`, nbval strict) as a whole and per chapter.

    .venv/bin/python benchmarks/nbval_time.py                 # torch's default threads
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/nbval_time.py

The whole suite is one `pytest chapters/` run (what `make test` adds to the unit tests); each chapter
is then run on its own (`pytest chapters/NN_name.ipynb`: kernel start-up included, as a learner's
"Run all" would). The load average before and after is printed: the machine may be shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_pytest(*paths: str) -> tuple[float, str]:
    """Seconds for one pytest run over the given notebooks, and its summary line."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *paths], cwd=ROOT,
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"pytest {' '.join(paths)} failed:\n{out.stdout[-2000:]}")
    return seconds, out.stdout.strip().splitlines()[-1]


def main() -> int:
    chapters = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("*.ipynb"))
    print(f"load average before: {os.getloadavg()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"{os.cpu_count()} CPUs")
    whole, summary = timed_pytest("chapters/")
    print(f"whole suite (pytest chapters/): {whole:.1f} s  [{summary}]")
    print("| chapter | seconds (own pytest run) |")
    print("|---|---|")
    total = 0.0
    for nb in chapters:
        seconds, _ = timed_pytest(nb)
        total += seconds
        print(f"| {Path(nb).stem} | {seconds:.1f} |")
    print(f"sum of the separate runs: {total:.1f} s; load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
