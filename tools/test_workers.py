"""How many pytest-xdist workers `make test` and the CI legs use: one per usable core, at most 4; 0 on one core.

Tests run with one OpenMP thread each (`OMP_NUM_THREADS=1`), so a single pytest process keeps one core busy. More
than 4 workers gains little and starves the distributed tests, which start 2-4 processes of their own. With one
core, 0: pytest runs in its own process (no worker to start).

Example::

    $ python3 tools/test_workers.py        # on a 2-core machine
    2
"""

import os


def test_workers(cores: int | None = None, cap: int = 4) -> int:
    """The worker count for `cores` usable cores (default: this process's CPU affinity).

    Args:
        cores: usable cores; None reads them from the scheduler (a container's limit included, not the host's).
        cap: the most workers to start.

    Example::

        >>> test_workers(2), test_workers(1), test_workers(16)
        (2, 0, 4)
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores <= 1 else min(cap, cores)


if __name__ == "__main__":
    print(test_workers())
