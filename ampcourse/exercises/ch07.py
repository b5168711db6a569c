"""Chapter 7 exercises: data parallelism by hand with a consistent skip, bytes per GPU under DDP vs FSDP2, and
four exercises whose solutions run on N ranks under torchrun (7.3-7.6; see _torchrun.py).

`_torchrun` is imported where a launch happens, never at import: torchrun runs it as a script
(``-m ampcourse.exercises._torchrun``), and a module the package already imported would make runpy warn
in every worker, on every launch.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .. import distributed
from ..distributed import memory_per_gpu
from ._core import failed, passed

if TYPE_CHECKING:
    from ._torchrun import RankResults

__all__ = ["check_data_parallel_step", "check_state_bytes", "check_rank_step", "check_compressed_ddp",
           "check_fsdp_policy", "check_restartable"]

_SCALE = 2.0**10
_LR = 0.5
# Local batches with small integers: every autocast dtype (fp16, bf16) computes the gradient y^T x exactly,
# so the checker knows each replica's gradient to the bit, whatever precision the learner picked.
_BATCHES = [(torch.tensor([[1.0, 2.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 2.0]])),
            (torch.tensor([[0.0, 1.0, 3.0, 1.0]]), torch.tensor([[2.0, 1.0, 0.0]]))]


def _probe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(out * y).sum(): for a bias-free linear layer, d loss / d weight = y^T x, whatever the weights."""
    return (out.float() * y).sum()


def _replicas(n: int) -> list[nn.Linear]:
    """n identical Linear(4 -> 3) models without bias, weights zero."""
    models = []
    for _ in range(n):
        m = nn.Linear(4, 3, bias=False)
        with torch.no_grad():
            m.weight.zero_()
        models.append(m)
    return models


def _overflow_on(model: nn.Module, when: dict) -> None:
    """Make this replica's backward overflow (inf in its output gradient) while when['now'] is True."""

    def hook(module, inputs, output):
        if when["now"]:
            output.register_hook(lambda g: g.index_fill(-1, torch.tensor([0], device=g.device), math.inf))
    model.register_forward_hook(hook)


def _call(title: str, fn: Callable, *args) -> None:
    """Run the learner's step, turning its exceptions into feedback."""
    if not callable(fn):
        failed(title, "a function", f"{type(fn).__name__} {fn!r}", "pass the function itself, without calling it")
    try:
        fn(*args)
    except NotImplementedError:
        failed(title, "an implementation", "NotImplementedError",
               "replace the `raise NotImplementedError` stub with your code")
    except Exception as err:  # the learner's code: report any failure as feedback
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if "already been called since the last update" in text:
            hint = "call scaler.update() after scaler.step(optimizer), on every replica, every step"
        elif "No inf checks were recorded" in text:
            hint = ("let scaler.step(optimizer) take the step (not optimizer.step()): it skips optimizer.step() "
                    "when unscale_ found inf/nan")
        else:
            hint = "run your step on the two replicas and read the error"
        failed(title, "your step function to run", f"{type(err).__name__}: {text}", hint)


def _weights(models: list[nn.Module]) -> list[torch.Tensor]:
    """A detached copy of each replica's weight."""
    return [m.weight.detach().clone() for m in models]


def check_data_parallel_step(data_parallel_step: Callable) -> None:
    """Exercise 7.1: data_parallel_step(replicas, batches, optimizers, scalers, loss_fn) is one AMP step of
    data parallelism by hand: every replica skips when any replica's gradient overflows."""
    title = "Exercise 7.1 (data parallelism by hand, with a consistent skip)"
    replicas = _replicas(2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=_LR) for m in replicas]
    scalers = [torch.amp.GradScaler("cpu", init_scale=_SCALE) for _ in replicas]
    when = {"now": False}
    _overflow_on(replicas[1], when)
    grads = [y.t() @ x for x, y in _BATCHES]  # each replica's true gradient of its local loss
    mean = sum(grads) / len(grads)

    for step, overflow in enumerate([False, True, False]):
        when["now"] = overflow
        before = _weights(replicas)
        _call(title, data_parallel_step, replicas, _BATCHES, optimizers, scalers, _probe_loss)
        after = _weights(replicas)
        scales = [s.get_scale() for s in scalers]
        if len(set(scales)) > 1:
            failed(title, f"the same loss scale on every replica after step {step}", scales,
                   "every replica must find the same inf: the inf check (scaler.unscale_ or scaler.step) must come "
                   "after the gradients were averaged, so one replica's inf reaches all of them through the average")
        if not torch.equal(after[0], after[1]):
            moved = [not torch.equal(a, b) for a, b in zip(after, before)]
            hint = ("one replica stepped while the other skipped: the inf check happened before the gradients were "
                    "averaged (unscale_ looks for inf/nan; call it only after averaging)" if moved.count(True) == 1
                    else "replace every replica's gradient with the mean over replicas before the optimizer step: "
                         "that is what DDP's all-reduce does during backward")
            failed(title, f"identical replicas after step {step}",
                   f"replica weights differ by {(after[0] - after[1]).abs().max().item():.3g}", hint)
        if overflow:
            if not all(torch.equal(a, b) for a, b in zip(after, before)):
                failed(title, "every replica skipped the step with the overflow (weights unchanged)",
                       "weights changed" if all(torch.isfinite(a).all() for a in after) else "non-finite weights",
                       "let scaler.step(optimizer) decide: it skips optimizer.step() when unscale_ found inf/nan")
            if scales[0] != _SCALE / 2:
                failed(title, f"scale {_SCALE / 2:g} after the overflow", scales[0],
                       "call scaler.update() after scaler.step(optimizer), on every replica, every step")
            continue
        want = before[0] - _LR * mean
        if not torch.allclose(after[0], want, atol=1e-6):
            got = (before[0] - after[0]) / _LR
            summed = torch.allclose(got, sum(grads), atol=1e-6)
            hint = ("the update is as large as the SUM of the replicas' gradients: divide by the number of "
                    "replicas (average, as DDP does)" if summed else
                    "zero each replica's gradients first, scale the loss with its scaler, average the scaled "
                    "gradients across replicas, then scaler.step(optimizer) and scaler.update()")
            failed(title, f"weights {want.flatten().tolist()} after step {step} (one SGD step on the mean gradient)",
                   after[0].flatten().tolist(), hint)
    passed(title, "Both replicas stepped on the mean gradient, and both skipped when one of them overflowed.")


# (n_params, world_size, strategy) cases: DDP and FSDP2, one GPU and many
_CASES = [(1_000_000, 1, "ddp"), (1_000_000, 8, "ddp"), (1_000_000, 8, "fsdp"), (7_000_000_000, 64, "fsdp"),
          (350_000_000, 4, "fsdp"), (350_000_000, 1, "fsdp")]


def _diagnose(n: int, world: int, strategy: str, got: float) -> str:
    """A hint naming the likely mistake behind a wrong byte count."""
    share = 1 if strategy == "ddp" else world
    per = got * share / n if n else math.nan
    if strategy == "ddp" and world > 1 and math.isclose(got, 16 * n / world, rel_tol=1e-3):
        return "DDP keeps a full replica (weights, gradients, optimizer state) on every GPU: nothing is divided"
    if strategy == "fsdp" and world > 1 and math.isclose(got, 16 * n, rel_tol=1e-3):
        return "FSDP2 shards weights, gradients and optimizer state: each GPU holds 1/world_size of each"
    for bytes_per, why in [(8, "AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per parameter: 8 bytes"),
                           (12, "count the gradients too: one fp32 gradient per parameter"),
                           (14, "AMP keeps weights and gradients in fp32 (autocast casts copies): 4 bytes each"),
                           (10, "AMP keeps weights and gradients in fp32 (autocast casts copies): 4 bytes each"),
                           (18, "count the fp32 weights once (4 bytes); the 2-byte autocast copy is transient")]:
        if math.isclose(per, bytes_per, rel_tol=1e-3):
            return why
    return "weights 4 + gradients 4 + AdamW moments 4 + 4 bytes per parameter, divided by world_size under FSDP2"


def check_state_bytes(state_bytes: Callable) -> None:
    """Exercise 7.2: state_bytes(n_params, world_size, strategy) -> bytes per GPU of weights, gradients and
    AdamW state under AMP, for 'ddp' and 'fsdp'."""
    title = "Exercise 7.2 (bytes per GPU under DDP and FSDP2)"
    if not callable(state_bytes):
        failed(title, "a function", f"{type(state_bytes).__name__} {state_bytes!r}",
               "pass the function itself, without calling it")
    for n, world, strategy in _CASES:
        want = memory_per_gpu(n, world, strategy)["total"]
        try:
            got = state_bytes(n, world, strategy)
        except NotImplementedError:
            failed(title, "an implementation", "NotImplementedError",
                   "replace the `raise NotImplementedError` stub with your code")
        except Exception as err:  # the learner's code
            failed(title, f"a number for {(n, world, strategy)}", f"{type(err).__name__}: {err}",
                   "run your function on that input and read the error")
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-3):
            failed(title, f"{want:,.0f} bytes for {n:,} parameters on {world} GPU(s) with {strategy}", got,
                   _diagnose(n, world, strategy, got) if isinstance(got, (int, float)) else "return a number")
    passed(title, "16 bytes per parameter under AMP + AdamW: all of them on every GPU with DDP, "
                  "1/world_size of them with FSDP2.")


# =============================================================================================
# Exercises 7.3-7.6: the learner's code runs on N ranks under torchrun (see _torchrun.py)
# =============================================================================================

_RUNNERS = "ampcourse.exercises.ch07"
#: The project's DDP tolerance: two correct implementations may differ in the order of a sum, no more.
ULPS = 4


def _launch_and_judge(title: str, fn: Callable, runner: str, judge: Callable[[str, RankResults, str], None], *,
                      reference: Callable | None = None, nproc: int | None, device: str | None, **launch) -> None:
    """The steps every torchrun checker takes: the learner's source, one launch of `runner` on N ranks (with the
    package's `reference` solution in the same launch, if given), then `judge`'s verdict on the learner's run."""
    from ._torchrun import learner_source, run_on_ranks

    solutions = {"yours": (learner_source(title, fn), fn.__name__)}
    if reference is not None:
        solutions = {"reference": (inspect.getsource(reference), reference.__name__), **solutions}
    judge(title, run_on_ranks(title, f"{_RUNNERS}:{runner}", solutions, nproc=nproc, device=device, **launch), "yours")


def _no_time_limit(check: Callable) -> Callable:
    """Mark a torchrun checker: its launch bounds itself (run_on_ranks' timeout), so _core adds no limit."""
    check.time_limit_s = None  # type: ignore[attr-defined]
    return check


class LearnerExit(RuntimeError):
    """The learner's function called sys.exit() on a rank (reported as that rank's error)."""


def _guarded(fn: Callable) -> Callable:
    """The learner's function, with sys.exit() turned into an error of that rank: otherwise the worker would end
    without a result, and the verdict would blame a crash outside the learner's code."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as stop:
            raise LearnerExit(f"your function called sys.exit({stop.code!r})") from None
    return run


#: What a rank reports when the rank it waits for in a collective has left (gloo) or never came (timeouts).
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker|Broken pipe|"
                        r"timed? ?out|Timeout", re.IGNORECASE)


def _tiny_model(device: torch.device, seed: int = 0) -> nn.Module:
    """The same small MLP on every rank (seeded), in fp32 on `device`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    return model.to(device)


def _global_batch(step: int, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (classification, 4 classes), the same on every rank."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(size, 8, generator=gen)
    return x, (x[:, :4] * 3).argmax(1)


def _local(step: int, rank: int, world: int, device: torch.device, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of the global batch."""
    x, y = _global_batch(step, size)
    n = size // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


def _flat(model: nn.Module) -> torch.Tensor:
    """All parameters as one fp32 CPU vector (full tensors for FSDP2's DTensors)."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in parts])


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of a and b in fp32 ulps of b's largest entry (the project's DDP tolerance unit)."""
    unit = torch.finfo(torch.float32).eps * max(b.abs().max().item(), torch.finfo(torch.float32).tiny)
    return (a - b).abs().max().item() / unit


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, counting NaN == NaN (a rank that stepped on an inf holds NaNs)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _rank_errors(title: str, res: RankResults, name: str, hint: str) -> None:
    """Feedback naming the first rank whose run of the learner's function raised."""
    errors = res.errors(name)
    if errors:
        rank, text = errors[0]
        if "LearnerExit" in text:
            failed(title, "your function to return on every rank", f"rank {rank}: {text.split(': ', 1)[-1]}",
                   "return from your function instead: sys.exit() ends that rank's process, and the other ranks "
                   "then wait for it in their next collective")
        if _PEER_GONE.search(text):
            from ._torchrun import _hang_hint

            clean = [r for r in range(res.nproc) if r not in {e[0] for e in errors}]
            failed(title, "every rank to call the same collectives",
                   f"rank {rank} waited in a collective that " + (f"rank{'s' if len(clean) > 1 else ''} "
                   f"{', '.join(map(str, clean))} never called (it finished and left)" if clean else
                   "another rank never reached") + f" ({text.split(': ', 1)[0]}: {_PEER_GONE.search(text).group(0)})",
                   _hang_hint(title))
        if "NotImplementedError" in text:
            failed(title, "an implementation", "NotImplementedError",
                   "replace the `raise NotImplementedError` stub with your code")
        if "communication hook required CUDA" in text:
            hint = ("DDP's built-in bf16_compress_hook runs on NCCL only; on gloo write the same hook yourself: "
                    "hook(state, bucket) sends bucket.buffer() as bf16 and copies the mean back")
        if "NameError" in text:
            hint = ("your function runs in fresh processes: it sees only torch, dist, nn, os, math and what it "
                    "imports itself, not the notebook's variables")
        failed(title, "your function to run on every rank", f"rank {rank} raised {text}", hint)


# --- 7.3 data parallelism by hand, on real ranks ----------------------------------------------

_DP_STEPS, _DP_INF_STEP, _DP_LR, _DP_SCALE = 4, 2, 0.1, 2.0**10


def reference_rank_step(model, loss_fn, x, y, optimizer, scaler):
    """One AMP step of data parallelism without DDP, on this rank's (x, y) (the checker's reference)."""
    import torch
    import torch.distributed as dist

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum of the SCALED gradients: an inf on one rank reaches every rank
        p.grad /= world
    scaler.step(optimizer)  # unscale_ now finds the same inf on every rank, so every rank skips
    scaler.update()


def _run_dp(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 7.3: _DP_STEPS steps of fn on this rank; the last rank's backward overflows in one step."""
    fn = _guarded(fn)
    import torch.distributed as dist

    model = _tiny_model(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=_DP_LR)
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=_DP_SCALE)
    when = {"now": False}
    if ctx.rank == dist.get_world_size() - 1:
        _overflow_on(model, when)  # an fp16 overflow in this rank's backward only
    weights, scales = [_flat(model)], []
    for step in range(_DP_STEPS):
        when["now"] = step == _DP_INF_STEP
        x, y = _local(step, ctx.rank, dist.get_world_size(), ctx.device)
        fn(model, torch.nn.functional.cross_entropy, x, y, optimizer, scaler)
        weights.append(_flat(model))
        scales.append(float(scaler.get_scale()))
    return {"weights": torch.stack(weights), "scales": scales}


def _dp_hint(ratio: float, world: int) -> str:
    """What an update `ratio` times the right one usually means."""
    if math.isclose(ratio, world, rel_tol=0.05):
        return (f"your update is {world}x too large: all_reduce SUMS the gradients; divide by the world size "
                "(dist.get_world_size()) to average them, as DDP does")
    if math.isclose(ratio, 1 / world, rel_tol=0.05):
        return (f"your update is 1/{world} of the right one: the gradients were averaged twice (the loss divided by "
                "the world size AND the all-reduced gradients divided again); average once")
    return ("zero the gradients, forward under autocast(float16), scaler.scale(loss).backward(), all-reduce and "
            "average every gradient, then scaler.step(optimizer) and scaler.update()")


@_no_time_limit
def check_rank_step(rank_step: Callable, nproc: int | None = None, device: str | None = None) -> None:
    """Exercise 7.3: rank_step(model, loss_fn, x, y, optimizer, scaler) is one fp16 AMP step of data
    parallelism without DDP, run on every rank; checked on N ranks under torchrun."""
    _launch_and_judge("Exercise 7.3 (data parallelism by hand on real ranks, with a consistent skip)", rank_step,
                      "_run_dp", judge_rank_step, reference=reference_rank_step, nproc=nproc, device=device)


def judge_rank_step(title: str, res: RankResults, name: str) -> None:
    """The verdict on solution `name` of a 7.3 launch (separate from the launch so tests batch several)."""
    _rank_errors(title, res, name, "run your step on one process first and read the error")
    want, got = res.results["reference"][0], res.results[name]
    world, last = res.nproc, res.nproc - 1
    for step in range(_DP_STEPS):
        after = [g["weights"][step + 1] for g in got]
        before = [g["weights"][step] for g in got]
        bad = [r for r in range(world) if not _same(after[r], after[0])]
        if bad:
            moved = [r for r in range(world) if not _same(after[r], before[r])]
            if step == _DP_INF_STEP and 0 < len(moved) < world:
                got_text = ", ".join(f"rank {r} {'stepped' if r in moved else 'skipped'}"
                                     + ("" if torch.isfinite(after[r]).all() else " (weights now NaN)")
                                     for r in range(world))
                hint = (f"rank {last}'s backward overflowed in step {step} and only some ranks skipped. The inf check "
                        "(scaler.unscale_ / scaler.step) must come after the all-reduce, so that the inf reaches every "
                        "rank's gradients before any rank looks for it")
            else:
                got_text = f"rank {bad[0]} differs from rank 0 by {(after[bad[0]] - after[0]).abs().max().item():.3g}"
                hint = ("each rank stepped on its own gradients: all-reduce every gradient (dist.all_reduce) before "
                        "the optimizer step, so every rank applies the same averaged gradient")
            failed(title, f"identical weights on all {world} ranks after step {step}", got_text, hint)
        scales = [g["scales"][step] for g in got]
        if len(set(scales)) > 1:
            failed(title, f"the same loss scale on every rank after step {step}", f"scales per rank: {scales}",
                   "call scaler.step(optimizer) and scaler.update() on every rank, after the all-reduce")
        if step == _DP_INF_STEP:
            if not _same(after[0], before[0]):
                failed(title, f"every rank skips step {step} (rank {last}'s backward overflowed)",
                       "the weights changed" if torch.isfinite(after[0]).all() else "non-finite weights",
                       "let scaler.step(optimizer) take the step (not optimizer.step()): it skips the update when "
                       "unscale_ finds inf/nan in the all-reduced gradients")
            if scales[0] != want["scales"][step]:
                failed(title, f"loss scale {want['scales'][step]:g} after the skipped step", scales[0],
                       "call scaler.update() after scaler.step(optimizer), every step")
            continue
        apart = _ulps_apart(after[0], want["weights"][step + 1])
        if apart > ULPS:
            ref_delta = want["weights"][step + 1] - want["weights"][step]
            ratio = ((after[0] - before[0]) @ ref_delta / (ref_delta @ ref_delta)).item()
            failed(title, f"the weights of the reference solution after step {step} (within {ULPS} ulps)",
                   f"{apart:.3g} ulps apart on every rank", _dp_hint(ratio, world))
    passed(title, f"All {world} ranks ({res.device}) stepped on the averaged gradient and all skipped the step "
                  f"where rank {last} overflowed; weights identical on every rank.")


# --- 7.4 gradient communication in bf16: DDP's bf16_compress_hook ---------------------------------

#: Half a bf16 spacing, relative: one rounding of a value to bf16's 8 significant bits. Each rank's share is
#: rounded once, and the sum once per addition: N-1 additions on a ring (ampcourse.reduce_sim).
_BF16_HALF_ULP = 2.0**-8


def _bf16_tolerance(world: int) -> float:
    """Largest relative error of a bf16 all-reduce of N shares: one rounding per share, one per ring addition."""
    from ..reduce_sim import rounding_steps

    return _BF16_HALF_ULP * (1 + rounding_steps(world, "ring"))


def reference_compressed_ddp(model):
    """DDP around `model`, sending its gradients in bf16 (the checker's reference)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def bf16_hook(state, bucket):
        """What default_hooks.bf16_compress_hook does (it refuses gloo): bf16 mean in, fp32 bucket out."""
        buffer = bucket.buffer()  # this bucket's fp32 gradients, flattened
        # Divide before the sum: each share is rounded once to bf16, and the sum cannot overflow.
        compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
        sent = dist.all_reduce(compressed, async_op=True).get_future()
        return sent.then(lambda fut: buffer.copy_(fut.value()[0]))  # decompress into the fp32 bucket

    ddp = DDP(model)  # device_ids=None: DDP uses the (single) device the module lives on
    ddp.register_comm_hook(None, bf16_hook)  # state=None: the hook needs none
    return ddp


def _run_compress(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 7.4: one backward through plain DDP (fp32 all-reduce) and one through fn's model."""
    fn = _guarded(fn)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _local(0, ctx.rank, dist.get_world_size(), ctx.device)
    plain = DDP(_tiny_model(ctx.device))
    nn.functional.cross_entropy(plain(x), y).backward()
    sent: list[tuple[str, int]] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        """dist.all_reduce, noting what it sends (Python comm hooks call it; DDP's built-in reducer does not)."""
        sent.append((str(tensor.dtype).replace("torch.", ""), tensor.numel() * tensor.element_size()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        net = fn(_tiny_model(ctx.device))
        if not isinstance(net, DDP):
            raise TypeError(f"expected the DistributedDataParallel model back, got {type(net).__name__}")
        nn.functional.cross_entropy(net(x), y).backward()
    finally:
        dist.all_reduce = real

    def grads(m: nn.Module) -> torch.Tensor:
        return torch.cat([p.grad.detach().float().reshape(-1).cpu() for p in m.parameters()])
    return {"fp32": grads(plain), "yours": grads(net), "sent": sent,
            "n_params": sum(p.numel() for p in net.parameters())}


@_no_time_limit
def check_compressed_ddp(compressed_ddp: Callable, nproc: int | None = None, device: str | None = None) -> None:
    """Exercise 7.4: compressed_ddp(model) returns DDP(model) whose gradient all-reduce sends bf16; checked on
    N ranks: the averaged gradient, its error against DDP's fp32 all-reduce, and the bytes sent."""
    _launch_and_judge("Exercise 7.4 (gradients all-reduced in bf16)", compressed_ddp, "_run_compress",
                      judge_compressed_ddp, nproc=nproc, device=device)


def judge_compressed_ddp(title: str, res: RankResults, name: str) -> None:
    """The verdict on solution `name` of a 7.4 launch."""
    _rank_errors(title, res, name, "call your function on a model in a process group of one first")
    for rank, got in enumerate(res.results[name]):
        fp32, yours, n = got["fp32"], got["yours"], got["n_params"]
        want_bytes = 2 * n
        sent_bytes = sum(b for _, b in got["sent"])
        dtypes = sorted({d for d, _ in got["sent"]})
        if not got["sent"]:
            failed(title, f"{want_bytes} bytes sent in bf16 per step ({n} gradients x 2 bytes)",
                   f"rank {rank}: no comm hook ran: DDP's built-in all-reduce sent {4 * n} bytes of fp32",
                   "register a communication hook: ddp.register_comm_hook(None, hook), where hook(state, bucket) sends "
                   "bucket.buffer() as bf16 (on NCCL: default_hooks.bf16_compress_hook)")
        if dtypes != ["bfloat16"]:
            hint = ("fp16 keeps more bits than bf16 but not its range: gradients above 65504 overflow to inf and "
                    "those below 2**-24 flush to zero; send bf16" if "float16" in dtypes else
                    "compress the bucket to torch.bfloat16 before the all-reduce")
            failed(title, "gradients sent as bfloat16", f"rank {rank} sent {dtypes}", hint)
        if sent_bytes != want_bytes:
            failed(title, f"{want_bytes} bytes per step (every gradient once, 2 bytes each)",
                   f"rank {rank} sent {sent_bytes} bytes", "all-reduce each bucket once, compressed")
        scale = fp32.abs().max().item()
        err = (yours - fp32).abs().max().item() / scale
        tol = _bf16_tolerance(res.nproc)
        if not torch.isfinite(yours).all() or err > tol:
            ratio = (yours @ fp32 / (fp32 @ fp32)).item()
            hint = (f"your gradients are {ratio:.2g}x DDP's: the hook must return the MEAN (divide by the world size "
                    "once)" if not math.isclose(ratio, 1.0, rel_tol=0.05) else
                    "decompress into the bucket's fp32 buffer after the all-reduce (fut.then(...)) and return it")
            failed(title, f"the averaged gradient within {tol:g} (relative) of DDP's fp32 all-reduce",
                   f"rank {rank}: {err:.3g} apart", hint)
        if err == 0.0:
            failed(title, "bf16 rounding in the averaged gradient", f"rank {rank}: bit-identical to fp32",
                   "the hook must send the bf16 tensor and copy the result back, not the fp32 bucket")
    errs = [(g["yours"] - g["fp32"]).abs().max().item() / g["fp32"].abs().max().item() for g in res.results[name]]
    passed(title, f"On {res.nproc} ranks ({res.device}): half the bytes of fp32 ({2 * res.results[name][0]['n_params']}"
                  f" instead of {4 * res.results[name][0]['n_params']} per step); largest error vs the fp32 all-reduce "
                  f"{max(errs):.2g} of the largest gradient: bf16 rounds each share and then the sum at every addition "
                  f"({res.nproc - 1} on a ring of {res.nproc}), so the error grows with the world size.")


# --- 7.5 FSDP2's MixedPrecisionPolicy --------------------------------------------------------------

_FSDP_STEPS, _FSDP_LR = 4, 1e-3
#: The loss is multiplied by this, as a sum normalised over ~16M outputs would be: gradients near 1e-8,
#: inside bf16's range (fp32's exponent) and below fp16's smallest subnormal (2**-24).
_FSDP_LOSS_SCALE = 2.0**-24
#: Largest allowed distance to the fp32 run, as a fraction of how far the fp32 run moved the weights.
_FSDP_TOL = 0.2


class ShardMe(nn.Module):
    """Two residual MLP blocks and a head: the model exercise 7.5 shards (FSDP2 units: each block, the root)."""

    def __init__(self, dim: int = 16, hidden: int = 64, out: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                    for _ in range(2))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def reference_shard(model, mesh):
    """Shard `model` (a ShardMe) with FSDP2: bf16 compute, fp32 gradient reduction, fp32 output (reference)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one unit per block: only one block's full weights exist at a time
        fully_shard(block, mesh=mesh, mp_policy=inner)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=root)  # the root: the head, and fp32 logits for the loss


def _fsdp_batch(step: int, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a regression batch (16 samples)."""
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(16, 16, generator=gen)
    y = torch.randn(16, 4, generator=gen)
    n = 16 // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


def _fsdp_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error, in fp32, times the tiny normalisation factor."""
    return nn.functional.mse_loss(out.float(), y) * _FSDP_LOSS_SCALE


def _run_fsdp(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 7.5: the fp32 run (unsharded, whole batch on every rank) and fn's sharded run."""
    fn = _guarded(fn)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()

    def fresh() -> ShardMe:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return ShardMe().to(ctx.device)

    ref = fresh()
    start = _flat(ref)
    opt = torch.optim.Adam(ref.parameters(), lr=_FSDP_LR, eps=1e-30)
    for step in range(_FSDP_STEPS):
        opt.zero_grad()
        x, y = _fsdp_batch(step, 0, 1, ctx.device)
        _fsdp_loss(ref(x), y).backward()
        opt.step()

    model = fresh()
    gathered = {"bytes": 0}
    seen_dtypes: set[str] = set()

    def note(module, inputs, output):
        """While a unit runs, its weights (and the root's) are plain all-gathered tensors, the rest DTensor shards."""
        full = [p for p in model.parameters() if not hasattr(p, "to_local")]
        gathered["bytes"] = max(gathered["bytes"], sum(p.nbytes for p in full))
        seen_dtypes.update(str(p.dtype).replace("torch.", "") for p in full)
    for block in model.blocks:
        block.register_forward_hook(note)  # before fully_shard's hooks: runs while the block is still gathered
    model.head.register_forward_hook(note)
    mesh = init_device_mesh(ctx.device.type, (world,))
    fn(model, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=_FSDP_LR, eps=1e-30)
    out_dtype = None
    for step in range(_FSDP_STEPS):
        opt.zero_grad()
        x, y = _fsdp_batch(step, ctx.rank, world, ctx.device)
        out = model(x)
        out_dtype = str(out.dtype).replace("torch.", "")
        _fsdp_loss(out, y).backward()
        opt.step()
    state = distributed.local_state_bytes(model, opt)
    return {"start": start, "fp32": _flat(ref), "yours": _flat(model), "state_bytes": state["total"],
            "gathered_bytes": gathered["bytes"], "param_dtypes": sorted(seen_dtypes), "out_dtype": out_dtype,
            "n_params": sum(p.numel() for p in ref.parameters())}


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for a (possibly sharded) tensor."""
    return (t.to_local() if hasattr(t, "to_local") else t).nbytes


@_no_time_limit
def check_fsdp_policy(shard: Callable, nproc: int | None = None, device: str | None = None) -> None:
    """Exercise 7.5: shard(model, mesh) applies FSDP2 with a MixedPrecisionPolicy to a ShardMe; checked on N ranks
    against the fp32 run (tolerance) and against the bytes per rank of the reference policy (memory bound)."""
    _launch_and_judge("Exercise 7.5 (FSDP2 MixedPrecisionPolicy: accuracy and memory)", shard, "_run_fsdp",
                      judge_fsdp_policy, reference=reference_shard, nproc=nproc, device=device)


def judge_fsdp_policy(title: str, res: RankResults, name: str) -> None:
    """The verdict on solution `name` of a 7.5 launch."""
    _rank_errors(title, res, name, "shard the model with fully_shard(module, mesh=mesh, mp_policy=...) and read the error")
    for rank, (want, got) in enumerate(zip(res.results["reference"], res.results[name])):
        bound = want["state_bytes"] + want["gathered_bytes"]
        used = got["state_bytes"] + got["gathered_bytes"]
        n = got["n_params"]
        if used > bound:
            if got["state_bytes"] > want["state_bytes"]:
                hint = (f"rank {rank} holds {got['state_bytes']} bytes of weights, gradients and Adam state: all of "
                        f"them ({16 * n} for {n} parameters). fully_shard each block and then the root, so every rank "
                        "keeps 1/world_size of them")
            elif "float32" in got["param_dtypes"]:
                hint = ("the all-gathered weights are fp32 (4 bytes each): set param_dtype=torch.bfloat16 so FSDP2 "
                        "casts the shard before the all-gather and the unit runs in bf16")
            else:
                hint = ("the whole model is gathered at once: fully_shard each block (its own unit) before the root, so "
                        "only one block's full weights exist at a time")
            failed(title, f"at most {bound} bytes per rank (sharded fp32 state + the largest gathered unit in bf16)",
                   f"rank {rank}: {got['state_bytes']} state + {got['gathered_bytes']} gathered = {used}", hint)
        moved = (got["fp32"] - got["start"]).norm().item()
        off = (got["yours"] - got["fp32"]).norm().item() / moved
        if not math.isfinite(off) or off > _FSDP_TOL:
            hint = ("the loss here is multiplied by 2**-24 (a sum normalised over ~16M outputs), so its gradients fall "
                    "below fp16's smallest subnormal (2**-24) and flush to zero. bf16 has fp32's exponent range: use "
                    "param_dtype=torch.bfloat16 (fp16 would need a GradScaler)" if "float16" in got["param_dtypes"]
                    else "keep the weights and the optimizer in fp32 (FSDP2 keeps the sharded parameters fp32) and "
                         "reduce the gradients over all ranks (fully_shard does, with reduce_dtype)")
            failed(title, f"final weights within {_FSDP_TOL:g} of the fp32 run (distance / how far fp32 moved them)",
                   f"rank {rank}: {off:.3g}", hint)
    got = res.results[name][0]
    off = (got["yours"] - got["fp32"]).norm().item() / (got["fp32"] - got["start"]).norm().item()
    passed(title, f"On {res.nproc} ranks ({res.device}): {got['state_bytes'] + got['gathered_bytes']} bytes per rank "
                  f"(fp32 unsharded: {16 * got['n_params'] + 4 * got['n_params']}), {off:.2g} from the fp32 run "
                  f"(allowed {_FSDP_TOL:g}); the units ran in {', '.join(got['param_dtypes'])}.")


# --- 7.6 restartable training: rank-0 checkpoints, barriers, resume --------------------------------

_RS_STEPS, _RS_KILL, _RS_INF_STEP = 6, 4, 1
#: Rank 0's write of the checkpoint right before the kill is slow (shared storage, simulated): halfway through it
#: waits this long for a sign that the last rank has already run ahead into the next step (no barrier) and is
#: dying; if so, it stalls until torchrun stops it, leaving the half-written file behind.
_RS_SLOW_WRITE_S = 1.5


def reference_train_restartable(model, optimizer, scaler, run_step, steps, path):
    """Train for `steps` steps, checkpointing after each on rank 0 and resuming from `path` (the reference)."""
    import os

    import torch
    import torch.distributed as dist

    start = 0
    if os.path.exists(path):  # a restarted round: every rank loads the same file
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])  # the loss scale is training state too
        start = state["step"]
    for step in range(start, steps):
        run_step(step)
        if dist.get_rank() == 0:  # one writer: the replicas are identical
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "step": step + 1}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # atomic: a reader sees the old file or the new one, never half
        dist.barrier()  # nobody runs ahead (and can die) while rank 0 is still writing


def _run_restartable(fn: Callable, ctx, params: dict) -> dict:
    """Worker side of 7.6: the uninterrupted run, then fn; the last rank SIGKILLs itself in round `kill_round`."""
    fn = _guarded(fn)
    import io
    import json
    import os
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    env = distributed.torchrun_env()
    rnd, kill_round, world = env.restart_count, params.get("kill_round", params["case_index"]), dist.get_world_size()
    work, case = Path(params["workdir"]), params["case"]

    def setup():
        net = DDP(_tiny_model(ctx.device))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0**10, growth_interval=2)
        return net, opt, scaler

    def stepper(net, opt, scaler, log: list[int], kill: bool):
        def run_step(step: int) -> None:
            """One fp16 AMP step of DDP on this rank's slice (rank 0 overflows once)."""
            log.append(step)
            if kill and step == _RS_KILL and ctx.rank == world - 1:
                (work / f"dying-{case}").touch()  # for rank 0's slow write (see _RS_SLOW_WRITE_S)
                os.kill(os.getpid(), signal.SIGKILL)  # a node failure, mid-run
            x, y = _local(step, ctx.rank, world, ctx.device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device.type, dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(x), y)
            if step == _RS_INF_STEP and ctx.rank == 0:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return run_step

    net, opt, scaler = setup()
    whole = stepper(net, opt, scaler, [], kill=False)
    for step in range(_RS_STEPS):
        whole(step)
    want = {"weights": _flat(net), "scale": float(scaler.get_scale())}

    net, opt, scaler = setup()
    log: list[int] = []
    # Rounds before this case's kill round train on a throwaway file; the kill round and the next share one.
    path = work / (f"ckpt-{case}-main.pt" if rnd >= kill_round else f"ckpt-{case}-warmup{rnd}.pt")
    real_save = torch.save

    def watched_save(obj, f, *args, **kwargs):
        """torch.save, noting which rank wrote; the write before the kill is slow (and dies torn without a barrier)."""
        with open(work / f"savers-{case}.txt", "a") as fh:
            fh.write(f"{ctx.rank}\n")
        if not (rnd == kill_round and log and log[-1] == _RS_KILL - 1 and isinstance(f, (str, os.PathLike))):
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        with open(f, "wb") as fh:
            fh.write(data[:len(data) // 2])
            fh.flush()
            deadline = time.monotonic() + _RS_SLOW_WRITE_S
            while time.monotonic() < deadline:
                if (work / f"dying-{case}").exists():  # a rank ran ahead of this write and died: torchrun stops us
                    time.sleep(10 * _RS_SLOW_WRITE_S)
                time.sleep(0.05)
            fh.write(data[len(data) // 2:])

    torch.save = watched_save
    try:
        fn(net, opt, scaler, stepper(net, opt, scaler, log, kill=rnd == kill_round), _RS_STEPS, str(path))
    finally:
        torch.save = real_save
    if rnd == kill_round + 1 and ctx.rank == 0:
        # atomic: the other ranks read this file while rank 0 may still be writing it (a plain write_text let
        # rank 1 read an empty file under load: JSONDecodeError, a failed exercise for a correct solution)
        from ..checkpoint.saving import replace_atomically
        replace_atomically(work / f"resume-{case}.json", json.dumps(log[:1]).encode())
    resumed = work / f"resume-{case}.json"
    savers = work / f"savers-{case}.txt"
    return {"want": want, "weights": _flat(net), "scale": float(scaler.get_scale()), "round": rnd,
            "resumed_at": json.loads(resumed.read_text()) if resumed.exists() else None,
            "savers": sorted({int(r) for r in savers.read_text().split()}) if savers.exists() else []}


@_no_time_limit
def check_restartable(train_restartable: Callable, nproc: int | None = None, device: str | None = None) -> None:
    """Exercise 7.6: train_restartable(model, optimizer, scaler, run_step, steps, path) checkpoints on rank 0 and
    resumes; checked under torchrun --max-restarts 1 with one rank killed mid-run."""
    _launch_and_judge("Exercise 7.6 (restartable training: rank-0 checkpoints and resume)", train_restartable,
                      "_run_restartable", judge_restartable, nproc=nproc, device=device, max_restarts=1)


def judge_restartable(title: str, res: RankResults, name: str) -> None:
    """The verdict on solution `name` of a 7.6 launch."""
    last = res.nproc - 1
    savers = res.results[name][0].get("savers") or []
    if len(savers) > 1:
        failed(title, "only rank 0 writes the checkpoint", f"torch.save was called on ranks {savers}",
               "the replicas are identical: save on rank 0 only (if dist.get_rank() == 0: ...); every rank writing the "
               "same file races, and on shared storage one rank can read another's half-written file")
    errors = res.errors(name)
    if errors and any(w in errors[0][1] for w in ("torch.load", "Unpickl", "PytorchStreamReader", "zip archive")):
        failed(title, "the restarted ranks load a complete checkpoint",
               f"rank {errors[0][0]} raised {errors[0][1]}",
               f"rank {last} died while rank 0 was still writing the checkpoint, and torchrun stopped rank 0 mid-write: "
               "a torn file. Put dist.barrier() after rank 0's save (no rank runs ahead while it writes), and write to "
               "a temporary file then os.replace it onto the checkpoint (a reader never sees half a file)")
    _rank_errors(title, res, name, "run it once without torchrun's restart and read the error")
    got = res.results[name]
    if res.restarts < 1:
        failed(title, "torchrun to restart the workers once", "no restart happened",
               "the checker kills a rank mid-run; your function must run every step through run_step(step)")
    if savers != [0]:
        failed(title, "rank 0 writes a checkpoint", f"torch.save was called on ranks {savers}",
               "save with torch.save(state, path) on rank 0 after each step (path is the file to write and read)")
    resumed = got[0]["resumed_at"]
    if resumed and 0 < resumed[0] < _RS_KILL:
        failed(title, f"the restarted round resumes at step {_RS_KILL} (rank 0 saved it before rank {last} died)",
               f"it resumed at step {resumed[0]}: the newest checkpoint was not complete",
               f"rank {last} ran ahead into step {_RS_KILL} and died while rank 0 was still writing: put dist.barrier() "
               "after rank 0's save, so no rank moves on before the checkpoint is on disk")
    if got[0]["resumed_at"] != [_RS_KILL]:
        failed(title, f"the restarted round resumes at step {_RS_KILL} (the last checkpoint)",
               "it started at step " + (str(got[0]["resumed_at"][0]) if got[0]["resumed_at"] else "?"),
               "at the start, load the checkpoint if it exists (model, optimizer, scaler) and continue from its step")
    for rank, g in enumerate(got):
        if g["scale"] != g["want"]["scale"]:
            failed(title, f"final loss scale {g['want']['scale']:g} (uninterrupted run)", f"rank {rank}: {g['scale']:g}",
                   "save and load the GradScaler's state_dict() too: its scale and growth tracker are training state")
        if not _same(g["weights"], g["want"]["weights"]):
            failed(title, "final weights equal to the uninterrupted run", f"rank {rank}: differ by "
                   f"{(g['weights'] - g['want']['weights']).abs().max().item():.3g}",
                   "save and restore the optimizer's state_dict() with the model's (AdamW keeps two moments per weight)")
    passed(title, f"Rank {last} was killed at step {_RS_KILL}; torchrun restarted all {res.nproc} ranks, they resumed "
                  "from rank 0's checkpoint and ended with the weights and loss scale of the uninterrupted run.")
