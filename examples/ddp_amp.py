"""DDP + AMP in one file: autocast, GradScaler and DistributedDataParallel, top to bottom, plain PyTorch.

The same run as ``python -m ampcourse.train --model mlp`` (same model, data, batches and step), written
out without the course's package so you can read a whole distributed mixed-precision program at once.

    # 1 process (no torchrun needed)
    python examples/ddp_amp.py --precision fp16 --steps 50
    # N processes on one node: one per GPU (NCCL), or N CPU processes (gloo) on a machine without GPUs
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 examples/ddp_amp.py --precision fp16

Rank 0 writes the final weights to --out (a state_dict of CPU tensors: torch.load(weights_only=True) reads it back on
any machine, with or without a GPU).
"""

import argparse
import contextlib
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
p.add_argument("--steps", type=int, default=50)
p.add_argument("--global-batch-size", type=int, default=64, help="samples per step, over all ranks")
p.add_argument("--samples", type=int, default=1024)
p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--out", default=None, help="where rank 0 saves the final state_dict")

# --- processes: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without torchrun we are rank 0 of 1 ---
ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))


def fail(message):
    """One line on stderr and exit 2, before any work (every rank exits; only local rank 0 says why)."""
    if local_rank == 0:
        print(f"ddp_amp.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


p.error = fail  # argparse's own errors: the same one line
args = p.parse_args()
# Check the numbers now: a zero batch or a NaN lr would otherwise fail deep inside the loop or torch.optim,
# and a bad --out only after the whole run.
for flag, value, low in (("--steps", args.steps, 1), ("--global-batch-size", args.global_batch_size, 1),
                         ("--seed", args.seed, 0)):
    if value < low:
        fail(f"{flag} must be >= {low}, got {value}")
if not args.global_batch_size <= args.samples:
    fail(f"--global-batch-size {args.global_batch_size} is larger than --samples {args.samples}")
if args.global_batch_size % world_size:
    fail(f"--global-batch-size {args.global_batch_size} must divide by the number of processes ({world_size})")
if not (math.isfinite(args.lr) and 0 < args.lr <= torch.finfo(torch.float32).max):
    fail(f"--lr must be a finite number > 0 (float32's range), got {args.lr}")
if args.device == "cuda" and not torch.cuda.is_available():
    fail("--device cuda, but this torch sees no CUDA GPU; use --device cpu or auto")
if args.out and (os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out)))):
    fail(f"--out {args.out!r} is a folder or its folder does not exist; pass a file path such as weights.pt")
# The save below writes a temp file and renames it over --out: over a device (/dev/null), a pipe or a socket that
# would put a regular file where the node was (as root, /dev/null itself); refused here. A link is followed.
if args.out and os.path.exists(args.out) and not os.path.isfile(args.out):
    fail(f"--out {args.out!r} exists and is not a regular file (a device, a pipe); pass a file path such as weights.pt")
device_type = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
# One GPU per process: more processes on this node than GPUs would reach set_device("cuda:N") below and fail there
# with CUDA's "invalid device ordinal". LOCAL_WORLD_SIZE (set by torchrun) lets every rank refuse alike.
node_procs = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1)
if device_type == "cuda" and node_procs > torch.cuda.device_count():
    fail(f"{node_procs} processes on this node (torchrun --nproc-per-node) but {torch.cuda.device_count()} CUDA "
         f"GPU(s); use --nproc-per-node {torch.cuda.device_count()} or fewer, or --device cpu")
device = torch.device(f"cuda:{local_rank}" if device_type == "cuda" else "cpu")
if ddp:
    if device_type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts: each process owns one GPU
    # A bounded timeout: a rank that dies must not leave the others waiting forever in a collective.
    # Exposure: rank 0 hosts the rendezvous TCPStore at MASTER_ADDR:MASTER_PORT, and in torch 2.13 it listens on
    # every address of the machine even when MASTER_ADDR is 127.0.0.1 (so does torchrun --standalone's own store).
    # Run it on a trusted network; ampcourse.distributed.init and launch keep a one-node job on loopback.
    # device_id binds NCCL's communicator to this rank's GPU now (without it NCCL guesses the device at the first
    # collective, and barrier() warns that it may hang); gloo on the CPU takes none.
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120),
                            **({"device_id": device} if device_type == "cuda" else {}))

# --- precision, chosen once: the autocast dtype, and a GradScaler that is on only for fp16 ---
amp_dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
autocast = (torch.amp.autocast(device_type=device_type, dtype=amp_dtype) if amp_dtype is not None
            else contextlib.nullcontext())
# bf16 has fp32's exponent range, so only fp16 needs loss scaling (a disabled scaler passes values through)
scaler = torch.amp.GradScaler(device_type, enabled=args.precision == "fp16")


# --- the model: the course's MLP (two hidden layers, GELU) ---
class MLP(nn.Module):
    def __init__(self, in_features=32, hidden=64, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


with torch.random.fork_rng(devices=[]):
    torch.manual_seed(args.seed)  # every rank builds the same initial weights (DDP also broadcasts rank 0's)
    model = MLP()
model = model.to(device)  # weights stay fp32: autocast makes low-precision copies per op
net = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None) if ddp else model

# --- the data: Gaussian inputs labelled by a fixed random teacher (the same on every rank) ---
gen = torch.Generator().manual_seed(args.seed)
xs = torch.randn(args.samples, 32, generator=gen)
ys = (xs @ torch.randn(32, 10, generator=gen)).argmax(1)


def local_batch(step):
    """This rank's slice of the global batch of `step`: a seeded permutation per epoch, cut into batches."""
    per_epoch = args.samples // args.global_batch_size
    epoch, pos = divmod(step, per_epoch)
    mixed = (args.seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2**63)  # one stream per epoch
    perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(mixed))
    batch = perm[pos * args.global_batch_size:(pos + 1) * args.global_batch_size]
    local = args.global_batch_size // world_size
    idx = batch[rank * local:(rank + 1) * local]
    return xs[idx].to(device), ys[idx].to(device)


if args.optimizer == "adamw":
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)  # as ampcourse.train's default
else:
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)

# --- the loop: one AMP step per iteration, the same on every rank ---
torch.manual_seed(args.seed)
for step in range(args.steps):
    x, y = local_batch(step)
    optimizer.zero_grad(set_to_none=True)
    with autocast:  # forward and loss only; backward runs outside autocast (it follows the forward's dtypes)
        loss = F.cross_entropy(net(x), y)
    # DDP all-reduces (averages) the SCALED fp32 gradients during backward, bucket by bucket
    scaler.scale(loss).backward()
    # After the all-reduce every rank holds the same gradients: an inf on any rank is now on every rank,
    # so unscale_ finds it everywhere, every rank skips the step, and the replicas stay identical.
    scaler.unscale_(optimizer)  # .grad now holds true gradients (clip here if you clip)
    scaler.step(optimizer)  # skips optimizer.step() if unscale_ found inf/nan
    scaler.update()  # halve the scale after a skip; double it after 2000 clean steps
    if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
        # loss.item() syncs with the GPU: fine every 10 steps, wasteful every step
        print(f"step {step:4d}  loss (rank 0's slice) {loss.item():.4f}  scale {scaler.get_scale():g}")

# --- the end: rank 0 saves; everyone waits for it, then the process group goes down ---
if rank == 0 and args.out:
    # the module's keys, without DDP's "module." prefix; written to a temp file and renamed over --out, so an
    # interrupted save (Ctrl-C, a full disk) never leaves a truncated file where a good one was
    out = os.path.realpath(args.out)  # through a link to its file: the link stays
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        # CPU copies: a file of CUDA tensors cannot be loaded on a machine without one (without map_location)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
if ddp:
    dist.barrier()  # nobody shuts down while rank 0 is still writing
    dist.destroy_process_group()
    # Why os._exit and not a plain return: with a normal interpreter shutdown after a gloo DDP run, a rank
    # occasionally aborts while Python finalizes ("terminate called without an active exception", SIGABRT;
    # measured with torch 2.13 CPU, 2 ranks: 1 of 49 runs, so torchrun reports the job failed). Native
    # threads of torch.distributed and autograd still run while the interpreter is torn down
    # (pytorch/pytorch#190489, open; an atexit fix, pytorch/pytorch#179291, was abandoned). os._exit skips
    # that teardown, and with it atexit handlers and buffer flushes: everything is saved and the group is
    # destroyed above, so flush the two streams by hand and leave. Do not copy this into code that has
    # atexit work to do; a single process (no torchrun) ends normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
