"""The GPU cases a CPU can pretend to be (issue 19, part 2): one GPU and two, compute capability 7.5 / 8.0 / 8.9 /
9.0, fused optimizers, NCCL's teardown, checkers under `make gpu-test`. Each holds a GPU-path defect of a kind the
static read found, so the next one is caught here instead of on the first GPU run."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampcourse import bench, device
from ampcourse.exercises import _core, _torchrun

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = [((7, 5), "Tesla T4"), ((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 9), "NVIDIA L4"), ((9, 0), "NVIDIA H200")]


def fake_gpus(monkeypatch, count: int, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H200") -> None:
    """Pretend CUDA has `count` GPUs of this compute capability (no call reaches a driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


# --- device count 1 and 2: chapter 7's checkers (item 4) ------------------------------------------------------

def test_one_gpu_runs_the_rank_exercises_on_two_gloo_cpu_ranks(monkeypatch):
    """One NCCL rank would make 'inf on the last rank' and 'ranks identical' test nothing: two gloo ranks instead."""
    fake_gpus(monkeypatch, 1)
    assert _torchrun.default_nproc(None) == (2, "cpu")
    with pytest.raises(ValueError, match="needs two or more GPUs for two ranks, this node has 1"):
        _torchrun.default_nproc("cuda")


def test_two_gpus_run_one_nccl_rank_per_gpu(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert _torchrun.default_nproc(None) == (2, "cuda") and _torchrun.default_nproc("cpu") == (2, "cpu")


@pytest.mark.parametrize("gpus", [4, 8])
def test_a_big_node_still_checks_on_two_ranks(monkeypatch, gpus):
    """Issue 29 item 10: on an 8-GPU node the checkers started 8 NCCL ranks (twice for 7.6's restart) within their
    120 s limit; two ranks show a collective's effect. More only when asked, up to the GPUs there are."""
    fake_gpus(monkeypatch, gpus)
    assert _torchrun.default_nproc(None) == (2, "cuda") == _torchrun.default_nproc("cuda")
    launched = []
    from ampcourse import distributed
    monkeypatch.setattr(distributed, "launch", lambda args, **kw: launched.append(kw["nproc_per_node"]) or (_ for _ in ()).throw(RuntimeError("stop")))
    for nproc in (None, gpus):
        with pytest.raises(RuntimeError, match="stop"):
            _torchrun.run_on_ranks("7.3", "json:dumps", {"y": ("def f():\n    pass\n", "f")}, nproc=nproc)
    assert launched == [2, gpus]


def test_a_worker_waits_for_every_rank_before_it_destroys_the_group(monkeypatch, tmp_path):
    """Item 14: `_torchrun.main` writes its result, then barrier + destroy (NCCL must not lose a peer mid-collective);
    a barrier that fails (a peer gone) still leaves the written result and exit code 0."""
    from ampcourse import distributed

    calls = []
    env = distributed.torchrun_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    monkeypatch.setattr(distributed, "torchrun_env", lambda environ=None: env)
    monkeypatch.setattr(distributed, "init", lambda dev, env, timeout_s: calls.append(("init", timeout_s)) or "ctx")
    spec = {"runner": "json:dumps", "device": "cpu", "dist_timeout": 7.0, "params": {},
            "solutions": {"yours": {"source": "def f():\n    return 1\n", "function": "f"}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))

    def teardown(barrier=False):
        calls.append(("teardown", barrier, (tmp_path / "rank-0.pt").exists()))
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(distributed, "teardown", teardown)
    assert _torchrun.main([str(tmp_path / "spec.json")]) == 0
    assert calls == [("init", 7.0), ("teardown", True, True)]


# --- compute capability 7.5 / 8.0 / 8.9 / 9.0 -----------------------------------------------------------------

@pytest.mark.parametrize("capability,name", CAPABILITIES, ids=lambda v: str(v))
def test_what_each_capability_gets(monkeypatch, capability, name):
    """bf16 and tf32 only from sm_80; below, fp16 + GradScaler and no bf16 in the matmul table (a T4 is not 'failed')."""
    fake_gpus(monkeypatch, 1, capability, name)
    native = capability >= (8, 0)
    amp = device.pick()
    assert (amp.precision, amp.use_scaler, amp.native) == (("bf16", False, True) if native else ("fp16", True, True))
    assert bench.matmul_dtypes("cuda") == (("fp32", "tf32", "bf16", "fp16") if native else ("fp32", "fp16"))
    assert device.pick("cuda", "bf16").native == native


@pytest.mark.parametrize("capability,name", CAPABILITIES, ids=lambda v: str(v))
def test_the_benchmark_times_gpu_sized_models_on_cuda(monkeypatch, capability, name):
    """Item 9: tiny models are launch-bound on a GPU (speedup near 1x): `python -m ampcourse.bench --device cuda`
    times large ones there, and tiny ones on a CPU."""
    fake_gpus(monkeypatch, 1, capability, name)
    gpu = bench.run_config(torch.device("cuda", 0), "bf16" if capability >= (8, 0) else "fp16", quick=False, seed=0)
    cpu = bench.run_config(torch.device("cpu"), "bf16", quick=False, seed=0)
    assert gpu["step_size"] == "large" and gpu["batch"] >= 32 and max(gpu["matmul_sizes"]) >= 4096
    assert cpu["step_size"] == "tiny" and max(cpu["matmul_sizes"]) <= 512
    quick = bench.run_config(torch.device("cuda", 0), "fp16", quick=True, seed=0)
    assert quick["step_size"] == "large" and quick["models"] == ["transformer"]


def test_a_gpu_test_that_needs_bf16_says_compute_capability_when_it_skips():
    """The report lists capability skips apart from failures by their message (tools/gpu_test.CAPABILITY_SKIP)."""
    import gpu_test

    text = (ROOT / "tests/gpu/test_cuda_bench.py").read_text()
    skips = [line.split("pytest.skip(", 1)[1] for line in text.splitlines() if "pytest.skip(" in line]
    assert skips and all(gpu_test.CAPABILITY_SKIP.search(s) for s in skips), skips


# --- fused optimizers ------------------------------------------------------------------------------------------

def test_fused_adamw_with_a_gradscaler_skips_an_inf_step_inside_the_kernel():
    """On CUDA train() and the bare loop use fused AdamW, which takes the scaler's found_inf inside the kernel (no
    host sync). CPU fused AdamW runs the same path: an inf gradient leaves the weights alone and halves the scale."""
    lin = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = [p.detach().clone() for p in lin.parameters()]
    scaler.scale(lin(torch.full((1, 4), float("inf"))).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, lin.parameters())) and scaler.get_scale() == 2.0**7
    opt.zero_grad()
    scaler.scale(lin(torch.ones(1, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(b, p) for b, p in zip(before, lin.parameters()))


def test_fused_and_foreach_adamw_agree_on_a_cpu():
    """The smoke step of `make gpu-test` records whether they are bit-identical on the GPU; on a CPU they agree
    to rounding (so a chapter comparing loops must give both sides the same `fused=`)."""
    weights = {}
    for impl in ("fused", "foreach"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{impl: True})
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
        weights[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights["fused"], weights["foreach"], rtol=0, atol=1e-6)


# --- `make gpu-test`: checkers raise in a kernel (item 5) ------------------------------------------------------

def test_under_make_gpu_test_a_checker_raises_even_in_a_kernel(monkeypatch, capsys):
    """Lax nbval compares no outputs: a checker that rejects a chapter's own solution must fail the cell there."""

    @_core.checker
    def check_demo(x):
        """Exercise 0.0: demo."""
        if x != 1:
            _core.failed("Exercise 0.0", 1, x, "use 1")

    monkeypatch.setattr(_core, "_in_notebook", lambda: True)
    monkeypatch.delenv("AMPCOURSE_CHECKERS_RAISE", raising=False)
    assert check_demo(2) is None  # a learner's kernel: the verdict is printed, Run All goes on
    assert "not yet" in capsys.readouterr().out
    monkeypatch.setenv("AMPCOURSE_CHECKERS_RAISE", "1")
    with pytest.raises(_core.ExerciseError, match="use 1"):
        check_demo(2)
    check_demo(1)  # and the right answer still passes


# --- examples/ddp_amp.py on a GPU node (item 14) ---------------------------------------------------------------

def test_the_ddp_example_binds_nccl_to_its_gpu(monkeypatch):
    """Under torchrun on a GPU node the example passes device_id (its own GPU) to init_process_group."""
    import torch.distributed as dist

    fake_gpus(monkeypatch, 2)
    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, **kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", torch.device(d)))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(sys, "argv", ["ddp_amp.py", "--device", "cuda"])
    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Stop):
        runpy.run_path(str(ROOT / "examples/ddp_amp.py"), run_name="__main__")
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1) == seen["set_device"]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_the_ddp_example_refuses_more_processes_than_gpus(monkeypatch, capsys, local_rank):
    """torchrun --nproc-per-node 2 on a 1-GPU node: every rank exits 2 before set_device (which would fail with
    CUDA's 'invalid device ordinal'), and local rank 0 says why in one line."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"reached set_device({d})"))
    monkeypatch.setattr(sys, "argv", ["ddp_amp.py", "--device", "cuda"])
    for k, v in {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2",
                 "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "examples/ddp_amp.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2
    if local_rank == 0:
        assert err == ("ddp_amp.py: error: 2 processes on this node (torchrun --nproc-per-node) but 1 CUDA GPU(s); "
                       "use --nproc-per-node 1 or fewer, or --device cpu\n")
    else:
        assert err == ""


# --- the chapters' GPU-only branches, run on a CPU (issue 29 item 1) ---------------------------------------------

#: What a chapter's code tests to take its GPU branch (`SIZE = "small" if amp.device_type == "cuda" else "tiny"` was
#: chapter 4's; its asserts failed at that size, and no CPU run had ever taken it).
GPU_BRANCH = re.compile(r"""amp\.device_type\s*==\s*["']cuda["']""")


def gpu_branch_script(notebook: Path) -> tuple[str, int]:
    """A chapter's code cells as one script, every `amp.device_type == "cuda"` read as True; and how many were.

    Cells that only choose a timing workload (they call torch.utils.benchmark's Timer and assert nothing) keep the
    CPU branch: their GPU workload (8192 tokens through a 50k-row head) is a GPU's, and no claim depends on it."""
    cells, forced = [], 0
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if not ("Timer(" in src and "assert" not in src):
            src, n = GPU_BRANCH.subn("True", src)
            forced += n
        cells.append(src)
    return "\n\n".join(cells), forced


def run_gpu_branches(notebook: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run gpu_branch_script(notebook) in a fresh CPU-only process from chapters/ (as a kernel would)."""
    script, _ = gpu_branch_script(notebook)
    path = tmp_path / (notebook.stem + "_gpu_branches.py")
    path.write_text(script)
    env = dict(os.environ, MPLBACKEND="Agg", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, str(path)], cwd=ROOT / "chapters", env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chapter_4_holds_its_claims_with_its_gpu_branches_taken_on_a_cpu(tmp_path):
    """Every assert of chapter 4 holds with each `amp.device_type == "cuda"` branch taken (the sizes a GPU runs).
    Before, `SIZE = "small"` on CUDA failed cell 30 (accumulation within 1e-5) and cell 32 (a tenth of fp16's
    distance to fp32); now the chapter uses one size on every device."""
    run = run_gpu_branches(ROOT / "chapters/04_amp_training_loop.ipynb", tmp_path)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    assert "largest weight difference to one batch of 64 below 1e-5: True" in run.stdout
    assert "under a tenth of fp16's distance to fp32: True" in run.stdout


def test_the_gpu_branch_runner_takes_the_branches_it_says(tmp_path):
    """gpu_branch_script reads each GPU condition as True (the old chapter 4's size line becomes the GPU's size, which
    failed cells 30 and 32 when run so on a CPU) and leaves a timing-only cell alone."""
    nb = {"cells": [
        {"cell_type": "code", "source": ['SIZE = "small" if amp.device_type == "cuda" else "tiny"\n']},
        {"cell_type": "code", "source": ['on_gpu = amp.device_type == "cuda"\n', "t = Timer('x')\n"]},
        {"cell_type": "markdown", "source": ['amp.device_type == "cuda"']}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    script, forced = gpu_branch_script(path)
    assert forced == 1 and script.startswith('SIZE = "small" if True else "tiny"') and 'on_gpu = amp.device_type' in script


# --- tools/gpu_test.py's torch side (moved from tests/tools/test_gpu_tool.py, which checks a stdlib tool and runs on the
# lock's torch only; these run on every torch leg: the GPU image has torch 2.11) -------------------------------------

def _gpu_test():
    """tools/gpu_test.py as a module (tests/conftest.py puts tools/ on sys.path)."""
    import gpu_test
    return gpu_test


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


def test_the_goals_come_from_ampcourse_bench_without_importing_it():
    from ampcourse import bench

    targets = _gpu_test().bench_targets()
    assert targets == {"BF16_PEAK_TARGET": bench.BF16_PEAK_TARGET, "GPU_STEP_SPEEDUP_TARGET": bench.GPU_STEP_SPEEDUP_TARGET,
                       "TRAINER_OVERHEAD_TARGET": bench.TRAINER_OVERHEAD_TARGET}


def test_the_smoke_step_records_each_probe_on_a_cpu_too(tmp_path):
    """Without CUDA the smoke step exits 1 (the run becomes a dry run before it) but still says what it found."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(ROOT / "tools/gpu_test.py"), "--smoke", str(tmp_path / "s.json")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.returncode == 1, run.stderr
    found = json.loads((tmp_path / "s.json").read_text())
    assert found["machine"]["cuda_available"] is False and found["imports"]["nbval"]["version"]
    cast = found["fp8_cast_cpu"]
    assert cast["inputs"] == [300.0, 500.0, 1e5, float("inf")] and len(cast["float8_e4m3fn"]) == 4


def test_the_doctor_cost_tests_helpers_measure_on_a_cpu_too():
    """tests/gpu/test_cuda_doctor.py gates its goal on the op watch's host round trips: the helpers that count them
    run on any device (here the CPU), so they are checked before a GPU run needs them."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import doctor_cost
    import test_cuda_doctor

    ops = test_cuda_doctor.ops_per_step(*doctor_cost.setup("transformer", __import__("torch").device("cpu")))
    assert 30 < ops < 5000, ops
    assert 0 < test_cuda_doctor.sync_seconds("cpu", n=20) < 0.01


def test_gpu_test_selects_every_test_under_tests_gpu():
    """`-m gpu` (what make gpu-test passes) collects tests/gpu: every test there carries the marker."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "--collect-only",
                          "-q", "-m", "gpu", "tests/gpu"], capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    selected = [ln for ln in out.splitlines() if "::test_" in ln]
    assert len(selected) >= 5 and "deselected" not in out, out
    assert any("test_bench" in ln for ln in selected) and any("gradscaler" in ln.lower() for ln in selected)
