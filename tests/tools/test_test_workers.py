"""`make test`, `make unit` and the CI legs run pytest-xdist workers, one per core (tools/test_workers.py)."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    """A file of the repository as a module of its own (`import conftest` may find another folder's conftest)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tool():
    return _load(ROOT / "tools" / "test_workers.py", "test_workers_tool")


@pytest.mark.parametrize(("cores", "workers"), [(1, 0), (2, 2), (3, 3), (4, 4), (16, 4), (128, 4)])
def test_one_worker_per_core_at_most_four_and_none_on_one_core(cores, workers):
    assert _tool().test_workers(cores) == workers


def test_the_default_reads_this_processs_cores():
    cores = len(os.sched_getaffinity(0))
    assert _tool().test_workers() == (0 if cores == 1 else min(4, cores))


def _pytest_lines(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TEST_WORKERS")}
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if "-m pytest" in line]


@pytest.mark.parametrize("target", ["test", "unit"])
def test_make_runs_the_suite_in_workers_that_keep_a_notebook_in_one(target):
    (line,) = _pytest_lines(target, "TEST_WORKERS=3")
    assert " -n 3 --dist loadscope" in line
    (line,) = _pytest_lines(target, "TEST_WORKERS=0")
    assert " -n " not in line and "--dist" not in line
    (line,) = _pytest_lines(target)
    expected = _tool().test_workers()
    assert (f" -n {expected} --dist loadscope" in line) if expected else (" -n " not in line)


def test_the_leg_script_passes_the_same_workers_to_both_of_its_pytest_runs():
    script = (ROOT / "tools" / "torch_leg.sh").read_text()
    runs = [line for line in script.splitlines() if "-m pytest" in line]
    assert len(runs) == 2 and all('"${XDIST[@]}"' in line for line in runs)
    assert 'XDIST=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder)' in script
    assert "tools/test_workers.py" in script


class _Item:
    """What the ordering hook reads of a pytest item: its file and its markers."""

    def __init__(self, path: str, *marks: str):
        self.path, self.marks = Path(path), set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


class _Config:
    def __init__(self, workers):
        self.option = type("Option", (), {"numprocesses": workers})()


def test_under_xdist_long_modules_start_first_then_notebooks_then_the_rest():
    conftest = _load(ROOT / "tests" / "conftest.py", "tests_conftest")
    items = [_Item("tests/a.py"), _Item("tests/long.py"), _Item("tests/long.py", "slow"), _Item("chapters/01.ipynb"),
             _Item("tests/b.py"), _Item("tests/browser.py", "starts_first"), _Item("chapters/02.ipynb")]
    order = list(items)
    conftest.pytest_collection_modifyitems(_Config(2), order)
    assert [(str(i.path), sorted(i.marks)) for i in order] == [
        ("tests/long.py", []), ("tests/long.py", ["slow"]),  # a module stays together, in its own order
        ("tests/browser.py", ["starts_first"]), ("chapters/01.ipynb", []), ("chapters/02.ipynb", []),
        ("tests/a.py", []), ("tests/b.py", [])]
    unchanged = list(items)
    conftest.pytest_collection_modifyitems(_Config(None), unchanged)  # one process: collection order kept
    assert unchanged == items
