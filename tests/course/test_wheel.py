"""The course as Colab installs it (`pip install --no-deps "git+..."`, issue 29 item 8): a wheel, outside any checkout.

The wheel used to hold only ampcourse/: chapter 7 could not find examples/ddp_amp.py (cells 23, 25, 27 failed on
every Colab runtime) and chapter 2's load_gpu_report() never found a committed report. Here the wheel is built from a
copy of this checkout (with a GPU report in it, as after a recorded run), installed into a folder outside the
repository, and the chapters' own cells run against that install from elsewhere.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build and fresh processes: ~80 s; `make test` runs them, `make unit` not
ROOT = Path(__file__).resolve().parents[2]
REPORT = {"status": "passed", "started": "2026-12-02T01:00:00+00:00",
          "machine": {"device": "NVIDIA H200", "capability": "sm_90", "torch": "2.11.0", "cuda": "12.8"},
          "goals": [{"name": "a goal", "shown": "3.10x", "goal": ">= 3x", "met": True}]}


def _source_copy(dest: Path) -> Path:
    """The files git would commit from this checkout (tracked, and new ones not ignored), copied to dest."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A wheel of this checkout (plus a recorded GPU report) pip-installed into a folder of its own: its path."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    (src / "benchmarks" / "gpu").mkdir(parents=True, exist_ok=True)
    (src / "benchmarks" / "gpu" / "report.json").write_text(json.dumps(REPORT))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=300, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("ampcourse-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "--no-compile", "--target", str(tmp / "site"), str(wheel)],
                   check=True, timeout=300, cwd=tmp)
    return tmp / "site"


def _run_outside(site: Path, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """code in a fresh Python whose ampcourse is the installed one, from a folder outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), MPLBACKEND="Agg", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        from pathlib import Path
        import ampcourse
        site = Path({str(site)!r})
        assert site in Path(ampcourse.__file__).resolve().parents, ampcourse.__file__  # not the checkout
        """) + code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def _cells(chapter: str, *starts: str) -> str:
    """The code cells of a chapter that begin with (or contain) each string, in order, as one script."""
    cells = ["".join(c["source"]) for c in json.loads((ROOT / "chapters" / chapter).read_text())["cells"]
             if c["cell_type"] == "code"]
    return "\n\n".join(next(c for c in cells if s in c) for s in starts)


def test_the_wheel_ships_what_the_chapters_read(installed, tmp_path):
    run = _run_outside(installed, textwrap.dedent(f"""\
        from ampcourse import bench, shipped
        assert shipped.checkout_root() is None
        script = shipped.path("examples/ddp_amp.py")
        assert script is not None and script.read_bytes() == Path({str(ROOT / "examples/ddp_amp.py")!r}).read_bytes()
        report = bench.load_gpu_report()
        print(bench.gpu_report_lines(report)[0])
        """), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("recorded GPU run: NVIDIA H200 (sm_90), torch 2.11.0"), run.stdout


def test_chapter_2_finds_the_committed_report_in_the_wheel(installed, tmp_path):
    code = "from ampcourse import bench\n\n" + _cells("02_why_mixed_precision.ipynb", "bench.load_gpu_report()")
    run = _run_outside(installed, code + "\nassert recorded is not None and report_lines\nprint(report_lines[0])\n",
                       tmp_path)
    assert run.returncode == 0 and "recorded GPU run: NVIDIA H200" in run.stdout, run.stderr[-3000:]


def test_chapter_7s_script_cells_run_from_the_wheel(installed, tmp_path):
    """After its setup cells (2, 7): cells 23 (print the script), 25 (run it under torchrun, 2 CPU processes) and 27 (one process: bit-identical to
    ampcourse.train), as the chapter has them."""
    code = _cells("07_multi_gpu.ipynb", "NPROC = 2", "SEED, N_SAMPLES, BATCH = 0, 1024, 64", 'shipped.path("examples/ddp_amp.py")', "SCRIPT_ARGS = [",
                  "one = subprocess.run(")
    run = _run_outside(installed, code, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "bit-identical weights: True" in run.stdout and "def local_batch(step):" in run.stdout


def test_a_checkout_reads_its_own_files(monkeypatch):
    """In the repository, path() is the checkout's file (a learner's edit of examples/ddp_amp.py is what runs)."""
    from ampcourse import shipped

    assert shipped.checkout_root() == ROOT
    assert shipped.path("examples/ddp_amp.py") == ROOT / "examples" / "ddp_amp.py"
    with pytest.raises(ValueError, match="one of examples/ddp_amp.py"):
        shipped.path("setup.py")


def test_an_sdist_carries_what_the_wheel_ships():
    """A wheel built from an sdist (python -m build) would miss the files unless MANIFEST.in includes each one."""
    from ampcourse import shipped

    included = {line.split()[1] for line in (ROOT / "MANIFEST.in").read_text().splitlines()
                if line.startswith("include ")}
    assert included == set(shipped.SHIPPED)
