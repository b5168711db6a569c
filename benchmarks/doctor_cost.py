"""What ampcourse.doctor.examine costs, against one fp32 forward + backward of the same model and a plain step.

    .venv/bin/python benchmarks/doctor_cost.py --device cpu --threads 1
    .venv/bin/python benchmarks/doctor_cost.py --device cuda --out benchmarks/cuda_doctor.json

Time: for each model, one fp32 forward + backward, one forward + backward under fp16 and under bf16 autocast (the
hardware's part: examine cannot run those passes faster than the device does), and examine() with fp16+bf16
(forward and backward per precision, op watch, optimizer audit), interleaved, ``--repeats`` times each; medians.
The forensic pass's own share ("own"): its time minus the model's passes it runs (fp32, fp16 and bf16 forward +
backward, and where it runs one, a second fp16 backward at scale 1), so that a CPU without fp16 units (whose fp16
passes alone take many fp32 ones) still shows what the doctor adds.
Goal (issue 18): examine's forensic pass (steps=0) <= 10x one fp32 forward + backward on models whose fp32 step
takes >= 5 ms; the tiny MLP shows the fixed overhead. Goal (issue 25): the confirmation (the default examine minus
the forensic pass) <= 1.2x the plain training steps it runs (fp32 and each recipe it trains, ``--steps`` each, through
ampcourse.train.train_step). On a CPU the clock is this process's CPU time (one torch thread; other jobs on a shared
machine do not count); on CUDA, wall time after a synchronize.

Memory: peak bytes above the state after building model, data and optimizer, for one plain training step
(AdamW, fp32) and for examine(), each in a fresh process (CPU: peak resident set size, VmHWM after resetting it
through /proc/self/clear_refs, Linux only; CUDA: torch.cuda.max_memory_allocated). Goal: examine <= 2x the plain
step.

Models: the course's tiny MLP (fixed overhead) and reference transformer (batch 16), Hugging Face GPT-2 and BERT from
tiny configs (2 layers, width 64/128, batch 8 x 32 tokens) and a ResNet-18-like image classifier (transformers'
ResNetForImageClassification with ResNet-18's layout: basic blocks, depths 2-2-2-2, widths 64-128-256-512; random
init, no download) at batch 8, 3 x 64 x 64. torchvision's resnet18 would be the obvious choice, but PyPI's
torchvision does not install beside the CPU torch build this project pins.
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

MODELS = ("mlp", "transformer", "gpt2", "bert", "resnet18")
GOAL = 10.0
CONFIRM_GOAL = 1.2  # issue 25: the confirmation costs at most 1.2x the plain training steps it runs


def setup(name: str, dev: torch.device):
    """(model, inputs, targets, loss_fn) on dev."""
    if name in ("mlp", "transformer"):
        task = make_task(name, n=16)
        x, y = task.data.tensors
        return task.model.to(dev), x.to(dev), y.to(dev), task.loss_fn
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in ("gpt2", "bert"):
        ids = torch.randint(0, 512, (8, 32), generator=g).to(dev)
        if name == "gpt2":
            cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=64,
                                          bos_token_id=0, eos_token_id=0)
            model = transformers.GPT2LMHeadModel(cfg).to(dev)
        else:
            cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=128,
                                          intermediate_size=256, vocab_size=512, max_position_embeddings=64)
            model = transformers.BertForMaskedLM(cfg).to(dev)
        return model, {"input_ids": ids, "labels": ids}, None, None
    cfg = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                    num_labels=10)
    model = transformers.ResNetForImageClassification(cfg).to(dev)
    x, y = torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
    return model, x.to(dev), y.to(dev), lambda out, t: F.cross_entropy(out.logits, t)


def clock(dev: torch.device) -> float:
    """CPU time of this process (CPU) or wall time after a synchronize (CUDA)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return time.perf_counter()
    return time.process_time()


def _loss(model, x, y, loss_fn):
    """The scalar loss of one forward (dict inputs: the model's own loss)."""
    if isinstance(x, dict):
        return model(**x).loss
    return loss_fn(model(x), y)


def fwd_bwd(model, x, y, loss_fn, amp=None) -> None:
    """One forward + backward, in fp32 or under autocast (gradients dropped afterwards)."""
    if amp is None:
        _loss(model, x, y, loss_fn).backward()
    else:
        with amp.autocast():
            loss = _loss(model, x, y, loss_fn)
        loss.float().backward()
    model.zero_grad(set_to_none=True)


def backward_seconds(model, x, y, loss_fn, amp, dev, scale: float = 1.0) -> float:
    """Seconds of one backward under autocast (the forward before it untimed): what the forensic pass's extra fp16
    backward at scale 1 costs the hardware (it runs off the watched pass's own forward graph)."""
    with amp.autocast():
        loss = _loss(model, x, y, loss_fn)
    t0 = clock(dev)
    (loss.float() * scale).backward()
    seconds = clock(dev) - t0
    model.zero_grad(set_to_none=True)
    return seconds


def time_one(fn, dev) -> float:
    t0 = clock(dev)
    fn()
    return clock(dev) - t0


def plain_steps(model, x, y, loss_fn, dev, precision: str, steps: int, scale: float) -> float:
    """Seconds of `steps` plain training steps (AdamW, ampcourse.train.train_step, the course's one AMP step) of a copy
    of the model in one precision on the same batch: what the confirmation trains, without the trial around it."""
    import copy

    from ampcourse.train import train_step
    net = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    amp = pick(dev, precision)
    scaler = amp.make_scaler(init_scale=scale) if precision == "fp16" else amp.make_scaler(enabled=False)
    wrapped = (lambda out, t: out.loss) if isinstance(x, dict) else loss_fn  # noqa: E731

    class Call(torch.nn.Module):  # inputs of any shape through train_step's (x, y) micro-batch
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, _):
            return self.net(**x) if isinstance(x, dict) else self.net(x)
    call = Call()
    t0 = clock(dev)
    for _ in range(steps):
        train_step(call, [(torch.zeros(1), y)], wrapped, opt, scaler, amp)
    return clock(dev) - t0


def timings(name: str, dev: torch.device, repeats: int, steps: int = 10) -> dict:
    """Median seconds of an fp32 forward+backward, of one per precision under autocast, of examine()'s forensic pass
    (steps=0) and of the default examine (confirmed over `steps` steps), interleaved; then the plain training steps
    the confirmation ran (fp32 and each recipe it trained, `steps` each)."""
    model, x, y, loss_fn = setup(name, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amps = {p: pick(dev, p) for p in ("fp16", "bf16")}
    run = lambda n: examine(model, x, y, loss_fn=loss_fn, optimizer=opt, precisions=("fp16", "bf16"),  # noqa: E731
                            steps=n)
    fwd_bwd(model, x, y, loss_fn)  # warm-up: first-call costs (allocator, kernels) are not what we measure
    report = run(steps)
    samples: dict[str, list[float]] = {"fp32 fwd+bwd": [], "fp16 fwd+bwd": [], "bf16 fwd+bwd": [], "fp16 bwd": [],
                                       "examine": [], "examine confirmed": [], "plain steps": []}
    trained = ["fp32", *report.confirmation.get("trained", [])]
    at_1 = "measured" in report.gradients  # the forensic pass ran an extra fp16 backward at scale 1
    for _ in range(repeats):
        samples["fp32 fwd+bwd"].append(time_one(lambda: fwd_bwd(model, x, y, loss_fn), dev))
        for p, amp in amps.items():
            samples[f"{p} fwd+bwd"].append(time_one(lambda: fwd_bwd(model, x, y, loss_fn, amp), dev))
        samples["fp16 bwd"].append(backward_seconds(model, x, y, loss_fn, amps["fp16"], dev))
        samples["examine"].append(time_one(lambda: run(0), dev))
        samples["examine confirmed"].append(time_one(lambda: run(steps), dev))
        samples["plain steps"].append(sum(plain_steps(model, x, y, loss_fn, dev, p, steps, report.recommended_init_scale)
                                          for p in trained))
    med = {k: statistics.median(v) for k, v in samples.items()}
    floor = med["fp32 fwd+bwd"] + med["fp16 fwd+bwd"] + med["bf16 fwd+bwd"]
    # the model's own passes in the forensic pass: fp32, fp16 and bf16 forward + backward, and the fp16 backward at
    # scale 1 where it runs; the rest ("own") is the doctor's instruments, reruns and tables
    forensic_floor = floor + (med["fp16 bwd"] if at_1 else 0.0)
    confirmation = med["examine confirmed"] - med["examine"]
    return {"seconds": med, "ratio": med["examine"] / med["fp32 fwd+bwd"], "hardware_floor": floor,
            "over_floor": med["examine"] / floor, "backward_at_1": at_1, "forensic_floor": forensic_floor,
            "own": med["examine"] - forensic_floor, "own_over_fp32": (med["examine"] - forensic_floor) / med["fp32 fwd+bwd"],
            "steps": steps, "trained": trained,
            "confirmation": confirmation, "confirmation_over_plain_steps": confirmation / med["plain steps"]}


def peak_child(name: str, what: str, device: str) -> None:
    """In a fresh process: print the peak bytes above the post-setup state for 'step' or 'examine'."""
    dev = torch.device(device)
    model, x, y, loss_fn = setup(name, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if dev.type == "cuda":
        # Warm up first: the first GEMMs allocate cuBLAS/cuBLASLt workspaces (tens of MiB on Hopper) that stay
        # allocated; reset after them, or that one-time cost lands in both peaks and hides the ratio.
        fwd_bwd(model, x, y, loss_fn)
        for precision in ("fp16", "bf16"):  # the low-precision GEMMs' workspaces too
            fwd_bwd(model, x, y, loss_fn, pick(dev, precision))
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _reset_peak_rss()
    what, _, measure = what.partition(":")

    def work() -> None:
        if what == "step":
            _loss(model, x, y, loss_fn).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            examine(model, x, y, loss_fn=loss_fn, optimizer=opt, steps=0)  # the forensic pass's memory

    if measure == "tensors":  # CPU: what the allocator gave tensors, as max_memory_allocated counts on CUDA
        print(json.dumps({"peak_above_setup": tensor_peak(work)}))
        return
    work()
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        peak = _status_bytes("VmHWM")
    print(json.dumps({"peak_above_setup": peak - base}))


def tensor_peak(fn) -> int:
    """Peak bytes of CPU tensor memory that fn() allocated above what was live before it: the running sum of the
    allocator's [memory] events, which torch.profiler records with profile_memory=True (every thread's, so autograd's
    too). Unlike the resident set size, it leaves out code, libraries and pages first touched on this call."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
                     and e.device_type() == torch.autograd.DeviceType.CPU), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


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
    """Peak bytes above setup for a plain training step and for examine(), each in its own process: on CUDA the
    allocator's peak; on CPU the resident set size (everything the process touched: code, libraries, first-use pages)
    and, in two more processes, the tensor memory alone ("tensors", the figure comparable with CUDA's)."""
    out: dict = {}
    kinds = [("", "")] + ([(":tensors", "tensors_")] if torch.device(device).type == "cpu" else [])
    for suffix, key in kinds:
        for what in ("step", "examine"):
            run = subprocess.run([sys.executable, __file__, "--child", name, what + suffix, "--device", device],
                                 capture_output=True, text=True, check=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
            out[key + what] = json.loads(run.stdout.strip().splitlines()[-1])["peak_above_setup"]
        out[key + "ratio"] = out[key + "examine"] / out[key + "step"] if out[key + "step"] else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="the confirmation's training steps (examine's default 10)")
    ap.add_argument("--no-memory", action="store_true", help="time only (skip the memory processes)")
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
        t = timings(name, dev, args.repeats, args.steps)
        m = {} if args.no_memory else peaks(name, args.device)
        result["models"][name] = {**t, "memory": m}
        s = t["seconds"]
        big = s["fp32 fwd+bwd"] >= 0.005
        print(f"{name}: fp32 fwd+bwd {s['fp32 fwd+bwd'] * 1e3:.1f} ms, fp16 {s['fp16 fwd+bwd'] * 1e3:.1f} ms, bf16 "
              f"{s['bf16 fwd+bwd'] * 1e3:.1f} ms (autocast fwd+bwd: the hardware's floor {t['hardware_floor'] * 1e3:.0f} "
              f"ms); examine fp16+bf16 {s['examine'] * 1e3:.0f} ms = {t['ratio']:.1f}x fp32 fwd+bwd "
              + (f"(goal <= {GOAL:g}x: {'met' if t['ratio'] <= GOAL else 'missed'})" if big else
                 "(step < 5 ms: fixed overhead)") + f", {t['over_floor']:.2f}x the floor")
        print(f"{name}: the model's own passes in it {t['forensic_floor'] * 1e3:.0f} ms (fp16 backward at scale 1 "
              f"{'included' if t['backward_at_1'] else 'not run'}): the doctor's own work {t['own'] * 1e3:.0f} ms = "
              f"{t['own_over_fp32']:.1f}x fp32 fwd+bwd")
        print(f"{name}: confirmation over {t['steps']} steps of {', '.join(t['trained'])}: {t['confirmation'] * 1e3:.0f} ms"
              f" = {t['confirmation_over_plain_steps']:.2f}x the plain steps it runs ({s['plain steps'] * 1e3:.0f} ms; "
              f"goal <= {CONFIRM_GOAL:g}x); default examine {s['examine confirmed'] * 1e3:.0f} ms")
        if not m:
            continue
        print(f"{name}: peak above setup: plain step {m['step'] / 2**20:.1f} MiB, examine {m['examine'] / 2**20:.1f} MiB "
              f"(ratio {m['ratio']:.2f})" + (f"; tensors alone: plain step {m['tensors_step'] / 2**20:.2f} MiB, examine "
                                             f"{m['tensors_examine'] / 2**20:.2f} MiB (ratio {m['tensors_ratio']:.2f})"
                                             if "tensors_ratio" in m else ""))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
