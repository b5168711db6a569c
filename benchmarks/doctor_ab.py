"""examine() before and after a change, interleaved in one process: a fair comparison on a shared machine.

    git show <commit>:ampcourse/doctor.py > /tmp/doctor_before.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/doctor_ab.py /tmp/doctor_before.py --model transformer --repeats 9

The file given is loaded as a second copy of ampcourse.doctor (its relative imports resolve to this checkout's
ampcourse). For each precision set, one fp32 forward + backward, examine() from that file and examine() from this
checkout run in turn, ``--repeats`` times; medians of this process's CPU time (one torch thread), and the ratio of
doctor_cost.py: examine / (fp32 forward+backward x (number of precisions + 1)).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

import ampcourse.doctor as after
from doctor_cost import MODELS, PRECISION_SETS, fwd_bwd, setup


def load_before(path: str):
    """The doctor module in path, loaded as ampcourse.doctor_before."""
    spec = importlib.util.spec_from_file_location("ampcourse.doctor_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="a copy of ampcourse/doctor.py from the commit to compare with")
    ap.add_argument("--model", default="transformer", choices=MODELS)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = load_before(args.before)
    model, x, y, loss_fn = setup(args.model, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd_bwd(model, x, y, loss_fn)
    versions = {"before": before, "after": after}
    for m in versions.values():  # warm-up
        for precs in PRECISION_SETS.values():
            m.examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs)
    samples: dict[str, list[float]] = {"fp32 fwd+bwd": []}
    for _ in range(args.repeats):
        for key, precs in PRECISION_SETS.items():
            t0 = time.process_time()
            fwd_bwd(model, x, y, loss_fn)
            samples["fp32 fwd+bwd"].append(time.process_time() - t0)
            for label, m in versions.items():
                t0 = time.process_time()
                m.examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs)
                samples.setdefault(f"{label} {key}", []).append(time.process_time() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["fp32 fwd+bwd"]
    print(f"{args.model}: fp32 fwd+bwd {base * 1e3:.2f} ms (median of {len(samples['fp32 fwd+bwd'])})")
    for key, precs in PRECISION_SETS.items():
        cells = [f"{label} {med[f'{label} {key}'] * 1e3:7.1f} ms (ratio {med[f'{label} {key}'] / (base * (len(precs) + 1)):.2f})"
                 for label in versions]
        print(f"  {key:10s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
