"""What ampcourse.doctor.examine costs, against one fp32 forward + backward of the same model and a plain step.

    .venv/bin/python benchmarks/doctor_cost.py --device cpu --threads 1
    .venv/bin/python benchmarks/doctor_cost.py --device cuda --out benchmarks/cuda_doctor.json

Time: for each model, one fp32 forward + backward and examine() (precisions fp16+bf16, fp16 alone, bf16 alone)
run interleaved, ``--repeats`` times each; the median of each is reported, and the ratio
examine / (fp32 forward+backward x (number of precisions + 1)), the goal being <= 4. On a CPU the clock is this
process's CPU time (one torch thread; other jobs on a shared machine do not count); on CUDA, wall time after a
synchronize.

Memory: peak bytes above the state after building model, data and optimizer, for one plain training step
(AdamW, fp32) and for examine(), each in a fresh process (CPU: peak resident set size, VmHWM after resetting it
through /proc/self/clear_refs, Linux only; CUDA: torch.cuda.max_memory_allocated). Goal: examine <= 2x the plain
step.

Models: the course's reference transformer (tiny, batch 16) and a ResNet-18-like image classifier
(Hugging Face transformers' ResNetForImageClassification with ResNet-18's layout: basic blocks, depths 2-2-2-2,
widths 64-128-256-512; random init, no download) at batch 8, 3 x 64 x 64. torchvision's resnet18 would be the
obvious choice, but PyPI's torchvision does not install beside the CPU torch build this project pins.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ampcourse.device import pick  # noqa: E402
from ampcourse.doctor import examine  # noqa: E402
from ampcourse.models import make_task  # noqa: E402

MODELS = ("transformer", "resnet18")
PRECISION_SETS = {"fp16+bf16": ("fp16", "bf16"), "fp16": ("fp16",), "bf16": ("bf16",)}


def setup(name: str, dev: torch.device):
    """(model, inputs, targets, loss_fn) on dev."""
    if name == "transformer":
        task = make_task("transformer", n=16)
        x, y = task.data.tensors
        return task.model.to(dev), x.to(dev), y.to(dev), task.loss_fn
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                    num_labels=10)
    model = transformers.ResNetForImageClassification(cfg).to(dev)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
    return model, x.to(dev), y.to(dev), lambda out, t: F.cross_entropy(out.logits, t)


def clock(dev: torch.device) -> float:
    """CPU time of this process (CPU) or wall time after a synchronize (CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return time.perf_counter()
    return time.process_time()


def fwd_bwd(model, x, y, loss_fn) -> None:
    """One fp32 forward + backward (gradients dropped afterwards)."""
    loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)


def autocast_fwd(model, x, y, loss_fn, dev: torch.device, precision: str) -> None:
    """One forward pass (and loss) under autocast, without gradients."""
    with torch.no_grad(), pick(dev, precision).autocast():
        loss_fn(model(x), y)


def time_one(fn, dev) -> float:
    t0 = clock(dev)
    fn()
    return clock(dev) - t0


def timings(name: str, dev: torch.device, repeats: int) -> dict:
    """Median seconds of fp32 forward+backward and of examine() per precision set, interleaved."""
    model, x, y, loss_fn = setup(name, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd_bwd(model, x, y, loss_fn)  # warm-up: first-call costs (allocator, kernels) are not what we measure
    for precs in PRECISION_SETS.values():
        examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs)
    samples: dict[str, list[float]] = {"fp32 fwd+bwd": [], **{k: [] for k in PRECISION_SETS},
                                       "fp16 autocast fwd": [], "bf16 autocast fwd": []}
    for _ in range(repeats):
        samples["fp32 fwd+bwd"].append(time_one(lambda: fwd_bwd(model, x, y, loss_fn), dev))
        for p in ("fp16", "bf16"):  # a plain autocast forward: the part of examine() that is the hardware's
            samples[f"{p} autocast fwd"].append(time_one(lambda: autocast_fwd(model, x, y, loss_fn, dev, p), dev))
        for key, precs in PRECISION_SETS.items():
            samples[key].append(time_one(lambda: examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=precs),
                                         dev))
            samples["fp32 fwd+bwd"].append(time_one(lambda: fwd_bwd(model, x, y, loss_fn), dev))
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["fp32 fwd+bwd"]
    ratios = {k: med[k] / (base * (len(precs) + 1)) for k, precs in PRECISION_SETS.items()}
    return {"seconds": med, "ratio_per_pass": ratios}


def peak_child(name: str, what: str, device: str) -> None:
    """In a fresh process: print the peak bytes above the post-setup state for 'step' or 'examine'."""
    dev = torch.device(device)
    model, x, y, loss_fn = setup(name, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if dev.type == "cuda":
        # Warm up first: the first GEMMs allocate cuBLAS/cuBLASLt workspaces (tens of MiB on Hopper) that stay
        # allocated; reset after them, or that one-time cost lands in both peaks and hides the ratio.
        fwd_bwd(model, x, y, loss_fn)
        for precision in ("fp16", "bf16"):
            autocast_fwd(model, x, y, loss_fn, dev, precision)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _reset_peak_rss()
    if what == "step":
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        examine(model, x, y, loss_fn=loss_fn, optimizer=opt)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = _status_bytes("VmHWM")
    print(json.dumps({"peak_above_setup": peak - base}))


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the peak resident set size (Linux: write 5 to /proc/self/clear_refs); return the current one."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_bytes("VmRSS")


def peaks(name: str, device: str) -> dict:
    """Peak bytes above setup for a plain training step and for examine(), each in its own process."""
    out = {}
    for what in ("step", "examine"):
        run = subprocess.run([sys.executable, __file__, "--child", name, what, "--device", device],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        out[what] = json.loads(run.stdout.strip().splitlines()[-1])["peak_above_setup"]
    out["ratio"] = out["examine"] / out["step"] if out["step"] else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        peak_child(*args.child, args.device)
        return
    dev = torch.device(args.device)
    result = {"device": str(dev), "torch": torch.__version__, "threads": args.threads, "models": {}}
    if dev.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(dev)
    for name in args.models.split(","):
        t = timings(name, dev, args.repeats)
        m = peaks(name, args.device)
        result["models"][name] = {**t, "memory": m}
        s = t["seconds"]
        print(f"{name}: autocast forward alone: fp16 {s['fp16 autocast fwd'] * 1e3:.1f} ms, "
              f"bf16 {s['bf16 autocast fwd'] * 1e3:.1f} ms")
        print(f"{name}: fp32 fwd+bwd {s['fp32 fwd+bwd'] * 1e3:.1f} ms; examine " +
              ", ".join(f"{k} {s[k] * 1e3:.0f} ms (ratio per pass {t['ratio_per_pass'][k]:.2f})" for k in PRECISION_SETS))
        print(f"{name}: peak above setup: plain step {m['step'] / 2**20:.1f} MiB, examine {m['examine'] / 2**20:.1f} MiB "
              f"(ratio {m['ratio']:.2f})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
