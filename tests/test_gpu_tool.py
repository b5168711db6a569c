"""`make gpu-test` (tools/gpu_test.py) without a GPU: the dry run, the report machinery, the marker split, the CI job."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_test  # noqa: E402


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
    assert [s["name"] for s in report["steps"]] == ["notebooks", "gpu tests"]
    nb_cmd, gpu_cmd = (s["command"] for s in report["steps"])
    assert "--nbval-lax" in nb_cmd and all(str(p.relative_to(ROOT)) in nb_cmd for p in (ROOT / "chapters").glob("*.ipynb"))
    assert "-m gpu tests/gpu" in gpu_cmd
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
    step = gpu_test.Step("sample", gpu_test.pytest_argv(str(tmp_path / "test_sample.py"), junit=tmp_path / "s.xml"),
                         tmp_path / "s.xml")
    result = gpu_test.run_step(step, timeout=120, workdir=tmp_path)
    assert result.returncode == 1 and result.counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert not result.ok and "--junitxml=s.xml" in result.command and result.command.startswith("python -m pytest")
    bad = next(t for t in result.tests if t["name"].endswith("test_bad"))
    assert "one is not two" in bad["message"]


def test_markdown_report_of_a_gpu_run():
    step = gpu_test.StepResult("gpu tests", "python -m pytest -m gpu tests/gpu", 0, 12.5,
                               [{"name": "tests.gpu.test_bench::test_bench_matmul", "outcome": "passed", "seconds": 3.0, "message": ""}])
    report = {"status": "passed", "command": "python tools/gpu_test.py", "commit": "abc", "started": "now",
              "machine": {"cuda_available": True, "device": "NVIDIA H200", "capability": "sm_90", "memory_gib": 139.8,
                          "gpus": 1, "torch": "2.11.0", "cuda": "12.8", "python": "3.11.9"},
              "budget_seconds": 480, "seconds": 12.5, "steps": [{**vars(step), "counts": step.counts, "ok": step.ok}],
              "bench": {"matmul_4096": {"what": "4096 matmul", "seconds_fp32": 0.006, "seconds_fp16": 0.002, "speedup_fp16": 3.0}}}
    md = gpu_test.markdown(report)
    assert "# GPU check: passed" in md and "NVIDIA H200 (sm_90" in md
    assert "| gpu tests | ok | 1 | 0 | 0 | 0 | 12.5 |" in md
    assert "| 4096 matmul | 6 | 2 | 3.00x |" in md  # only fp16 measured: one low-precision column


def test_make_test_deselects_gpu_tests_by_marker():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert any(a == "-m" and b == "not gpu" for a, b in zip(addopts, addopts[1:])), addopts


def test_gpu_test_selects_every_test_under_tests_gpu():
    """`-m gpu` (what make gpu-test passes) collects tests/gpu: every test there carries the marker."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "--collect-only",
                          "-q", "-m", "gpu", "tests/gpu"], capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    selected = [ln for ln in out.splitlines() if "::test_" in ln]
    assert len(selected) >= 5 and "deselected" not in out, out
    assert any("test_bench" in ln for ln in selected) and any("gradscaler" in ln.lower() for ln in selected)


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


def test_fraction_of_peak_on_cpu_rows():
    """The function the GPU benchmark uses, on real (CPU) matmul rows."""
    from ampcourse import bench

    rows = bench.matmul_tflops("cpu", dtypes=["fp32"], sizes=[64, 128], min_run_time=0.01, repeats=1)
    result = bench.fraction_of_peak(rows, "fp32", 64)
    assert result["peak_n"] == 128 and result["peak_sizes"] == [128]  # the peak is measured apart from n=64
    assert result["fraction_of_peak"] == pytest.approx(result["reference_tflops"] / result["peak_tflops"])
    assert result["datasheet_tflops"] is None
    with pytest.raises(ValueError, match="no fp32 row for n=4096; measured sizes: \\[64, 128\\]"):
        bench.fraction_of_peak(rows, "fp32", 4096)


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


# The torch range (pyproject's floor, torch-tested, the matrix workflow, .ci/run): tests/test_environments.py.


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
    step = gpu_test.Step("probe", gpu_test.pytest_argv(str(probe), junit=tmp_path / "p.xml"), tmp_path / "p.xml")
    result = gpu_test.run_step(step, timeout=120, workdir=tmp_path)
    assert result.ok, result.tests


def test_the_report_names_no_machine_path_for_the_out_folder():
    assert gpu_test.shown_args(["--require-cuda", "--out", "/tmp/xyz/out"]) == ["--require-cuda", "--out", "<dir>"]
    assert gpu_test.shown_args(["--out=/tmp/out"]) == ["--out=<dir>"]
    inside = str(ROOT / "benchmarks" / "gpu")
    assert gpu_test.shown_args(["--out", inside]) == ["--out", inside] and gpu_test.shown_args(["--out", "rel"]) == ["--out", "rel"]
