"""Trainer overhead before and after a change: ampcourse.train at a baseline commit, and now, each vs a bare loop.

    .venv/bin/python benchmarks/trainer_ab.py --baseline d5d8a56 --threads 1

For each repeat, the baseline's train() and today's train() each run once with a bare AMP loop
interleaved step by step (``ampcourse.bench.paired_step_times``: bare, trainer, bare, trainer, ...),
the two runs in alternating order. A step of either is one whole iteration of its loop, timed on
this thread's CPU clock with one torch thread (other jobs on a shared machine do not count).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ampcourse import bench, models
from ampcourse.device import pick

ROOT = Path(__file__).resolve().parents[1]


def load_baseline(commit: str):
    """ampcourse.train as of `commit`, imported as ampcourse._train_baseline (relative imports still work).

    A package (ampcourse/train/) since the on_step hook came; a single ampcourse/train.py before, whose train()
    gets the hook from :func:`_with_on_step`.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    folder = Path(tempfile.mkdtemp()) / "train_baseline"
    folder.mkdir()
    files = git("ls-tree", "-r", "--name-only", commit, "--", "ampcourse/train/").split()
    if files:
        for name in files:
            (folder / Path(name).name).write_text(git("show", f"{commit}:{name}"))
        spec = importlib.util.spec_from_file_location("ampcourse._train_baseline", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
    else:
        (folder / "train.py").write_text(git("show", f"{commit}:ampcourse/train.py"))
        spec = importlib.util.spec_from_file_location("ampcourse._train_baseline", folder / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module if files else _with_on_step(module)


def _with_on_step(module):
    """An old single-file ampcourse.train whose train() takes on_step, as bench.paired_step_times needs.

    Its loop called local_indices once for the data check and then at the start of every step, so step k's
    hook runs when step k + 1 asks for its batch (the last one when train() returns): for the benchmark, the
    same place between two trainer steps as today's hook.
    """
    from types import SimpleNamespace
    from unittest import mock

    def train(*args, on_step=None, steps, **kwargs):
        calls = [0]
        real = module.local_indices

        def local_indices(*a, **k):
            calls[0] += 1
            if on_step is not None and calls[0] >= 3:  # call 1: the data check; call 2: step 0 starts
                on_step(calls[0] - 3, None)
            return real(*a, **k)

        with mock.patch.object(module, "local_indices", local_indices):
            result = module.train(*args, steps=steps, **kwargs)
        if on_step is not None:
            on_step(steps - 1, None)
        return result

    return SimpleNamespace(train=train)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="commit whose ampcourse/train.py is the 'before'")
    ap.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ampcourse import train as now
    versions = {"before": load_baseline(args.baseline), "now": now}
    amp = pick("cpu", args.precision)
    print(f"baseline {args.baseline}, precision {amp.precision}, {args.threads} thread(s), {args.repeats} repeats of "
          f"{args.steps} steps (first {args.warmup} dropped), batch 32, AdamW, clock {bench.overhead_clock(amp.device)[0]}")
    print("| model | before: trainer / bare ms | before: overhead | now: trainer / bare ms | now: overhead "
          "| now: range over repeats |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        data = models.make_dataset(name, n=1024, seed=0)
        pairs = {k: [] for k in versions}
        for r in range(args.repeats):
            for who in (["before", "now"] if r % 2 == 0 else ["now", "before"]):
                pairs[who].append(bench.paired_step_times(versions[who], name, data, amp, args.steps, args.warmup))
        cells = []
        for who in versions:
            ratios = [t / b - 1 for t, b in pairs[who]]
            cells += [f"{statistics.median(t for t, _ in pairs[who]):.3f} / {statistics.median(b for _, b in pairs[who]):.3f}",
                      f"{statistics.median(ratios):+.1%}"]
        ratios = [t / b - 1 for t, b in pairs["now"]]
        print(f"| {name} tiny | {' | '.join(cells)} | {min(ratios):+.1%} to {max(ratios):+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
