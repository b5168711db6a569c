"""examine() before and after a change, interleaved in one process: a fair comparison on a shared machine.

    mkdir -p /tmp/before && git archive <commit> ampcourse/doctor | tar -x -C /tmp/before   # the package
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/doctor_ab.py /tmp/before/ampcourse/doctor --model transformer
    git show <commit>:ampcourse/doctor.py > /tmp/doctor_before.py      # or a commit from before the package split
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/doctor_ab.py /tmp/doctor_before.py --model transformer --repeats 9

The path given (the doctor package's folder, or the single module it was before) is loaded as a second copy of
ampcourse.doctor, named ampcourse.doctor_before (its relative imports resolve to this checkout's ampcourse). For each
precision set, one fp32 forward + backward, examine() from that copy and examine() from this checkout run in turn,
``--repeats`` times; medians of this process's CPU time (one torch thread), and examine / (fp32 forward + backward);
"paired" is the median of after / before over the repeats (each pair ran back to back: steadier under load).
``--steps`` (default 0: the forensic pass) is passed to both copies' examine() where it takes one (the doctor before
issue 25 had no confirmation); ``--sets`` picks the precision sets.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import statistics
import sys
import time

import torch

import ampcourse.doctor as after
from doctor_cost import MODELS, fwd_bwd, setup

PRECISION_SETS = {"fp16+bf16": ("fp16", "bf16"), "fp16": ("fp16",), "bf16": ("bf16",)}


def load_before(path: str):
    """The doctor in path (a package folder or a single .py file), loaded as ampcourse.doctor_before."""
    from pathlib import Path
    folder = Path(path)
    if folder.is_dir():
        spec = importlib.util.spec_from_file_location("ampcourse.doctor_before", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
    else:
        spec = importlib.util.spec_from_file_location("ampcourse.doctor_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def with_steps(examine, steps: int):
    """examine with steps= bound, where its signature has that parameter (a doctor from before issue 25 has not)."""
    if "steps" in inspect.signature(examine).parameters:
        return functools.partial(examine, steps=steps)
    return examine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="a copy of ampcourse/doctor (the package folder) or of the old ampcourse/doctor.py")
    ap.add_argument("--model", default="transformer", choices=MODELS)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--steps", type=int, default=0, help="examine(steps=) where it takes one (0: the forensic pass)")
    ap.add_argument("--sets", default=",".join(PRECISION_SETS), help="precision sets, comma-separated")
    args = ap.parse_args()
    sets = {k: PRECISION_SETS[k] for k in args.sets.split(",")}
    torch.set_num_threads(1)
    before = load_before(args.before)
    model, x, y, loss_fn = setup(args.model, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd_bwd(model, x, y, loss_fn)
    versions = {"before": with_steps(before.examine, args.steps), "after": with_steps(after.examine, args.steps)}
    for examine in versions.values():  # warm-up
        for precs in sets.values():
            examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs)
    samples: dict[str, list[float]] = {"fp32 fwd+bwd": []}
    for _ in range(args.repeats):
        for key, precs in sets.items():
            t0 = time.process_time()
            fwd_bwd(model, x, y, loss_fn)
            samples["fp32 fwd+bwd"].append(time.process_time() - t0)
            for label, examine in versions.items():
                t0 = time.process_time()
                examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs)
                samples.setdefault(f"{label} {key}", []).append(time.process_time() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["fp32 fwd+bwd"]
    print(f"{args.model}: fp32 fwd+bwd {base * 1e3:.2f} ms (median of {len(samples['fp32 fwd+bwd'])})")
    for key in sets:
        cells = [f"{label} {med[f'{label} {key}'] * 1e3:7.1f} ms ({med[f'{label} {key}'] / base:.1f}x fp32 fwd+bwd)"
                 for label in versions]
        pairs = [a / b for a, b in zip(samples[f"after {key}"], samples[f"before {key}"])]
        print(f"  {key:10s} " + "   ".join(cells) + f"   paired after/before {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
