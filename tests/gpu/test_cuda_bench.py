"""GPU benchmark: fp32 vs fp16 autocast side by side in one run; `make gpu-test` puts the figures in its report.

Each pair is timed interleaved (fp32, fp16, fp32, fp16, ...) with torch.utils.benchmark, which
synchronises CUDA, so both see the same clocks and the same neighbours. The ratio is the figure;
the asserts only check that both ran and agree numerically.
"""

import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from torch.utils import benchmark

from ampcourse.models import make_task

pytestmark = pytest.mark.gpu
REPEATS = 5


def interleaved(stmts: dict[str, callable], repeats: int = REPEATS, min_run_time: float = 0.2) -> dict[str, float]:
    """Median seconds per call of each statement, timed in turns."""
    times: dict[str, list[float]] = {k: [] for k in stmts}
    for _ in range(repeats):
        for name, fn in stmts.items():
            times[name].append(benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median)
    return {k: statistics.median(v) for k, v in times.items()}


def record(name: str, result: dict) -> None:
    """Append one benchmark's figures to the JSON file make gpu-test reads (AMPCOURSE_BENCH_JSON)."""
    path = os.environ.get("AMPCOURSE_BENCH_JSON")
    if not path:
        return
    data = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    data[name] = result
    Path(path).write_text(json.dumps(data, indent=2))


def test_bench_matmul(amp):
    n = 4096
    a, b = (torch.randn(n, n, device=amp.device) for _ in range(2))

    def fp32():
        return a @ b

    def fp16():
        with amp.autocast():
            return a @ b

    ref, low = fp32(), fp16()
    assert low.dtype == torch.float16
    rel = ((low.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"fp16 matmul deviates from fp32 by {rel:.2e}"
    t = interleaved({"fp32": fp32, "fp16": fp16})
    record("matmul_4096", {"what": f"{n}x{n} @ {n}x{n}", "seconds_fp32": t["fp32"], "seconds_fp16": t["fp16"],
                           "speedup_fp16": t["fp32"] / t["fp16"], "tf32_allowed": torch.backends.cuda.matmul.allow_tf32,
                           "rel_error_fp16": rel})
    assert t["fp32"] > 0 and t["fp16"] > 0


def test_bench_training_step(amp):
    task = make_task("transformer", n=32, seed=0, size="large")
    model = task.model.to(amp.device)
    x, y = (t.to(amp.device) for t in task.data.tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scalers = {"fp32": amp.make_scaler(enabled=False), "fp16": amp.make_scaler()}

    def step(precision: str):
        opt.zero_grad(set_to_none=True)
        with amp.autocast(enabled=precision == "fp16"):
            loss = task.loss_fn(model(x), y)
        scalers[precision].scale(loss).backward()
        scalers[precision].step(opt)
        scalers[precision].update()
        return loss

    for p in ("fp32", "fp16"):  # warm up both paths (kernel selection, allocator)
        step(p)
    t = interleaved({"fp32": lambda: step("fp32"), "fp16": lambda: step("fp16")}, min_run_time=0.5)
    params = sum(p.numel() for p in model.parameters())
    record("transformer_large_train_step", {"tf32_allowed": torch.backends.cuda.matmul.allow_tf32,
        "what": f"TinyTransformer size=large ({params / 1e6:.1f} M params), batch {x.shape[0]}x{x.shape[1]}, AdamW step",
        "seconds_fp32": t["fp32"], "seconds_fp16": t["fp16"], "speedup_fp16": t["fp32"] / t["fp16"]})
    assert torch.isfinite(step("fp16"))


def test_bench_bf16_matmul_fraction_of_peak(amp):
    """bf16 n x n matmuls at several large sizes: the best is the measured peak; n=4096 as a fraction of it."""
    from ampcourse import bench

    rows = bench.matmul_tflops(amp.device, dtypes=["bf16"], sizes=bench.PEAK_SIZES, min_run_time=0.2, repeats=3,
                               budget_s=5.0)
    result = bench.fraction_of_peak(rows, "bf16", bench.PEAK_REFERENCE_N, torch.cuda.get_device_name(amp.device))
    record("bf16_matmul_peak", {"what": f"bf16 n x n matmul, n={bench.PEAK_REFERENCE_N}, as a fraction of the best "
                                        f"of n={list(bench.PEAK_SIZES)}", **result})
    assert 0 < result["fraction_of_peak"] <= 1
