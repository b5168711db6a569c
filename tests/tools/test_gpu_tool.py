"""`make gpu-test` (tools/gpu_test.py) without a GPU: the dry run, the report machinery, the marker split, the CI job."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import gpu_test  # tools/ (tests/conftest.py puts it on sys.path)

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """tools/gpu_test.py with CUDA hidden, so this is a dry run on a GPU machine too."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(ROOT / "tools/gpu_test.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_dry_run_without_cuda_says_what_it_skips_and_exits_0(tmp_path):
    run = run_tool("--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "dry run: no CUDA device" in run.stdout and "Skipping the GPU parts" in run.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "dry-run" and not report["machine"]["cuda_available"]
    names = [s["name"] for s in report["steps"]]
    chapters = [f"notebook {Path(nb).stem}" for nb in gpu_test.ordered_notebooks()]
    assert names == ["smoke", "gpu tests", *chapters, "benchmarks"]
    assert chapters[:4] == ["notebook 04_amp_training_loop", "notebook 07_multi_gpu", "notebook 09_below_16_bits",
                            "notebook 01_precision_basics"], "the riskiest first"
    commands = {s["name"]: s["command"] for s in report["steps"]}
    assert "-m gpu" in commands["gpu tests"] and "tests/gpu" in commands["gpu tests"] and "--smoke" in commands["smoke"]
    for p in (ROOT / "chapters").glob("*.ipynb"):  # one pytest run (one JUnit file) per chapter
        cmd = commands[f"notebook {p.stem}"]
        assert "--nbval-lax" in cmd and str(p.relative_to(ROOT)) in cmd and f"--junitxml=nb-{p.stem}.xml" in cmd
    assert "ampcourse.bench --device cuda" in commands["benchmarks"]
    assert str(tmp_path) not in json.dumps(report), "the report names no machine path"
    assert "Dry run" in (tmp_path / "report.md").read_text()


NO_CUDA = {"python": "3.11", "torch": "2.13.0+cpu", "cuda": None, "cuda_available": False, "gpus": 0}


def test_dry_run_writes_no_report_unless_asked(monkeypatch, capsys):
    """A laptop's dry run must not overwrite a GPU report in benchmarks/gpu/."""
    monkeypatch.setattr(gpu_test, "cuda_info", lambda: NO_CUDA)
    assert gpu_test.main([]) == 0
    assert "wrote" not in capsys.readouterr().out


def test_the_gpu_ci_job_fails_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(gpu_test, "cuda_info", lambda: NO_CUDA)
    assert gpu_test.main(["--require-cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_a_step_reports_each_test_from_junit(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "def test_later(): pytest.skip('not here')\n")
    step = gpu_test.Step("gpu tests", gpu_test.pytest_argv(str(tmp_path / "test_sample.py"), junit=tmp_path / "s.xml"),
                         120, "s.xml")
    result = gpu_test.run_step(step, 120, tmp_path)
    assert result.returncode == 1 and result.counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert not result.ok and "--junitxml=s.xml" in result.command and result.command.startswith("python -m pytest")
    assert "one is not two" in (tmp_path / "gpu-tests.log").read_text()  # the output is evidence too
    bad = next(t for t in result.tests if t["name"].endswith("test_bad"))
    assert "one is not two" in bad["message"]


def test_markdown_report_of_a_gpu_run():
    step = gpu_test.StepResult("gpu tests", "python -m pytest -m gpu tests/gpu", 0, 12.5, 170,
                               [{"name": "tests.gpu.test_bench::test_bench_matmul", "outcome": "passed", "seconds": 3.0, "message": ""}])
    report = {"status": "passed", "command": "python tools/gpu_test.py", "commit": "abc", "started": "now",
              "machine": {"cuda_available": True, "device": "NVIDIA H200", "capability": "sm_90", "memory_gib": 139.8,
                          "gpus": 1, "torch": "2.11.0", "cuda": "12.8", "python": "3.11.9"},
              "budget_seconds": 480, "seconds": 12.5, "steps": [step.to_json()],
              "bench": {"matmul_4096": {"what": "4096 matmul", "seconds_fp32": 0.006, "seconds_fp16": 0.002, "speedup_fp16": 3.0}}}
    md = gpu_test.markdown(report)
    assert "# GPU check: passed" in md and "NVIDIA H200 (sm_90" in md
    assert "| gpu tests | ok | 1 | 0 | 0 | 0 | 12.5 | 170 |" in md
    assert "| 4096 matmul | 6 | 2 | 3.00x |" in md  # only fp16 measured: one low-precision column


def test_make_test_deselects_gpu_tests_by_marker():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert any(a == "-m" and b == "not gpu" for a, b in zip(addopts, addopts[1:])), addopts


def test_gpu_workflow_runs_make_gpu_test_on_a_self_hosted_gpu_runner():
    text = (ROOT / ".github/workflows/gpu.yml").read_text()
    job = yaml.safe_load(text)["jobs"]["gpu-test"]
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]
    assert "--labels gpu" in text, "the comment must say how to give the runner its gpu label"
    runs = [s.get("run", "") for s in job["steps"]]
    assert any(r.startswith("make gpu-test") and "--require-cuda" in r for r in runs)
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"].rstrip("/") == "benchmarks/gpu" and upload["if"] == "always()"


@pytest.mark.parametrize("path", sorted((ROOT / "tests/gpu").glob("test_*.py")), ids=lambda p: p.name)
def test_gpu_test_files_declare_the_marker(path):
    assert "pytestmark = pytest.mark.gpu" in path.read_text()


GPU_BENCH = {
    "transformer_large_train_step": {"what": "TinyTransformer size=large", "seconds_fp32": 0.09, "seconds_bf16": 0.025,
                                     "speedup_bf16": 3.6, "seconds_fp16": 0.02, "speedup_fp16": 4.5},
    "bf16_matmul_peak": {"what": "bf16", "dtype": "bf16", "tflops_by_n": {4096: 600.0, 8192: 700.0}, "peak_n": 8192,
                         "peak_sizes": [8192], "peak_tflops": 700.0, "reference_n": 4096, "reference_tflops": 600.0,
                         "fraction_of_peak": 600 / 700, "datasheet_tflops": 989.0, "peak_fraction_of_datasheet": 700 / 989},
    "trainer_overhead": {"overhead": 0.012},
    "host_syncs_per_step": {"fp16_fused": 1.0, "fp16_plain": 2.0},
    "torchrun_ddp_1gpu": {"what": "torchrun --nproc-per-node 1 -m ampcourse.train --strategy ddp", "backend": "nccl",
                          "precision": "bf16", "steps_done": 20, "final_loss": 1.234},
}


def test_the_gpu_goals_are_read_from_the_benchmark():
    step16 = next(g for g in gpu_test.goals(GPU_BENCH) if "fp16 AMP" in g["name"])
    assert step16["value"] == 4.5 and step16["met"] and step16["goal"] == ">= 3x"
    peak = next(g for g in gpu_test.goals(GPU_BENCH) if g["name"].startswith("bf16 matmul"))
    assert peak["value"] == pytest.approx(0.857, abs=1e-3) and peak["met"] and "n=4096" in peak["name"]
    fp16_peak = next(g for g in gpu_test.goals(GPU_BENCH) if g["name"].startswith("fp16 matmul"))
    assert fp16_peak["value"] is None and fp16_peak["met"] is None  # not measured: said so, not failed
    over = next(g for g in gpu_test.goals(GPU_BENCH) if "bare AMP loop" in g["name"])
    assert over["shown"] == "+1.2%" and over["met"]
    syncs = next(g for g in gpu_test.goals(GPU_BENCH) if "host syncs" in g["name"])
    assert syncs["value"] == 1.0 and syncs["met"]
    slow = gpu_test.goals({**GPU_BENCH, "transformer_large_train_step": {**GPU_BENCH["transformer_large_train_step"],
                                                                        "speedup_fp16": 2.0}})
    assert next(g for g in slow if "fp16 AMP" in g["name"])["met"] is False
    missing = gpu_test.goals({})
    assert all(g["value"] is None and g["met"] is None for g in missing) and len(missing) == 6


def test_markdown_shows_the_goals_and_the_peak_sweep():
    report = {"status": "passed", "command": "python tools/gpu_test.py", "commit": "abc", "started": "now",
              "machine": {"cuda_available": True, "device": "NVIDIA H200", "capability": "sm_90", "memory_gib": 139.8,
                          "gpus": 1, "torch": "2.11.0", "cuda": "12.8", "python": "3.11.9"},
              "budget_seconds": 480, "seconds": 12.5, "steps": [], "bench": GPU_BENCH, "goals": gpu_test.goals(GPU_BENCH)}
    md = gpu_test.markdown(report)
    assert "| transformer (size=large) train step, fp16 AMP vs fp32 (TF32 off): speedup | 4.50x | >= 3x | yes |" in md
    assert "| 86% | >= 85% | yes |" in md and "| 8192 | 700.0 |" in md
    assert "| TinyTransformer size=large | 90 | 25 | 3.60x | 20 | 4.50x |" in md  # the peak sweep is not a pair
    assert "Datasheet dense bf16 for this GPU: 989 TFLOP/s; the measured peak is 71% of it" in md
    assert "- fp16_fused: 1" in md and "| nccl | bf16 | 20 | 1.234 |" in md


def _make_n(*args: str) -> subprocess.CompletedProcess:
    """`make -n ARGS` as a shell would run it, also when pytest itself runs under make (`make test`), whose
    MAKEFLAGS/MAKELEVEL would otherwise turn on "Entering directory" lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def _make_dry(*targets: str) -> list[str]:
    """The command lines `make -n` would run for these targets (nothing runs)."""
    out = _make_n(*targets)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if "pytest" in line or "nbtool.py" in line or "gpu_test.py" in line]


@pytest.mark.parametrize("target", ["test", "unit", "notebooks"])
def test_the_cpu_suite_hides_cuda_on_any_machine(target):
    """On a GPU machine `make test` must still be the CPU suite (pick() would otherwise choose CUDA)."""
    lines = _make_dry(target)
    assert lines and all(" CUDA_VISIBLE_DEVICES= " in f" {line}" for line in lines)


def test_make_gpu_test_leaves_the_gpus_visible():
    (line,) = _make_dry("gpu-test")
    assert "CUDA_VISIBLE_DEVICES" not in line and "tools/gpu_test.py" in line


# The torch range (pyproject's floor, torch-tested, the matrix workflow, .ci/run): tests/course/test_environments.py.


def test_the_cpu_workflow_runs_the_readme_test_command_with_chromium():
    flow = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    assert set(flow[True]) == {"push", "pull_request"}  # YAML reads the key `on` as True
    job = flow["jobs"]["test"]
    assert job["runs-on"] == "ubuntu-latest" and job["container"].startswith("python:3.11")
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "apt-get install" in runs and "chromium" in runs
    assert "make test" in runs and "make test" in (ROOT / "README.md").read_text()


def test_gpu_test_can_use_a_preinstalled_python_without_building_the_venv():
    """On a GPU machine without network (torch preinstalled), GPU_PYTHON skips `setup` and runs that Python."""
    out = _make_n("gpu-test", "GPU_PYTHON=python3", "VENV=/nonexistent-venv")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "python3 tools/gpu_test.py", out.stdout  # no venv, no pip


def test_gpu_test_puts_the_repository_on_every_steps_path(tmp_path, monkeypatch):
    """Notebook kernels (cwd chapters/) and torchrun workers import ampcourse without an install."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\ndef test_path():\n    assert os.environ['PYTHONPATH'].split(os.pathsep)[0] == "
                     f"{str(ROOT)!r}\n")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    step = gpu_test.Step("gpu tests", gpu_test.pytest_argv(str(probe), junit=tmp_path / "p.xml"), 120, "p.xml")
    result = gpu_test.run_step(step, 120, tmp_path)
    assert result.ok, result.tests


def test_the_report_names_no_machine_path_for_the_out_folder():
    assert gpu_test.shown_args(["--require-cuda", "--out", "/tmp/xyz/out"]) == ["--require-cuda", "--out", "<dir>"]
    assert gpu_test.shown_args(["--out=/tmp/out"]) == ["--out=<dir>"]
    assert gpu_test.shown_args(["--archive", "/x/OUT/e.tar.gz"]) == ["--archive", "<dir>"]
    inside = str(ROOT / "benchmarks" / "gpu")
    assert gpu_test.shown_args(["--out", inside]) == ["--out", inside] and gpu_test.shown_args(["--out", "rel"]) == ["--out", "rel"]


# --- the run itself, end to end, with stub steps (issue 19, part 2, items 2, 3 and 7) -------------------------

STUB_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_x" name="test_fast" time="0.5"/>
<testcase classname="tests.gpu.test_x" name="test_bf16_peak" time="0.0">
<skipped message="no bf16 tensor cores on this GPU (compute capability &lt; 8.0)"/></testcase>
</testsuite></testsuites>"""


def _stub_plan(tmp_path: Path) -> Path:
    """Three stub steps: a smoke that writes smoke.json, a 'pytest' step (JUnit with a capability skip),
    and one that starts a worker in a session of its own (as torchrun does) and then hangs past its budget."""
    py = sys.executable
    smoke = ("import json, sys; json.dump({'machine': {'python': '3.12', 'torch': '2.11.0', 'cuda': '12.8', "
             "'cuda_available': True, 'gpus': 1, 'device': 'NVIDIA H200', 'capability': 'sm_90', 'memory_gib': 139.8}, "
             "'fp8_cast_cpu': {'float8_e4m3fn': [448.0]}}, open(sys.argv[1], 'w'))")
    tests = ("import json, os, sys; open(sys.argv[1], 'w').write(os.environ['STUB_JUNIT']); "
             "json.dump({'host_syncs_per_step': {'fp16_fused': 1.0}}, open(sys.argv[2], 'w'))")
    hang = ("import subprocess, sys, time; "
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            "open(sys.argv[1], 'w').write(str(w.pid)); print('worker started', flush=True); time.sleep(120)")
    steps = [
        {"name": "smoke", "argv": [py, "-c", smoke, str(tmp_path / "out" / "smoke.json")], "budget_s": 30},
        {"name": "gpu tests", "argv": [py, "-c", tests, str(tmp_path / "out" / "gpu-tests.xml"),
                                       str(tmp_path / "out" / "bench-tests.json")],
         "budget_s": 30, "junit": "gpu-tests.xml", "env": {"STUB_JUNIT": STUB_JUNIT}},
        {"name": "benchmarks", "argv": [py, "-c", hang, str(tmp_path / "worker.pid")], "budget_s": 60},
        {"name": "never reached", "argv": [py, "-c", "pass"], "budget_s": 1},  # the whole run's budget is spent
    ]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(steps))
    return path


def _alive(pid: int) -> bool:
    """Whether pid is a running (not zombie) process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_run_needs_only_the_standard_library_and_kills_a_step_at_its_budget(tmp_path):
    """`python -I -S`: no site-packages, no PYTHONPATH, no repository on the path (the GPU image's situation,
    where importing ampcourse in the parent lost the whole report). The steps still run and the report is built."""
    plan = _stub_plan(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--plan", str(plan),
                          "--out", str(out), "--budget", "12"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr  # a step was cut at its budget: failed, but reported
    assert "Traceback" not in run.stderr, run.stderr
    report = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["smoke", "gpu tests", "benchmarks"]
    assert steps["smoke"]["ok"] and steps["gpu tests"]["ok"], "a capability skip is listed, not a failure"
    assert steps["benchmarks"]["returncode"] is None and not steps["benchmarks"]["ok"]
    cut = steps["benchmarks"]
    # its budget is what the run had left (at most 12 s, not its own 60 s; rounded to 0.1 s, so 12.0 when the two
    # stub steps before it took under 50 ms), and it ran that long: SIGINT a grace period before the end, and ended
    grace = min(gpu_test.CUT_GRACE_S, cut["budget_s"] / 5)
    assert cut["budget_s"] <= 12 and cut["budget_s"] - grace - 0.5 <= cut["seconds"] <= cut["budget_s"] + 1, cut
    assert report["machine"]["device"] == "NVIDIA H200" and report["status"] == "failed"
    worker = int((tmp_path / "worker.pid").read_text())
    assert not _alive(worker), "a worker in its own session (torchrun's) must die with its step"
    assert f"stopped at its {cut['budget_s']:.0f} s budget" in (out / "benchmarks.log").read_text()
    md = (out / "report.md").read_text()
    assert "| benchmarks | stopped at its budget |" in md
    assert "## Skipped (listed, not failures)" in md and "(hardware capability)" in md
    assert "| host syncs per fp16 train_step with fused AdamW | 1 | 1 | yes |" in md
    saved = json.loads((out / "steps.json").read_text())
    assert saved["planned"][-1] == "never reached" and [s["name"] for s in saved["steps"]] == list(steps)
    assert report["not_run"] == ["never reached"]


def test_the_report_is_rebuilt_from_the_evidence_on_a_cpu(tmp_path):
    """`--report-from DIR --out D`: the evidence of a device run (its $OUT) becomes D's report, stdlib only."""
    plan = _stub_plan(tmp_path)
    first = tmp_path / "out"
    subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--plan", str(plan), "--out",
                    str(first), "--budget", "12"], capture_output=True, text=True, timeout=120)
    (first / "report.json").unlink()
    (first / "report.md").unlink()
    dest = tmp_path / "committed"
    run = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--report-from", str(first),
                          "--out", str(dest)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "gpu-test: failed" in run.stdout, run.stderr
    report = json.loads((dest / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["smoke", "gpu tests", "benchmarks"]
    assert report["not_run"] == ["never reached"] and "Not run (the run ended before them): never reached" in (
        dest / "report.md").read_text()
    assert (dest / "gpu-tests.xml").exists() and (dest / "smoke.json").exists()  # the evidence travels with it
    (tmp_path / "nothing").mkdir()
    empty = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--report-from",
                            str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "holds no steps.json" in empty.stderr


def test_the_plan_runs_the_most_evidence_first_within_eight_minutes(tmp_path):
    steps = gpu_test.plan(tmp_path)
    assert [s.name.split(" ")[0] for s in steps] == ["smoke", "gpu", *["notebook"] * len(gpu_test.notebooks()),
                                                      "benchmarks"]
    assert gpu_test.BUDGET_S <= 8 * 60
    chapters = [s for s in steps if s.name.startswith("notebook ")]
    assert [Path(s.argv[-1]).name[:2] for s in chapters[:4]] == ["04", "07", "09", "01"]
    assert sorted(s.argv[-1] for s in chapters) == gpu_test.notebooks(), "each chapter once, in a step of its own"
    for nb_step in chapters:
        assert nb_step.env == {"AMPCOURSE_CHECKERS_RAISE": "1"} and "--nbval-lax" in nb_step.argv
        assert nb_step.junit == f"nb-{Path(nb_step.argv[-1]).stem}.xml" and f"--junitxml={tmp_path / nb_step.junit}" in nb_step.argv
    assert steps[1].env["AMPCOURSE_GPU_OUT"] == str(tmp_path)  # tests/gpu write their evidence into $OUT
    assert steps[-1].reserve_s == gpu_test.BENCH_MIN_S > 0 and steps[-1].budget_s == gpu_test.BUDGET_S


def test_step_budgets_come_from_measured_times_and_each_limit_sits_below_its_step():
    """Issue 29 item 4: one budget per chapter from its measured time; a cell's or a test's own limit ends it (as a
    recorded failure) before its step is cut; at the measured times the whole plan fits with the benchmarks' minimum."""
    steps = gpu_test.plan(Path("/tmp/x"))
    measured = gpu_test.NOTEBOOK_CPU_S
    assert set(measured) == {Path(nb).name[:2] for nb in gpu_test.notebooks()}, "every chapter has a measured time"
    for s in steps:
        if s.name.startswith("notebook "):
            cpu = measured[Path(s.argv[-1]).name[:2]]
            assert s.budget_s == max(gpu_test.NOTEBOOK_MIN_S, round(gpu_test.NOTEBOOK_START_S + gpu_test.NOTEBOOK_FACTOR * cpu))
            (limit,) = [int(a.split("=")[1]) for a in s.argv if a.startswith("--nbval-cell-timeout=")]
            # room for a first cell that imports torch and starts CUDA; below the cut (SIGINT a grace before the end)
            assert 15 <= limit < s.budget_s - gpu_test.CUT_GRACE_S, (s.name, limit, s.budget_s)
    gpu = steps[1]
    assert f"--timeout={gpu_test.GPU_TEST_TIMEOUT_S}" in gpu.argv
    assert gpu_test.GPU_TEST_TIMEOUT_S < gpu.budget_s - gpu_test.CUT_GRACE_S
    at_measured = (steps[0].budget_s + gpu.budget_s + gpu_test.BENCH_MIN_S
                   + sum(gpu_test.NOTEBOOK_START_S + t for t in measured.values()))
    assert at_measured <= gpu_test.BUDGET_S, at_measured
    # subprocesses in tests/gpu: each limit below its test's (GPU_TEST_TIMEOUT_S, or its own timeout mark), and every
    # mark below the step's budget less the grace period, so a hung child fails one test, not the whole step
    import re
    for path in (ROOT / "tests/gpu").glob("test_*.py"):
        for test in path.read_text().split("\n\n\n"):
            marks = [int(n) for n in re.findall(r"@pytest\.mark\.timeout\((\d+)\)", test)]
            limit = marks[0] if marks else gpu_test.GPU_TEST_TIMEOUT_S
            assert limit < gpu.budget_s - gpu_test.CUT_GRACE_S, (path.name, limit)
            assert all(int(n) < limit for n in re.findall(r"timeout=(\d+)", test)), (path.name, test[:200])
    no_timeout = gpu_test.plan(Path("/tmp/x"), timeouts=False)[1]  # an image without pytest-timeout
    assert not any(a.startswith("--timeout") for a in no_timeout.argv)


def test_the_benchmarks_minimum_is_kept_when_earlier_steps_run_long(tmp_path):
    """The payoff is never what gets cut: a slow step before the benchmarks is cut to leave their minimum."""
    py = sys.executable
    steps = [{"name": "notebook slow", "argv": [py, "-c", "import time; time.sleep(60)"], "budget_s": 60},
             {"name": "notebook skipped", "argv": [py, "-c", "pass"], "budget_s": 30},
             {"name": "benchmarks", "argv": [py, "-c", "print('bench ran')"], "budget_s": 60, "reserve_s": 6}]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(steps))
    run = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--plan", str(plan), "--out",
                          str(tmp_path / "out"), "--budget", "14"], capture_output=True, text=True, timeout=120)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    got = {s["name"]: s for s in report["steps"]}
    assert got["notebook slow"]["returncode"] is None and got["notebook slow"]["budget_s"] <= 8, run.stdout
    assert "notebook skipped" not in got and report["not_run"] == ["notebook skipped"]
    assert got["benchmarks"]["returncode"] == 0 and "bench ran" in (tmp_path / "out" / "benchmarks.log").read_text()


def test_a_step_passes_with_capability_skips_and_fails_when_nothing_ran():
    skip = {"name": "t::test_bf16_peak", "outcome": "skipped", "seconds": 0,
            "message": "no bf16 tensor cores on this GPU (compute capability < 8.0)"}
    good = {"name": "t::test_fp16", "outcome": "passed", "seconds": 1, "message": ""}
    t4 = gpu_test.StepResult("gpu tests", "pytest", 0, 10.0, 170, [good, skip])
    assert t4.ok and t4.skips == [{**skip, "capability": True}]
    assert not gpu_test.StepResult("gpu tests", "pytest", 0, 1.0, 170, [skip]).ok  # nothing passed
    assert not gpu_test.StepResult("gpu tests", "pytest", 5, 1.0, 170, []).ok  # pytest collected nothing
    assert not gpu_test.StepResult("gpu tests", "pytest", None, 170.0, 170, [good]).ok  # cut at its budget
    assert gpu_test.StepResult("smoke", "python", 0, 3.0, 30, []).ok  # not a pytest step: its exit code decides


def test_the_gpu_job_keeps_its_venv_outside_the_cleaned_checkout():
    """Issue 19 item 15: actions/checkout runs `git clean -ffdx`, deleting an ignored .venv in the workspace, so CUDA
    torch was downloaded again on every job. The venv lives beside the workspace and make is told where."""
    job = yaml.safe_load((ROOT / ".github/workflows/gpu.yml").read_text())["jobs"]["gpu-test"]
    venv = job["env"]["VENV"]
    assert venv.startswith("${{ github.workspace }}/../"), venv
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout"))
    assert checkout.get("with", {}).get("clean", True), "the checkout stays clean; the venv is what moved"
    run = next(s["run"] for s in job["steps"] if s.get("run", "").startswith("make gpu-test"))
    assert 'VENV="$VENV"' in run
    out = _make_n("gpu-test", "VENV=/somewhere/else")
    assert out.returncode == 0 and "/somewhere/else/bin/python tools/gpu_test.py" in out.stdout, out.stdout


def _wheels(tmp_path: Path, torch_minor: str | None) -> tuple[subprocess.CompletedProcess, str]:
    """tools/gpu_wheels.sh with a stub `python3` that records its pip arguments instead of downloading."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    # `python3 -m pip ...` is recorded; any other python3 call (the script reads pyproject.toml) runs for real
    (stub / "python3").write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then echo "$@" > {tmp_path}/pip-args; '
                                  f'else exec {sys.executable} "$@"; fi\n')
    (stub / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GPU_WHEELS_TORCH"}
    env["PATH"] = f"{stub}{os.pathsep}{env['PATH']}"
    if torch_minor:
        env["GPU_WHEELS_TORCH"] = torch_minor
    run = subprocess.run(["bash", str(ROOT / "tools/gpu_wheels.sh"), str(tmp_path / "whl")], env=env,
                         capture_output=True, text=True, timeout=60)
    args = (tmp_path / "pip-args").read_text() if (tmp_path / "pip-args").exists() else ""
    return run, args


def test_the_wheels_bring_the_torchao_built_for_the_images_torch(tmp_path):
    """Issue 19 item 6: torchao 0.18.0 (the lock's) for the torch 2.11 image; the pin follows the image's torch."""
    run, args = _wheels(tmp_path, None)
    assert run.returncode == 0, run.stderr
    assert "torchao==0.17.0" in args.split() and "torch 2.11 image -> torchao 0.17.0" in run.stdout
    lock = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line)
    assert f"nbval=={lock['nbval']}" in args.split() and "--python-version 3.12" in args
    run, args = _wheels(tmp_path, "2.13")
    assert run.returncode == 0 and f"torchao=={lock['torchao']}" in args.split()
    assert "pytest-timeout==" + lock["pytest-timeout"] in args.split()  # gpu_test.py's --timeout needs the plugin
    run, _ = _wheels(tmp_path, "2.9")
    assert run.returncode == 2 and "no torchao pin for torch 2.9" in run.stderr


def test_the_torchao_table_has_one_home():
    """Issue 29 item 6: pyproject's torchao-for-torch is the table; gpu_wheels.sh reads it for every torch there."""
    import re
    import tempfile
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ampcourse"]["torchao-for-torch"]
    script = (ROOT / "tools/gpu_wheels.sh").read_text()
    assert "torchao-for-torch" in script and not re.search(r"0\.1[0-9]\.\d", script), "no second table in the script"
    for torch_version, ao in table.items():
        with tempfile.TemporaryDirectory() as d:
            run, args = _wheels(Path(d), ".".join(torch_version.split(".")[:2]))
            assert run.returncode == 0 and f"torchao=={ao}" in args.split(), (torch_version, run.stderr)


def test_a_device_run_brings_back_one_archive_and_the_report(tmp_path):
    """A device session returns at most 8 files from $OUT: the evidence travels as one .tar.gz (refreshed after every
    step, so a cut run still has the steps before the cut) with report.json/md beside it; a CPU rebuilds from it."""
    import tarfile

    plan = _stub_plan(tmp_path)
    archive = tmp_path / "OUT" / "gpu-evidence.tar.gz"
    subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--plan", str(plan), "--out",
                    str(tmp_path / "out"), "--budget", "12", "--archive", str(archive)],
                   capture_output=True, text=True, timeout=120)
    assert sorted(p.name for p in archive.parent.iterdir()) == ["gpu-evidence.tar.gz", "report.json", "report.md"]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"steps.json", "smoke.json", "gpu-tests.xml", "bench-tests.json", "benchmarks.log"} <= names
    dest = tmp_path / "committed"
    run = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--report-from", str(archive),
                          "--out", str(dest)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and (dest / "report.md").read_text() == (archive.parent / "report.md").read_text()
    assert (dest / "steps.json").exists()


def test_make_gpu_test_installs_carried_wheels_first():
    out = _make_n("gpu-test", "GPU_PYTHON=python3", "GPU_WHEELS=.whl", "GPU_TEST_ARGS=--require-cuda")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ('python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target '
                                  '"/tmp/ampcourse-gpu-site" ".whl"/*.whl && PYTHONPATH="/tmp/ampcourse-gpu-site'
                                  '${PYTHONPATH:+:$PYTHONPATH}" python3 tools/gpu_test.py --require-cuda'), out.stdout


# --- issue 29 items 2, 3 and 5: evidence that survives a cut, a subset rerun, no make -----------------------------

def test_a_step_cut_at_its_budget_keeps_its_passed_tests(tmp_path):
    """SIGINT first: pytest writes its JUnit file and summary for the tests done before the cut (with SIGTERM first,
    a cut step with 2 passed tests reported none), and its log says so as it went (PYTHONUNBUFFERED)."""
    (tmp_path / "test_cut.py").write_text(
        "import os, time\n"
        "def test_one(): print('unbuffered', os.environ.get('PYTHONUNBUFFERED'))\n"
        "def test_two(): pass\n"
        "def test_hangs(): time.sleep(120)\n")
    step = gpu_test.Step("gpu tests", gpu_test.pytest_argv("-s", str(tmp_path / "test_cut.py"), junit=tmp_path / "c.xml"),
                         20, "c.xml")
    t0 = __import__("time").monotonic()
    result = gpu_test.run_step(step, 12, tmp_path)
    took = __import__("time").monotonic() - t0
    assert result.returncode is None and not result.ok and took < 12 + 3, (result, took)
    assert {t["name"].split("::")[-1]: t["outcome"] for t in result.tests if t["outcome"] == "passed"} == {
        "test_one": "passed", "test_two": "passed"}, result.tests
    log = (tmp_path / "gpu-tests.log").read_text()
    assert "unbuffered 1" in log and "2 passed" in log and "stopped at its 12 s budget" in log, log


def test_a_stuck_step_that_ignores_sigint_is_still_killed(tmp_path):
    hang = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ignoring', flush=True); time.sleep(120)"
    step = gpu_test.Step("benchmarks", [sys.executable, "-c", hang], 10)
    t0 = __import__("time").monotonic()
    result = gpu_test.run_step(step, 10, tmp_path)
    assert result.returncode is None and __import__("time").monotonic() - t0 < 10 + 7


def test_a_subset_rerun_for_a_second_try(tmp_path):
    """Issue 29 item 2: `--only` runs the smoke step and what it names: a chapter, a tests/gpu file or id, a step."""
    steps = gpu_test.plan(tmp_path)
    one = gpu_test.select(steps, ["chapters/04_amp_training_loop.ipynb"], tmp_path)
    assert [s.name for s in one] == ["smoke", "notebook 04_amp_training_loop"]
    assert [s.name for s in gpu_test.select(steps, ["07", "benchmarks"], tmp_path)] == [
        "smoke", "notebook 07_multi_gpu", "benchmarks"]
    tests = gpu_test.select(steps, ["tests/gpu/test_cuda_doctor.py", "tests/gpu/test_cuda_amp.py::test_pick_defaults_to_bf16_where_native_else_fp16_and_a_scaler"], tmp_path)
    assert [s.name.split(" (")[0] for s in tests] == ["smoke", "gpu tests"] and tests[1].junit == "gpu-tests.xml"
    assert "tests/gpu/test_cuda_doctor.py" in tests[1].argv and tests[1].argv[-1].endswith("a_scaler")
    with pytest.raises(ValueError, match="not a step"):
        gpu_test.select(steps, ["chapter 4"], tmp_path)
    run = run_tool("--only", "04", "--dry-run")
    assert run.returncode == 0 and run.stdout.count("would run") == 2 and "04_amp_training_loop" in run.stdout, run.stdout
    bad = run_tool("--only", "nonsense", "--dry-run")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a step" in bad.stderr, bad.stderr


def test_the_prepared_command_needs_no_make():
    """Issue 29 item 5: the device's command is `python3 tools/gpu_test.py ...` after a pip install of the wheels; the
    docstring, the Makefile's comment and the README say the same command."""
    doc = gpu_test.__doc__
    install = "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl"
    command = "PYTHONPATH=/tmp/site python3 tools/gpu_test.py --require-cuda --out /tmp/gpu-evidence --archive $OUT/gpu-evidence.tar.gz"
    assert install in doc and command in doc and "make" not in doc.split("The one prepared command")[1].split("\n\n")[1]
    assert "--only chapters/04_amp_training_loop.ipynb" in doc
    assert command.split(" --require-cuda")[0] in (ROOT / "README.md").read_text()


# --- issue 30 item 9: --report-from with bad evidence: one clean line each, nothing read outside ------------------

def _report_from(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", str(ROOT / "tools/gpu_test.py"), "--report-from", *args],
                          capture_output=True, text=True, timeout=60)


def _evidence(tmp_path: Path, steps: object = None, junit: str | None = "gpu-tests.xml", xml: str = STUB_JUNIT) -> Path:
    ev = tmp_path / "ev"
    ev.mkdir(parents=True, exist_ok=True)
    if junit == "gpu-tests.xml":
        (ev / junit).write_text(xml)
    step = {"name": "gpu tests", "command": "pytest", "returncode": 0, "seconds": 1.0, "budget_s": 10, "tests": [],
            "log": "gpu-tests.log", "junit": junit}
    (ev / "steps.json").write_text(json.dumps({"command": "x", "steps": [step]} if steps is None else steps))
    return ev


def _one_clean_line(run: subprocess.CompletedProcess, *words: str) -> None:
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("gpu-test: ") and all(w in run.stderr for w in words), run.stderr


@pytest.mark.parametrize("junit", ["/etc/secret.xml", "../outside.xml", "sub/../../outside.xml"])
def test_report_from_reads_no_junit_outside_the_evidence(tmp_path, junit):
    (tmp_path / "outside.xml").write_text(STUB_JUNIT.replace("test_fast", "test_from_elsewhere"))
    run = _report_from(str(_evidence(tmp_path, junit=junit)))
    _one_clean_line(run, "outside the evidence folder")
    assert not (tmp_path / "ev" / "report.json").exists()


def test_report_from_ignores_a_link_out_of_the_evidence(tmp_path):
    (tmp_path / "outside.xml").write_text(STUB_JUNIT)
    ev = _evidence(tmp_path, junit="linked.xml")
    (ev / "linked.xml").symlink_to(tmp_path / "outside.xml")
    (ev / "smoke.json").symlink_to(tmp_path / "outside.xml")
    _one_clean_line(_report_from(str(ev)), "outside the evidence folder")
    dest = tmp_path / "dest"
    ev2 = _evidence(tmp_path / "b")
    (ev2 / "extra.txt").symlink_to(tmp_path / "outside.xml")
    run = _report_from(str(ev2), "--out", str(dest))
    assert run.returncode == 0, run.stderr
    assert not (dest / "extra.txt").exists(), "a link is not copied as evidence"


def test_report_from_refuses_an_out_inside_the_evidence_and_an_out_that_is_a_file(tmp_path):
    ev = _evidence(tmp_path)
    _one_clean_line(_report_from(str(ev), "--out", str(ev / "copy")), "inside the evidence folder")
    assert not (ev / "copy").exists()
    assert _report_from(str(ev), "--out", str(ev)).returncode == 0  # the folder itself: the report beside the evidence
    (tmp_path / "afile").write_text("x")
    _one_clean_line(_report_from(str(ev), "--out", str(tmp_path / "afile")), "is a file")


@pytest.mark.parametrize("kind", ["text", "empty", "truncated", "zip", "gzip-not-tar"])
def test_report_from_a_malformed_archive_is_one_line(tmp_path, kind):
    import gzip
    import io
    import tarfile
    import zipfile
    archive = tmp_path / "evidence.tar.gz"
    if kind == "text":
        archive.write_text("not an archive\n")
    elif kind == "empty":
        archive.write_bytes(b"")
    elif kind == "truncated":
        ev = _evidence(tmp_path)
        (ev / "big.log").write_bytes(os.urandom(200_000))
        gpu_test.write_archive(ev, archive)
        archive.write_bytes(archive.read_bytes()[:5000])
    elif kind == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("steps.json", "{}")
        archive.write_bytes(buf.getvalue())
    else:
        archive.write_bytes(gzip.compress(b"just some text, no tar inside" * 50))
    _one_clean_line(_report_from(str(archive), "--out", str(tmp_path / "dest")), "not a .tar.gz of evidence")
    assert tarfile  # imported for the truncated case's writer


@pytest.mark.parametrize("steps", ["[1, 2]", "{\"steps\": 3}", "{\"steps\": [7]}", "{\"steps\": [{\"name\": 1}]}",
                                   "{\"steps\": [{\"name\": \"a\", \"command\": \"c\", \"returncode\": 0, \"seconds\": \"x\", \"budget_s\": 1}]}",
                                   "{\"planned\": 5, \"steps\": []}", "not json", "{}"])
def test_report_from_a_malformed_steps_json_is_one_line(tmp_path, steps):
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "steps.json").write_text(steps)
    _one_clean_line(_report_from(str(ev)), "steps.json")


def test_report_from_a_junit_time_that_is_not_a_number_is_one_line(tmp_path):
    ev = _evidence(tmp_path, xml=STUB_JUNIT.replace('time="0.5"', 'time="abc"'))
    _one_clean_line(_report_from(str(ev)), "gpu-tests.xml", "'abc'", "not a number")


def test_this_file_tests_a_stdlib_tool_so_the_torch_legs_skip_it():
    """tools/torch_leg.sh ignores this file (issue 29 item 12: a leg runs what depends on torch); so nothing here may
    import torch or ampcourse, and the leg must still ignore it."""
    import ast
    tree = ast.parse(Path(__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"torch", "ampcourse", "torchao"}, imported
    assert "--ignore tests/tools/test_gpu_tool.py" in (ROOT / "tools/torch_leg.sh").read_text()


def test_the_report_says_what_each_gpu_path_ran():
    """Issue 29 item 7: 'DDP/FSDP2 on NCCL' or 'torchao float8 on CUDA' reads as what ran: one process, two ranks,
    skipped on this GPU (and why), not run."""
    tests = [{"name": "tests.gpu.test_cuda_bench::test_torchrun_one_process_nccl[ddp]", "outcome": "passed", "seconds": 9, "message": ""},
             {"name": "tests.gpu.test_cuda_bench::test_torchrun_two_ranks_nccl[ddp]", "outcome": "skipped", "seconds": 0,
              "message": "needs 2 GPUs for 2 NCCL ranks (this machine: 1)"},
             {"name": "tests.gpu.test_cuda_lowbit::test_float8_training_on_float8_tensor_cores", "outcome": "failed", "seconds": 3, "message": "x"}]
    got = {c["claim"].split(" (")[0].split(",")[0]: c for c in gpu_test.coverage([{"tests": tests}])}
    assert got["DDP and FSDP2 under torchrun on NCCL"]["state"] == "passed"
    two = got["DDP and FSDP2 on NCCL with two ranks on two GPUs"]
    assert two["state"] == "skipped" and "needs 2 GPUs" in two["reason"]
    assert got["torchao float8 training with float8 matmuls"]["state"] == "failed"
    assert got["torchao MXFP8 training"]["state"] == "not run"
    names = {fragment for fragment, _ in gpu_test.COVERAGE}
    text = "".join(p.read_text() for p in (ROOT / "tests/gpu").glob("test_*.py"))
    assert all(f"def {n}(" in text for n in names), "every claim names a test that exists"
    report = {"status": "failed", "command": "c", "commit": "x", "started": "s", "machine": {}, "budget_seconds": 1,
              "seconds": 1, "steps": [], "coverage": gpu_test.coverage([{"tests": tests}])}
    md = gpu_test.markdown(report)
    assert "## What the GPU paths ran" in md and "| skipped: needs 2 GPUs for 2 NCCL ranks (this machine: 1) |" in md


def test_the_gpu_tests_run_quick_and_uncovered_first_and_every_file_is_listed():
    """A cut gpu tests step keeps what ran before it: the long doctor cost test comes last, and no file is left out."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/gpu").glob("test_*.py"))
    assert sorted(gpu_test.GPU_TEST_FILES) == files
    assert gpu_test.GPU_TEST_FILES[-1] == "tests/gpu/test_cuda_doctor.py"
    step = gpu_test.plan(Path("/tmp/x"))[1]
    assert step.name == "gpu tests" and step.argv[-len(files):] == list(gpu_test.GPU_TEST_FILES)
