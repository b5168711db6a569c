"""What every test under tests/ can import by name, wherever its file lives (layout: tests/README.md).

- tests/: the helpers shared across folders (doctor_gallery, planted, dist_worker, clirun). pytest's default import mode
  puts only a test file's own folder on sys.path, so tests/doctor/test_doctor.py would not find tests/planted.py.
- tools/: the repository's scripts that tests import as modules (nbtool, gpu_test, make_student, lab_config, ...).
  tools/ is no package and must not become one (tools/gpu_test.py runs as a plain stdlib script on GPU images).

benchmarks/ stays off sys.path here: the few tests that import a benchmark script put it there for that test only.
"""
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

for _folder in (TESTS, ROOT / "tools"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def _start_rank(item) -> int:
    """Where pytest-xdist should start `item`'s scope: 0 modules with minutes of work, 1 notebooks, 2 the rest.

    Under `--dist loadscope` a module (a notebook: its cells) runs whole in one worker. xdist's own order puts the
    scopes with the most tests first, which left the few long tests (a browser, learner copies, torchrun jobs) to the
    end, one worker running them for minutes while the other idled (1457 s for `make test` on 2 cores, ~8 min of it
    one worker). Long ones first, then the notebooks (a minute or two each), then the many short modules.
    """
    if item.get_closest_marker("slow") or item.get_closest_marker("starts_first"):
        return 0
    return 1 if item.path.suffix == ".ipynb" else 2


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`, the CI legs) put the long scopes first; order inside a scope unchanged."""
    if not getattr(config.option, "numprocesses", None):
        return
    long_modules = {item.path for item in items if _start_rank(item) == 0}
    items.sort(key=lambda item: 0 if item.path in long_modules else _start_rank(item))
