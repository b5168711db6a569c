"""``python -m ampcourse.train``: one process, or one torchrun worker (launch commands: ``ampcourse.train``'s docstring).

Under torchrun, rank 0 logs, shows the progress bar and writes --out; --strategy ddp wraps the model in
DistributedDataParallel, --strategy fsdp shards it with FSDP2 (``ampcourse.distributed``). The summary holds world
size, backend (nccl/gloo), device type, precision, steps, skipped steps, the final loss of the global batch, the
final loss scale and a checksum of the final (full) parameters.

Every error, from argparse or from the checks, is one line ``ampcourse.train: error: ...`` on stderr and exit
status 2 (``_args.cli_error``); under torchrun only local rank 0 prints it, the other workers exit quietly.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _args, checkpoint, distributed, inputs, models
from ..device import default_rule, pick
from .loop import Parallel, train
from .step import OPTIMIZERS, make_optimizer, state_checksum

__all__ = ["STRATEGIES", "main"]

PROG = "ampcourse.train"
STRATEGIES = ("single", "ddp", "fsdp")  # ddp and fsdp run under torchrun, through ampcourse.distributed


def _rank_step(text: str) -> tuple[int, int]:
    """argparse type for RANK:STEP."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP (two ints), got {text!r}") from None
    if rank < 0 or step < 0:
        raise argparse.ArgumentTypeError(f"RANK and STEP must be >= 0, got {text!r}")
    return rank, step


def _parser() -> argparse.ArgumentParser:
    """The argparse parser for python -m ampcourse.train (every default in --help: _args.HelpFormatter)."""
    p = _args.OneLineParser(prog="python -m ampcourse.train", error_prefix=PROG, formatter_class=_args.HelpFormatter,
                            description="Train a reference model with AMP and write a JSON summary. "
                                        "Under torchrun, --strategy ddp|fsdp trains on every process.")
    p.add_argument("--model", choices=models.MODELS, default="mlp", help="the reference model")
    # no argparse choices: read by the one reader of precision names (_plan), so 'BF16' or 'half' work as in trial
    p.add_argument("--precision", "--precisions", default=None,
                   help=f"fp32, fp16 or bf16 (or a dtype name: bfloat16, half, ...); default: pick()'s choice for "
                        f"the device: {default_rule()}")
    p.add_argument("--strategy", choices=STRATEGIES, default="single",
                   help="single: one process; ddp (DistributedDataParallel) and fsdp (FSDP2): under torchrun")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    # --batch-size and --batch: the names trial and the doctor/plan use, so a learner's guess works here too
    p.add_argument("--global-batch-size", "--batch-size", "--batch", dest="global_batch_size", type=int, default=64,
                   help="samples per optimizer step, all ranks together")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW) or L2 (Adam, SGD)")
    p.add_argument("--grad-clip", type=float, default=None,
                   help="clip the true (unscaled) gradient norm to this value (default: no clipping)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="the optimizer")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="fused Adam/AdamW kernel (no host sync in the scaler's step); default: on for CUDA")
    p.add_argument("--seed", type=int, default=0, help="seed for the model, the data and the batch order")
    p.add_argument("--size", choices=tuple(models.SIZES), default="tiny", help="reference model size")
    p.add_argument("--samples", type=int, default=1024, help="synthetic dataset size")
    p.add_argument("--checkpoint-dir", default=None,
                   help="shared by all ranks (on every node) (default: none, nothing is saved)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="save every N steps (default: only after the last step)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir (after a torchrun restart this happens by itself)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: best available; "
                                                  "under torchrun: cuda:LOCAL_RANK or cpu)")
    p.add_argument("--out", default=None, metavar="SUMMARY.json", help="write the summary here (default: stdout)")
    p.add_argument("--history-out", default=None, metavar="HISTORY.json",
                   help="write every rank's per-step loss, scale and skipped flags here (rank 0 writes; "
                        "default: not written)")
    p.add_argument("--dist-timeout", type=float, default=distributed.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on every collective (default {distributed.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--rdzv-timeout", type=float, default=distributed.DEFAULT_RENDEZVOUS_TIMEOUT_S, metavar="SECONDS",
                   help="bound on the rendezvous and process-group setup: every worker must have started by then "
                        f"(default {distributed.DEFAULT_RENDEZVOUS_TIMEOUT_S:g}; a cold multi-GPU node can take minutes)")
    p.add_argument("--inject-inf", type=_rank_step, default=None, metavar="RANK:STEP",
                   help="teaching aid: make RANK's gradients non-finite (before they are averaged across ranks) "
                        "in the STEP-th step this launch runs, counting from 0 (default: none)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


@dataclass(frozen=True)
class _Plan:
    """What main() decided before any process group exists."""

    device: str | None
    resume: bool
    checkpointer: Any


#: train()'s argument names as this command line spells them: its checks name the Python argument.
_FLAGS = {**_args.COMMON_FLAGS, "accum_steps": "--accum-steps", "batch_size": "--global-batch-size",
          "n_samples": "--samples", "grad_clip": "--grad-clip", "weight_decay": "--weight-decay",
          "checkpoint_every": "--checkpoint-every", "checkpoint_dir": "--checkpoint-dir", "resume": "--resume"}


def _as_flags(message: str) -> str:
    """message with train()'s argument names spelled as this CLI's flags (_args.as_flags, shared by every CLI).

    Only the opening name ("steps must be ...", "batch_size 64 is larger ..."), ``name=value`` and 'checkpoint_dir'
    are renamed: the same words elsewhere are prose ("the steps of the first run").
    """
    return _args.as_flags(message, _FLAGS, bare=("checkpoint_dir",))


def _fail(message: str, local_rank: int) -> None:
    """Exit 2 with one line; under torchrun only local rank 0 prints it (the others would repeat it)."""
    _args.cli_error(PROG, _as_flags(message), quiet=local_rank != 0)


def _plan(args: argparse.Namespace, env) -> _Plan:
    """All the checks that need no process group: strategy vs launcher, devices, batch split, checkpoints."""
    _args.output_files([("--out", args.out), ("--history-out", args.history_out)])  # fail before training
    if args.precision is not None:  # 'BF16', 'half', 'bfloat16' read as in every other CLI
        args.precision = inputs.cli_precision(args.precision, "--precision")
    if args.checkpoint_dir is not None:
        _args.as_path(args.checkpoint_dir, "--checkpoint-dir")  # a NUL byte named by its flag
    if args.strategy == "single":
        if env.world_size > 1:
            raise ValueError(f"--strategy single runs one process, but torchrun started WORLD_SIZE={env.world_size}; "
                             "use --strategy ddp or fsdp")
        device = args.device
    else:
        if not env.launched:
            raise ValueError(f"--strategy {args.strategy} runs under torchrun: torchrun --standalone "
                             f"--nproc-per-node N -m ampcourse.train --strategy {args.strategy} ... "
                             "(see the module docstring)")
        device = distributed.worker_device(env, args.device)
    for flag, seconds in (("--dist-timeout", args.dist_timeout), ("--rdzv-timeout", args.rdzv_timeout)):
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds!r}")
    split = env.world_size * args.accum_steps
    if args.global_batch_size >= 1 and args.accum_steps >= 1 and args.global_batch_size % split:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must divide by world size x accum steps = "
                         f"{env.world_size} x {args.accum_steps}, so every rank gets the same number of samples")
    if args.fused and args.optimizer == "sgd":  # before any process group: it would be ignored silently
        raise ValueError("--fused applies to --optimizer adam and adamw only; leave it out for sgd")
    if args.inject_inf is not None and args.inject_inf[1] >= args.steps >= 1:  # the teaching aid would never fire
        raise ValueError(f"--inject-inf {args.inject_inf[0]}:{args.inject_inf[1]}: this launch runs at most "
                         f"--steps {args.steps} steps (0..{args.steps - 1}); choose a STEP below {args.steps}")
    if args.inject_inf is not None and args.inject_inf[0] >= env.world_size:
        raise ValueError(f"--inject-inf {args.inject_inf[0]}:{args.inject_inf[1]}: there is no rank "
                         f"{args.inject_inf[0]} in a world of {env.world_size}")
    store = (checkpoint.ShardedCheckpointer(env.rank) if args.strategy == "fsdp"
             else checkpoint.FileCheckpointer(env.rank))
    resume = args.resume
    if args.checkpoint_dir is not None:
        here = store.path(args.checkpoint_dir).exists()
        other = (checkpoint.FileCheckpointer() if args.strategy == "fsdp" else checkpoint.ShardedCheckpointer())
        if args.resume and not here and other.path(args.checkpoint_dir).exists():
            raise ValueError(f"--resume: {args.checkpoint_dir!r} holds a {other.kind}, and --strategy {args.strategy} "
                             f"resumes from a {store.kind}; resume with the strategy that wrote it")
        if args.resume and not here:  # now, not after every rank has joined a process group
            raise ValueError(f"--resume: there is no checkpoint at {str(store.path(args.checkpoint_dir))!r}; "
                             "run once without resume (with this --checkpoint-dir) to create one")
        if env.restart_count > 0 and here:
            resume = True  # torchrun restarted the workers after a failure: continue from the last checkpoint
    return _Plan(device=device, resume=resume, checkpointer=store)


def _inject_inf(rank: int, step: int, accum_steps: int, loss_fn: Callable) -> Callable:
    """loss_fn that gives the logits one infinite gradient entry on `rank` in this launch's `step`-th step."""
    calls = {"n": 0}

    def wrapped(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if me == rank and calls["n"] == step * accum_steps:
            # One entry of dLoss/dlogits becomes inf, as when an fp16 backward overflows on this rank only;
            # every parameter gradient upstream turns inf/nan here, before DDP or FSDP2 averages them.
            logits.register_hook(lambda g: g.index_fill(-1, torch.tensor([0], device=g.device), float("inf")))
        calls["n"] += 1
        return loss_fn(logits, target)
    return wrapped


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI (one process, or one torchrun worker); bad arguments and failures exit 2 with one line."""
    args = _parser().parse_args(argv)
    try:
        env = distributed.torchrun_env()
    except ValueError as err:
        _args.cli_error(PROG, str(err))
    try:
        plan = _plan(args, env)
    except (ValueError, TypeError) as err:
        _fail(str(err), env.local_rank)
    warning = distributed.shared_store_warning(env)
    if warning and env.is_main and env.restart_count == 0:  # once per job, from rank 0
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    if env.restart_count > 0 and env.is_main:
        print(f"{PROG}: torchrun restart {env.restart_count}: "
              + ("resuming from the last checkpoint" if plan.resume else "no checkpoint yet, starting over"),
              file=sys.stderr, flush=True)
    try:
        try:
            summary, history = _run(args, env, plan)
        except BaseException:
            distributed.teardown()
            raise
        distributed.teardown(barrier=True)  # every rank is done communicating before any rank shuts down
    except (ValueError, TypeError) as err:  # includes CheckpointError (a full disk while saving, too)
        _fail(str(err), env.local_rank)
    except KeyboardInterrupt:  # Ctrl-C: one line saying what is kept, not a traceback from inside the step
        _args.cli_error(PROG, _interrupted(args, plan), code=130, quiet=env.local_rank != 0)
    if env.is_main:
        _report(args, summary, history)
    return 0


def _interrupted(args: argparse.Namespace, plan: _Plan) -> str:
    """What Ctrl-C left behind: the last complete checkpoint (writes are atomic) and how to go on from it."""
    if args.checkpoint_dir is None:
        return "interrupted; nothing was saved (pass --checkpoint-dir DIR --checkpoint-every N to keep progress)"
    if plan.checkpointer.path(args.checkpoint_dir).exists():
        return (f"interrupted; the last complete checkpoint in {args.checkpoint_dir!r} is intact: add --resume "
                "to the same command to continue from it")
    return (f"interrupted before the first checkpoint in {args.checkpoint_dir!r}; rerun the same command "
            "(without --resume) to start again")


def _report(args: argparse.Namespace, summary: dict, history: dict | None) -> None:
    """Rank 0 writes --history-out and --out (or prints the summary); a write that fails is one line, not a traceback."""
    text = json.dumps(summary, indent=2)
    try:
        if args.history_out is not None:
            Path(args.history_out).write_text(json.dumps(history) + "\n")
        if args.out is not None:
            Path(args.out).write_text(text + "\n")
            print(f"{PROG}: {summary['steps_done']} steps on {summary['world_size']} process"
                  f"{'es' if summary['world_size'] > 1 else ''}, final loss {summary['final_loss']:.4g}, "
                  f"{summary['skipped_steps']} skipped; summary in {args.out}")
        else:
            print(text)
        sys.stdout.flush()  # a full or size-limited stdout (EFBIG) fails here, inside the handler
    except OSError as err:  # ENOSPC, EFBIG (a file-size limit), EIO, ...
        _args.cli_error(PROG, f"cannot write the output: {err.strerror or err}")


def _run(args: argparse.Namespace, env, plan: _Plan) -> tuple[dict, dict | None]:
    """Start the process group (ddp/fsdp), train, and build the summary (collectives on every rank)."""
    ctx, wrap = None, None
    if args.strategy != "single":
        ctx = distributed.init(plan.device, env, timeout_s=args.dist_timeout, rendezvous_timeout_s=args.rdzv_timeout)
        if args.strategy == "fsdp":
            problem = distributed.fsdp_problem(ctx.device.type)
            if problem:
                raise ValueError(f"--strategy fsdp cannot run here: {problem}; use --strategy ddp")
        amp = pick(plan.device, args.precision)
        wrap = functools.partial(distributed.wrap_model, strategy=args.strategy, amp=amp, ctx=ctx)
    made: list[torch.optim.Optimizer] = []

    def optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        made.append(make_optimizer(args.optimizer, params, lr, weight_decay, fused=args.fused))  # kept for the memory report
        return made[-1]

    loss = (models.loss_fn if args.inject_inf is None
            else _inject_inf(*args.inject_inf, args.accum_steps, models.loss_fn))
    hist = train(args.model, None, precision=args.precision, steps=args.steps, lr=args.lr, seed=args.seed,
                 device=plan.device, grad_clip=args.grad_clip, accum_steps=args.accum_steps,
                 checkpoint_dir=args.checkpoint_dir, resume=plan.resume, batch_size=args.global_batch_size,
                 checkpoint_every=args.checkpoint_every, optimizer=optimizer, weight_decay=args.weight_decay,
                 progress=not args.no_progress, size=args.size, n_samples=args.samples, loss_fn=loss,
                 parallel=Parallel(rank=env.rank, world_size=env.world_size, wrap=wrap, checkpointer=plan.checkpointer,
                                   autocast=args.strategy != "fsdp"))
    hist.backend = ctx.backend if ctx is not None else "none"
    summary = hist.summary()  # for FSDP2 the checksum gathers the shards: every rank takes part
    # Each rank's loss is over its slice of the global batch; their mean is the global batch's loss.
    summary["final_loss"] = sum(distributed.gather(hist.final_loss)) / env.world_size
    summary.update({"strategy": args.strategy, "model": args.model, "seed": args.seed,
                    "global_batch_size": args.global_batch_size, "resumed_from_step": hist.start_step})
    history = None
    if args.history_out is not None:
        mine = {"rank": env.rank, **hist.series(), "final_scale": hist.final_scale,
                "state_bytes": distributed.local_state_bytes(hist.model, made[0]),
                "peak_cuda_bytes": hist.peak_device_bytes,  # whichever device train() picked, after its preflight
                # DDP replicas must stay identical; FSDP2 ranks hold different shards, so no per-rank checksum
                "replica_checksum": None if args.strategy == "fsdp" else state_checksum(hist.model)}
        ranks = distributed.gather(mine)
        history = {"strategy": args.strategy, "world_size": env.world_size, "precision": hist.precision,
                   "ranks": ranks}
    return summary, history
