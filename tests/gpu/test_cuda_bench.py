"""GPU benchmarks for `make gpu-test`'s report: each figure measured side by side in one run.

Pairs are timed interleaved (fp32, bf16, fp16, fp32, ...) with torch.utils.benchmark, which synchronises
CUDA, so all see the same clocks and neighbours. fp32 is true fp32 here (TF32 off for matmuls and cuDNN
convolutions: `ampcourse.bench.fp32_math`). The figures are recorded for the report; the asserts check
that everything ran and agrees numerically, not that a goal was met (the report says that).
"""

import json
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import benchmark

from ampcourse import bench
from ampcourse.device import native_bf16, pick
from ampcourse.models import make_task

pytestmark = pytest.mark.gpu
REPEATS = 5
ROOT = Path(__file__).resolve().parents[2]


def interleaved(stmts: dict[str, callable], repeats: int = REPEATS, min_run_time: float = 0.2) -> dict[str, float]:
    """Median seconds per call of each statement, timed in turns."""
    times: dict[str, list[float]] = {k: [] for k in stmts}
    for _ in range(repeats):
        for name, fn in stmts.items():
            times[name].append(benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median)
    return {k: statistics.median(v) for k, v in times.items()}


def record(name: str, result: dict) -> None:
    """Add one benchmark's figures to the JSON file make gpu-test reads (AMPCOURSE_BENCH_JSON)."""
    path = os.environ.get("AMPCOURSE_BENCH_JSON")
    if not path:
        return
    data = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    data[name] = result
    Path(path).write_text(json.dumps(data, indent=2))


def low_precisions(device) -> list[str]:
    """bf16 (where native) and fp16: the AMP precisions worth timing on this GPU."""
    return (["bf16"] if native_bf16(device) else []) + ["fp16"]


def test_bench_matmul(amp):
    n = 4096
    a, b = (torch.randn(n, n, device=amp.device) for _ in range(2))
    setups = {p: pick(amp.device, p) for p in low_precisions(amp.device)}

    def run(precision):
        if precision == "fp32":
            return a @ b
        with setups[precision].autocast():
            return a @ b

    with bench.fp32_math(tf32=False, device=amp.device):
        ref = run("fp32")
        rel = {}
        for p in setups:
            low = run(p)
            assert low.dtype == setups[p].amp_dtype
            rel[p] = ((low.float() - ref).norm() / ref.norm()).item()
            assert rel[p] < 2e-2, f"{p} matmul deviates from fp32 by {rel[p]:.2e}"
        t = interleaved({p: (lambda p=p: run(p)) for p in ["fp32", *setups]})
        tf32 = bench.tf32_settings()
    record("matmul_4096", {"what": f"{n}x{n} @ {n}x{n}", "tf32": tf32, **{f"seconds_{p}": t[p] for p in t},
                           **{f"speedup_{p}": t["fp32"] / t[p] for p in setups}, **{f"rel_error_{p}": rel[p] for p in rel}})
    assert all(v > 0 for v in t.values())


def test_bench_training_step(amp):
    """The reference transformer (size=large, batch 32): fp32 vs bf16 vs fp16 AMP, fused AdamW, one step each."""
    task = make_task("transformer", n=32, seed=0, size="large")
    x, y = (t.to(amp.device) for t in task.data.tensors)
    runs = {}
    for p in ["fp32", *low_precisions(amp.device)]:
        setup = pick(amp.device, p)
        model = make_task("transformer", n=32, seed=0, size="large").model.to(amp.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        runs[p] = (setup, model, opt, setup.make_scaler())

    def step(p: str):
        setup, model, opt, scaler = runs[p]
        opt.zero_grad(set_to_none=True)
        with setup.autocast():
            loss = task.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    with bench.fp32_math(tf32=False, device=amp.device):
        for p in runs:  # warm up every path (kernel selection, allocator)
            for _ in range(2):
                step(p)
        t = interleaved({p: (lambda p=p: step(p)) for p in runs}, min_run_time=0.5)
        tf32 = bench.tf32_settings()
    params = sum(p.numel() for p in runs["fp32"][1].parameters())
    record("transformer_large_train_step", {
        "what": f"TinyTransformer size=large ({params / 1e6:.1f} M params), batch {x.shape[0]}x{x.shape[1]}, fused AdamW step",
        "tf32": tf32, **{f"seconds_{p}": t[p] for p in t}, **{f"speedup_{p}": t["fp32"] / t[p] for p in t if p != "fp32"}})
    assert all(torch.isfinite(step(p)) for p in runs)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bench_matmul_fraction_of_peak(amp, dtype):
    """n=4096 as a fraction of the peak, measured separately: the best of n = 8192..16384 in the same run."""
    if dtype == "bf16" and not native_bf16(amp.device):
        pytest.skip("no bf16 tensor cores on this GPU (compute capability < 8.0)")
    rows = bench.matmul_tflops(amp.device, dtypes=[dtype], sizes=bench.PEAK_SIZES, min_run_time=0.2, repeats=3,
                               budget_s=5.0)
    result = bench.fraction_of_peak(rows, dtype, bench.PEAK_REFERENCE_N, torch.cuda.get_device_name(amp.device))
    record(f"{dtype}_matmul_peak", {"what": f"{dtype} n x n matmul, n={bench.PEAK_REFERENCE_N}, against the best of "
                                            f"n={result['peak_sizes']}", **result})
    assert result["fraction_of_peak"] > 0 and not any(r["bounded"] for r in rows)


def test_bench_trainer_overhead(amp):
    """ampcourse.train against a bare hand-written AMP loop, step by step, on the GPU's default precision."""
    default = pick(amp.device)
    rows = bench.trainer_overhead(["transformer"], amp.device, default.precision, size="large", batch=32, steps=30,
                                  repeats=3, warmup=5)
    row = rows[0]
    record("trainer_overhead", {"what": f"transformer size=large batch 32, {default.precision}, {row['clock']}", **row})
    assert row["trainer_ms"] > 0 and row["bare_ms"] > 0


def _syncs(fn) -> int:
    """How many synchronizing CUDA calls fn makes (torch.cuda.set_sync_debug_mode warns once per sync)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_host_syncs_per_training_step(amp):
    """ampcourse.train's step: one device-to-host read per step with fused AdamW (fp16 and bf16)."""
    from ampcourse import train as train_mod

    task = make_task("mlp", n=64, seed=0)
    batch = tuple(t.to(amp.device) for t in task.data.tensors)
    result = {}
    for label, precision, fused in [("fp16_fused", "fp16", True), ("fp16_plain", "fp16", False),
                                    ("bf16_fused", "bf16", True)]:
        if precision == "bf16" and not native_bf16(amp.device):
            continue
        setup = pick(amp.device, precision)
        model = make_task("mlp", n=64, seed=0).model.to(amp.device)
        opt = train_mod.make_optimizer("adamw", model.parameters(), 1e-3, fused=fused)
        scaler = setup.make_scaler()
        for _ in range(2):  # warm up (lazy state, the scaler's first scale)
            train_mod.train_step(model, [batch], task.loss_fn, opt, scaler, setup)
        steps = 5
        result[label] = _syncs(lambda: [train_mod.train_step(model, [batch], task.loss_fn, opt, scaler, setup)
                                        for _ in range(steps)]) / steps
    # the whole loop (batch gather, step, bookkeeping) through train(), default precision and optimizer
    default = pick(amp.device)
    loop_steps = 20
    total = _syncs(lambda: train_mod.train("mlp", None, default.precision, steps=loop_steps, device=amp.device,
                                           progress=False))
    result["train_loop_total"] = total
    result["train_loop_steps"] = loop_steps
    record("host_syncs_per_step", {"what": "synchronizing CUDA calls per train_step (torch.cuda.set_sync_debug_mode)",
                                   **result})
    # Exactly one read-back per step with fused AdamW (the scaler's found_inf goes into the kernel); a plain AdamW
    # adds GradScaler's found_inf.item(). ">= 1" would have passed any number of syncs.
    assert result["fp16_fused"] == 1, result
    assert result["fp16_plain"] == result["fp16_fused"] + 1, result
    assert result.get("bf16_fused", 1) == 1, result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_one_process_nccl(amp, strategy, tmp_path):
    """`--strategy ddp|fsdp` under torchrun with one process on NCCL: it trains and reports the backend."""
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "ampcourse.train",
           "--strategy", strategy, "--model", "transformer", "--steps", "20", "--no-progress", "--out", str(out)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)  # below the per-test limit
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(out.read_text())
    record(f"torchrun_{strategy}_1gpu", {"what": f"torchrun --nproc-per-node 1 -m ampcourse.train --strategy {strategy}",
                                         **{k: summary[k] for k in ("world_size", "backend", "device_type", "precision",
                                                                    "steps_done", "skipped_steps", "final_loss")}})
    assert summary["backend"] == "nccl" and summary["world_size"] == 1 and summary["steps_done"] == 20


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_ranks_nccl(amp, strategy, tmp_path):
    """Two ranks on two GPUs: the cross-rank collectives that one process never runs (DDP's gradient all-reduce,
    FSDP2's all-gather and reduce-scatter). DDP's replicas must end bit-identical."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL ranks (this machine: {torch.cuda.device_count()})")
    out, hist = tmp_path / "summary.json", tmp_path / "history.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ampcourse.train",
           "--strategy", strategy, "--model", "transformer", "--steps", "20", "--no-progress", "--out", str(out),
           "--history-out", str(hist)]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="0,1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr[-3000:]
    summary, ranks = json.loads(out.read_text()), json.loads(hist.read_text())["ranks"]
    record(f"torchrun_{strategy}_2gpu", {"what": f"torchrun --nproc-per-node 2 -m ampcourse.train --strategy {strategy}",
                                         **{k: summary[k] for k in ("world_size", "backend", "device_type", "precision",
                                                                    "steps_done", "skipped_steps", "final_loss")}})
    assert summary["backend"] == "nccl" and summary["world_size"] == 2 and summary["steps_done"] == 20
    assert [r["rank"] for r in ranks] == [0, 1]
    if strategy == "ddp":
        assert ranks[0]["replica_checksum"] == ranks[1]["replica_checksum"], "DDP replicas drifted apart"


def test_bf16adamw_stochastic_step_stays_on_the_gpu(amp):
    """Issue 19 item 13: BF16AdamW(rounding="stochastic") drew its random bits on the CPU, copying every parameter to
    the host and back each step. Now its generator lives on the parameter's GPU: no synchronizing call in step()."""
    from ampcourse.optim import BF16AdamW

    model = torch.nn.Linear(256, 256).to(amp.device, torch.bfloat16)
    opt = BF16AdamW(model.parameters(), lr=1e-3, rounding="stochastic")
    model(torch.randn(8, 256, device=amp.device, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()  # first step: lazy state, the generator made
    assert opt._generator(amp.device).device.type == "cuda"
    assert _syncs(lambda: [opt.step() for _ in range(3)]) == 0
    state = opt.state_dict()["bf16adamw"]["generators"]
    assert list(state) == [str(amp.device)]
