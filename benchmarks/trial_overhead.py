"""What ampcourse.trial.trial costs, against the trainings it runs done plainly, side by side in one process.

    .venv/bin/python benchmarks/trial_overhead.py --device cpu --threads 1
    .venv/bin/python benchmarks/trial_overhead.py --device cuda --sizes small large --out benchmarks/cuda_trial.json

"Plain" is what a trial runs, without the trial: for the fp32 reference and each precision, a copy of the same
initial model, its AdamW and (fp16) GradScaler, and ``steps`` calls of ``ampcourse.train.train_step`` on the same
batches. "Trial" is ``trial(...)`` with its default monitors (attention-logit max, output-logit max, activation
max), per-layer drift and update ratios. Both include building the runs. They run interleaved, ``--repeats``
times each after one warm-up of each; the median of each and the ratio trial / plain are reported (goal <= 1.1).
On a CPU the clock is this process's CPU time (one torch thread: other jobs on a shared machine do not count);
on CUDA, wall time after a synchronize. Also reported: the trial's own ``overhead`` (its wall time / the time
inside train_step), which counts the monitors' hooks as training time, so the side-by-side ratio is the honest one.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from ampcourse import models
from ampcourse.device import pick
from ampcourse.train import batch_indices, make_optimizer, train_step
from ampcourse.trial import trial


def plain(name: str, size: str, precisions: tuple[str, ...], steps: int, device: str, batch: int) -> None:
    """The trainings a trial runs (fp32 + each precision), one after another, with nothing recorded."""
    model = models.make_model(name, size=size, seed=0)
    data = models.make_dataset(name, n=1024, seed=0, size=size)
    xs, ys = data.tensors
    for prec in ("fp32", *precisions):
        amp = pick(device, prec)
        net = copy.deepcopy(model).to(amp.device)
        opt = make_optimizer("adamw", net.parameters(), 1e-3)
        scaler = amp.make_scaler()
        for step in range(steps):
            idx = batch_indices(step, 0, len(data), batch)
            train_step(net, [(xs[idx].to(amp.device), ys[idx].to(amp.device))], models.loss_fn, opt, scaler, amp)


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
          f"precisions fp32 + {', '.join(precisions)}, {args.steps} steps, batch {args.batch}")
    results = []
    for size in args.sizes:
        kw = dict(precisions=precisions, steps=args.steps, batch_size=args.batch, device=args.device, size=size)
        plain("transformer", size, precisions, 2, args.device, args.batch)  # warm-up
        trial("transformer", **{**kw, "steps": 2})
        times = {"plain": [], "trial": []}
        inner = []
        for _ in range(args.repeats):
            t0 = clock(args.device)
            plain("transformer", size, precisions, args.steps, args.device, args.batch)
            t1 = clock(args.device)
            t = trial("transformer", **kw)
            t2 = clock(args.device)
            times["plain"].append(t1 - t0)
            times["trial"].append(t2 - t1)
            inner.append(t.overhead)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"size": size, "plain_s": med["plain"], "trial_s": med["trial"], "ratio": med["trial"] / med["plain"],
               "ratios": [b / a for a, b in zip(times["plain"], times["trial"])],
               "trial_overhead_attr": statistics.median(inner)}
        results.append(row)
        print(f"transformer {size:5}: plain {row['plain_s']:.3f} s, trial {row['trial_s']:.3f} s, "
              f"ratio {row['ratio']:.3f} (per repeat {', '.join(f'{r:.3f}' for r in row['ratios'])}); "
              f"trial.overhead {row['trial_overhead_attr']:.3f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"torch": torch.__version__, "device": amp.describe_device(), "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
