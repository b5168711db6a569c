"""Cost of one emulated fp8 training step on a CPU: torchao float8 and MXFP8 (emulated) vs fp32 and bf16 autocast.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fp8_step.py            # tiny transformer, batch 32

The recipes are chapter 9's (``ampcourse.fp8.to_recipe``). Each repeat times ``--steps`` optimizer steps
of every recipe in turn (interleaved, so a busy machine slows all of them alike); the table gives the
median per step over ``--repeats`` repeats and the ratio to bf16. Emulation does the fp8 rounding in
extra elementwise work and the matmuls in fp32: this measures that overhead, not fp8 hardware.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from ampcourse import fp8
from ampcourse.models import make_task


def make_step(recipe: str, batch: int):
    """A closure running one optimizer step of the tiny transformer under a recipe."""
    task = make_task("transformer", n=batch, seed=0)
    model = fp8.to_recipe(task.model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = task.data.tensors

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16"):
            loss = task.loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    steps = {r: make_step(r, args.batch) for r in fp8.RECIPES}
    for step in steps.values():  # warm-up: first calls allocate and pick kernels
        step()
    times: dict[str, list[float]] = {r: [] for r in steps}
    for _ in range(args.repeats):
        for r, step in steps.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[r].append((time.perf_counter() - t) / args.steps * 1e3)
    med = {r: statistics.median(v) for r, v in times.items()}
    print(f"tiny transformer, batch {args.batch}, {args.steps} steps x {args.repeats} interleaved repeats; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print("| recipe | ms per step (median) | / bf16 | / fp32 |")
    print("|---|---|---|---|")
    for r, m in med.items():
        print(f"| {r} | {m:.2f} | {m / med['bf16']:.2f} | {m / med['fp32']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
