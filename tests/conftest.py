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
