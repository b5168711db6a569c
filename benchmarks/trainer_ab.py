"""Trainer overhead before and after a change: bare AMP loop, ampcourse.train at a baseline commit, and now.

    .venv/bin/python benchmarks/trainer_ab.py --baseline d5d8a56 --threads 1

The three run interleaved (the order rotates each repeat) on the same data, model, batch and
optimizer. Each is timed end to end the same way: the interval between consecutive calls of the
loss function, i.e. one whole iteration of the loop (batch selection, forward, backward, step,
bookkeeping, progress bar); the median over the steps after the warm-up, then the median over repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ampcourse import bench, models
from ampcourse.device import pick

ROOT = Path(__file__).resolve().parents[1]


def load_baseline(commit: str):
    """ampcourse/train.py as of `commit`, imported as ampcourse._train_baseline (relative imports still work)."""
    source = subprocess.run(["git", "show", f"{commit}:ampcourse/train.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "train_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ampcourse._train_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def timed_loss(stamps: list[float], clock):
    """The reference loss function, recording when each call starts."""
    def loss_fn(out, y):
        stamps.append(clock())
        return models.loss_fn(out, y)
    return loss_fn


def iteration_ms(stamps: list[float], warmup: int, stat: str) -> float:
    """Milliseconds between consecutive loss calls after the warm-up: their median or 10th percentile."""
    gaps = sorted(b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:]))
    return (statistics.median(gaps) if stat == "median" else gaps[len(gaps) // 10]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="commit whose ampcourse/train.py is the 'before'")
    ap.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stat", choices=("median", "p10"), default="median",
                    help="per run: the median iteration, or the 10th percentile (interference only adds time)")
    ap.add_argument("--clock", choices=CLOCKS, default="cpu",
                    help="cpu: this thread's CPU time (other jobs on a shared machine do not count; needs --threads 1); "
                         "wall: wall-clock time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ampcourse import train as now
    before = load_baseline(args.baseline)
    amp = pick("cpu", args.precision)
    print(f"baseline {args.baseline}, precision {amp.precision}, {args.threads} thread(s), {args.repeats} repeats "
          f"of {args.steps} steps (first {args.warmup} dropped), batch 32, AdamW, {args.clock} clock, {args.stat} per run")
    print("| model | bare ms | before ms | now ms | before overhead | now overhead | now range over repeats |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        data = models.make_dataset(name, n=1024, seed=0)
        times = {"bare": [], "before": [], "now": []}
        order = list(times)
        for r in range(args.repeats):
            for who in order[r % 3:] + order[:r % 3]:  # rotate who goes first
                stamps: list[float] = []
                if who == "bare":
                    model = models.make_model(name, seed=0)
                    xs, ys = data.tensors
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # train()'s default
                    scaler = amp.make_scaler()
                    gen = torch.Generator().manual_seed(0)
                    perm = None
                    loss_fn = timed_loss(stamps, CLOCKS[args.clock])
                    for step in range(args.steps):
                        if step % 32 == 0:
                            perm = torch.randperm(len(xs), generator=gen)
                        idx = perm[(step % 32) * 32:(step % 32 + 1) * 32]
                        bench.bare_step(model, opt, scaler, amp, xs[idx], ys[idx], loss_fn).item()
                else:
                    mod = before if who == "before" else now
                    mod.train(name, data, amp.precision, steps=args.steps, lr=1e-3, seed=0, device="cpu",
                              batch_size=32, optimizer="adamw", progress=False, loss_fn=timed_loss(stamps, CLOCKS[args.clock]))
                times[who].append(iteration_ms(stamps, args.warmup, args.stat))
        med = {k: statistics.median(v) for k, v in times.items()}
        over = {k: statistics.median(t / b - 1 for t, b in zip(times[k], times["bare"])) for k in ("before", "now")}
        rng = [t / b - 1 for t, b in zip(times["now"], times["bare"])]
        print(f"| {name} tiny | {med['bare']:.3f} | {med['before']:.3f} | {med['now']:.3f} | {over['before']:+.1%} "
              f"| {over['now']:+.1%} | {min(rng):+.1%} to {max(rng):+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
