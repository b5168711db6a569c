"""What ampcourse.trial.trial costs, against the trainings it runs done plainly, side by side in one process.

    .venv/bin/python benchmarks/trial_overhead.py --device cpu --threads 1
    .venv/bin/python benchmarks/trial_overhead.py --device cuda --sizes small large --out benchmarks/cuda_trial.json

"Plain" is what a trial runs, without the trial: for the fp32 reference and each precision, a copy of the same
initial model, its AdamW and (fp16) GradScaler, and ``steps`` calls of ``ampcourse.train.train_step`` on the same
batches, one run after another; "plain in lockstep" runs the same steps interleaved (step k of every run, then
step k+1: the trial's ``chunk=1``), which costs cache locality on a CPU: three models' weights and optimizer state
take turns. The trial itself runs chunks of steps (its default ``chunk``: every step at once for these sizes), so
trial / plain is the ratio the goal is about. "Trial" is ``trial(...)`` with its default monitors (attention-logit
max, output-logit max, activation max), per-layer drift and update ratios. All include building the runs. They run interleaved, ``--repeats``
times each after one warm-up of each; the medians and the ratios trial / plain and trial / lockstep are reported
(goal <= 1.1).
On a CPU the clock is this process's CPU time (one torch thread: other jobs on a shared machine do not count);
on CUDA, wall time after a synchronize. Also reported: the trial's own ``overhead`` (its wall time / the time
inside train_step), which counts the monitors' hooks as training time, so the side-by-side ratio is the honest one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

from ampcourse import models
from ampcourse.device import pick
from ampcourse.train import batch_indices, make_optimizer, train_step
from ampcourse.trial import trial


def plain(name: str, size: str, precisions: tuple[str, ...], steps: int, device: str, batch: int,
          lockstep: bool = False) -> None:
    """The trainings a trial runs (fp32 + each precision) with nothing recorded: one after another, or in lockstep
    (step k of every run before step k+1 of any, as the trial runs them)."""
    model = models.make_model(name, size=size, seed=0)
    data = models.make_dataset(name, n=1024, seed=0, size=size)
    xs, ys = data.tensors
    runs = []
    for prec in ("fp32", *precisions):
        amp = pick(device, prec)
        net = copy.deepcopy(model).to(amp.device)
        runs.append((net, make_optimizer("adamw", net.parameters(), 1e-3), amp.make_scaler(), amp))

    def step_of(run, step):
        net, opt, scaler, amp = run
        idx = batch_indices(step, 0, len(data), batch)
        train_step(net, [(xs[idx].to(amp.device), ys[idx].to(amp.device))], models.loss_fn, opt, scaler, amp)
    if lockstep:
        for step in range(steps):
            for run in runs:
                step_of(run, step)
    else:
        for run in runs:
            for step in range(steps):
                step_of(run, step)


def clock(device: str):
    """CPU time of this process on a CPU; wall time after a synchronize on CUDA."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", nargs="+", default=["tiny"])
    ap.add_argument("--precisions", default="bf16,fp16")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    precisions = tuple(args.precisions.split(","))
    amp = pick(args.device, "fp32")
    print(f"torch {torch.__version__}, {amp.describe_device()}, {torch.get_num_threads()} thread(s), "
          f"precisions fp32 + {', '.join(precisions)}, {args.steps} steps, batch {args.batch}; "
          f"load average {os.getloadavg()[0]:.1f}")
    results = []
    for size in args.sizes:
        kw = dict(precisions=precisions, steps=args.steps, batch_size=args.batch, device=args.device, size=size)
        plain("transformer", size, precisions, 2, args.device, args.batch)  # warm-up
        trial("transformer", **{**kw, "steps": 2})
        times = {"plain": [], "lockstep": [], "trial": []}
        inner = []
        for _ in range(args.repeats):
            t0 = clock(args.device)
            plain("transformer", size, precisions, args.steps, args.device, args.batch)
            t1 = clock(args.device)
            plain("transformer", size, precisions, args.steps, args.device, args.batch, lockstep=True)
            t2 = clock(args.device)
            t = trial("transformer", **kw)
            t3 = clock(args.device)
            times["plain"].append(t1 - t0)
            times["lockstep"].append(t2 - t1)
            times["trial"].append(t3 - t2)
            inner.append(t.overhead)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"size": size, **{f"{k}_s": v for k, v in med.items()},
               "ratio": med["trial"] / med["plain"], "ratio_lockstep": med["trial"] / med["lockstep"],
               "ratios": [c / a for a, c in zip(times["plain"], times["trial"])],
               "ratios_lockstep": [c / b for b, c in zip(times["lockstep"], times["trial"])],
               "trial_overhead_attr": statistics.median(inner)}
        results.append(row)
        print(f"transformer {size:5}: plain {med['plain']:.3f} s, plain in lockstep {med['lockstep']:.3f} s, "
              f"trial {med['trial']:.3f} s; trial / plain {row['ratio']:.3f} "
              f"(per repeat {', '.join(f'{r:.3f}' for r in row['ratios'])}), trial / lockstep "
              f"{row['ratio_lockstep']:.3f} (per repeat {', '.join(f'{r:.3f}' for r in row['ratios_lockstep'])}); "
              f"trial.overhead {row['trial_overhead_attr']:.3f}; chunk {t.config['chunk']}; "
              f"load average {os.getloadavg()[0]:.1f}")
        row["chunk"], row["load_average"] = t.config["chunk"], os.getloadavg()[0]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"torch": torch.__version__, "device": amp.describe_device(), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
