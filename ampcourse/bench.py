"""Measure what mixed precision buys on this device: matmul throughput, train-step time, saved bytes (chapter 2).

    python -m ampcourse.bench --out benchmarks/cpu            # full run (under a minute on a laptop CPU)
    python -m ampcourse.bench --out /tmp/bench --quick        # a few seconds: the test suite's smoke run
    python -m ampcourse.bench --device cuda --out benchmarks/cuda

Writes ``bench.json`` (schema below) and ``bench.png`` into ``--out`` and prints a summary.
Every comparison is measured side by side in one run, with the variants interleaved and repeated,
because absolute timings on a shared machine drift; the ratios are what to read.

JSON schema (``"schema": "ampcourse.bench/1"``): ``env`` (torch, device, CPU flags, ``tf32``: whether
fp32 matmuls and cuDNN convolutions may use TF32), ``config``,
``matmul`` (one row per dtype and size: seconds, tflops), ``train_step`` (one row per model: fp32 and
AMP milliseconds per step, their ratio, ``fp32_math``: "ieee" on CUDA, where TF32 is off for both sides),
``trainer_overhead`` (one row per model: ms per step of
``ampcourse.train`` and of a bare AMP loop, the overhead as a fraction and in ms, its range over repeats,
the clock: ``thread_time`` on a 1-thread CPU run, else ``perf_counter``),
``saved_bytes`` (one row per model and size: activation bytes saved for backward in fp32 and under
autocast, weight copies, the fp32 tensors that remain), and ``targets`` (each with value, limit and
whether it is met).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from . import _args, inputs, memory, models, shipped
from .device import AmpSetup, amp_rule, cpu_flags, native_bf16, pick

__all__ = ["SCHEMA", "matmul_sizes", "matmul_dtypes", "matmul_tflops", "bare_step", "train_step_times", "bare_amp_loop",
           "overhead_clock", "fraction_of_peak", "fp32_math", "tf32_settings", "BareLoop", "paired_step_times",
           "trainer_overhead", "saved_bytes",
           "run_config", "run", "plot", "plot_matmul", "load_gpu_report", "gpu_report_lines", "GPU_REPORT", "plot_saved", "saver_group", "speedup_sentence", "summary", "main"]

SCHEMA = "ampcourse.bench/1"
#: Bytes saved for backward under AMP, as a fraction of fp32, that the transformer should reach.
SAVED_BYTES_TARGET = 0.55
#: Extra time per step that ampcourse.train may spend over a bare hand-written AMP loop.
TRAINER_OVERHEAD_TARGET = 0.03
#: On a GPU: bf16 TFLOP/s of an n x n matmul at PEAK_REFERENCE_N, as a fraction of the measured peak.
BF16_PEAK_TARGET = 0.85
#: On a GPU: AMP/fp32 step-time speedup of the transformer reference (size="large") an H200 should reach.
GPU_STEP_SPEEDUP_TARGET = 3.0
#: The size compared with the peak, and the larger square sizes whose best TFLOP/s is "the measured peak"
#: (measured separately from the reference size, so the fraction can come out above 1 and the goal means something).
PEAK_REFERENCE_N = 4096
PEAK_SIZES = (PEAK_REFERENCE_N, 8192, 12288, 16384)
#: NVIDIA datasheet dense bf16/fp16 tensor-core TFLOP/s (the sparsity figures halved), SXM parts, for context only,
#: keyed by the exact name torch.cuda.get_device_name() reports (an H200 NVL or H100 PCIe has other figures).
DATASHEET_BF16_TFLOPS = {"NVIDIA H200": 989.0, "NVIDIA H100 80GB HBM3": 989.0}

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The largest square matrix timed: three n x n fp32 matrices of 2**16 take 48 GiB, more than any one GPU's share.
MAX_MATMUL_N = 2**16


def _device(device) -> torch.device:
    """A device name or torch.device, checked (known type, present here); ValueError naming it otherwise."""
    return pick(device, "fp32").device


def _model_names(value) -> tuple[str, ...]:
    """Reference model names as a tuple; one name alone is a list of one."""
    return _args.names(value, "model_names", models.MODELS)


def _sizes(value) -> tuple[str, ...]:
    """Reference model sizes as a tuple; one size alone is a list of one."""
    return _args.names(value, "sizes", tuple(models.SIZES))


def _sync(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock time covers the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_sizes(device: torch.device, quick: bool = False) -> tuple[int, ...]:
    """Square matrix sizes to time: small on CPU (low precision can be 200x slower there), large on GPUs."""
    device = _parse_device(device)
    if device.type == "cuda":
        return (1024, 2048) if quick else (1024, 2048, 4096, 8192)
    return (64, 128) if quick else (64, 128, 256, 512)


def matmul_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes worth timing: tf32 and bf16 only on GPUs with their tensor cores (compute capability >= 8.0)."""
    device = _parse_device(device)
    if device.type == "cuda":
        return ("fp32", "tf32", "bf16", "fp16") if native_bf16(device) else ("fp32", "fp16")
    return ("fp32", "bf16", "fp16")


def _time_matmul(a: torch.Tensor, b: torch.Tensor, min_run_time: float) -> float:
    """Median seconds per a @ b, from torch.utils.benchmark (which syncs CUDA for us)."""
    from torch.utils import benchmark

    timer = benchmark.Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


#: The new-API fields that decide TF32 for CUDA fp32 math (torch >= 2.9): cuBLAS matmuls, cuDNN convolutions and RNNs.
_TF32_FIELDS = (("cuda.matmul", "matmul"), ("cudnn.conv", "cudnn_conv"), ("cudnn.rnn", "cudnn_rnn"))


def _backend(path: str):
    """torch.backends.<path> ('cuda.matmul' -> torch.backends.cuda.matmul), or None where this torch lacks it."""
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _new_tf32_api() -> bool:
    """torch >= 2.9 has backends.*.fp32_precision (and reading the legacy flags after a mix of the two raises)."""
    return all(hasattr(_backend(path), "fp32_precision") for path, _ in _TF32_FIELDS)


def _legacy_tf32() -> tuple[bool, bool] | None:
    """(cuda.matmul.allow_tf32, cudnn.allow_tf32), or None where this state cannot be read through the legacy flags
    (torch raises when the new API has set values they cannot express, e.g. cuDNN conv and RNN apart)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return None


def tf32_settings() -> dict:
    """Whether fp32 matmuls (cuBLAS), cuDNN convolutions and cuDNN RNNs may use TF32: what bench.json records.

    "tf32" or "ieee" per field; where the new API is set per field ("none": inherit from the parent setting),
    its own values.
    """
    legacy = _legacy_tf32()
    if legacy is not None:
        matmul, cudnn = ("tf32" if flag else "ieee" for flag in legacy)
        return {"api": "allow_tf32", "matmul": matmul, "cudnn_conv": cudnn, "cudnn_rnn": cudnn}
    return {"api": "fp32_precision", **{key: _backend(path).fp32_precision for path, key in _TF32_FIELDS}}


def _parse_device(device) -> torch.device:
    """A device name or torch.device as a torch.device, without requiring the device to be present."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a device name ('cpu', 'cuda', 'cuda:N', 'mps') or a torch.device, "
                         f"got {_args.shown(device)}") from None


@contextlib.contextmanager
def fp32_math(tf32: bool, device: str | torch.device = "cuda"):
    """On CUDA, let fp32 matmuls, cuDNN convolutions and cuDNN RNNs use TF32 (tf32=True) or not (true fp32); restore after.

    cuDNN allows TF32 convolutions by default, so without this an "fp32" CNN baseline is really TF32 and
    the AMP speedup is understated. Every field is set (matmul, conv and RNN), and set and restored through
    one API: torch >= 2.9 raises when code reads the legacy flags (``allow_tf32``,
    ``get_float32_matmul_precision()``) after the two APIs were mixed, e.g. after setting conv through
    ``fp32_precision`` while the RNN field kept its default. So: the legacy flags where the caller's state
    can be read through them (they keep both APIs readable inside and after the block), else the new
    API's fields, each restored to its own value. Does nothing off CUDA.

    Args:
        tf32: True to allow TF32, False for IEEE fp32 math.
        device: the device the block runs on; off CUDA the block changes nothing.

    Example::

        >>> with fp32_math(tf32=False, device="cuda"):
        ...     fp32_ms = time_step()  # true fp32, the baseline an AMP speedup is measured against
    """
    tf32 = _args.flag(tf32, "tf32")
    if _parse_device(device).type != "cuda":
        yield
        return
    legacy = _legacy_tf32()
    if legacy is not None or not _new_tf32_api():
        previous = legacy if legacy is not None else (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32  # cudnn's covers conv and RNN
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
        return
    backends = [_backend(path) for path, _ in _TF32_FIELDS]
    previous = [b.fp32_precision for b in backends]
    for b in backends:
        b.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        for b, value in zip(backends, previous):
            b.fp32_precision = value


def _measure(a: torch.Tensor, b: torch.Tensor, min_run_time: float, budget_s: float,
             warm_up: bool = True) -> tuple[float, bool]:
    """Seconds per a @ b, and whether one call took over budget_s (then that one call is the measurement).

    warm_up: one untimed call first. The first call of a dtype pays library initialisation (a cold cuBLAS
    call can take longer than the whole budget), which says nothing about the speed of a matmul.
    """
    if warm_up:
        a @ b
        _sync(a.device)
    for _ in range(3):  # then timed one by one (kernel selection, allocator), each against the budget
        _sync(a.device)
        start = time.perf_counter()
        a @ b
        _sync(a.device)
        once = time.perf_counter() - start
        if once > budget_s:
            return once, True
    return _time_matmul(a, b, min_run_time), False


def matmul_tflops(device: str | torch.device = "cpu", dtypes: Sequence[str] | None = None,
                  sizes: Sequence[int] | None = None, min_run_time: float = 0.05, repeats: int = 3,
                  budget_s: float = 0.25, seed: int = 0) -> list[dict]:
    """TFLOP/s of an n x n matmul per dtype and size: dtypes interleaved, fastest of `repeats` medians.

    A dtype stops growing once a single call exceeds budget_s, so slow emulated low precision (AVX2 CPUs)
    never runs a big matmul. Other programs can only slow a measurement down, hence the fastest repeat.
    """
    device = _device(device)
    if isinstance(dtypes, str):  # one dtype alone, not its letters
        dtypes = (dtypes,)
    dtypes = tuple(dtypes if dtypes is not None else matmul_dtypes(device))
    unknown = [d for d in dtypes if not isinstance(d, str) or d not in _DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"unknown matmul dtype(s) {unknown}; choose from {', '.join(_DTYPES)}")
    if "tf32" in dtypes and device.type != "cuda":
        raise ValueError("tf32 exists only on CUDA (Ampere or newer); drop it on this device")
    if sizes is not None and (isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes):
        raise ValueError(f"sizes must be a non-empty sequence of ints >= 1, got {_args.shown(sizes)}; "
                         f"e.g. {list(matmul_sizes(device))}")
    sizes = tuple(sizes if sizes is not None else matmul_sizes(device))
    bad = [n for n in sizes if not _is_size(n)]
    if bad:
        raise ValueError(f"matrix sizes must be ints >= 1 and <= {MAX_MATMUL_N}, got {_args.shown(bad)}; "
                         f"e.g. {list(matmul_sizes(device))}")
    sizes = tuple(int(_args.scalar(n)) for n in sizes)
    min_run_time = _args.real(min_run_time, "min_run_time", positive=True, what="a finite number of seconds > 0")
    budget_s = _args.real(budget_s, "budget_s", nonnegative=True, what="a finite number of seconds >= 0")
    repeats, seed = _args.integer(repeats, "repeats", low=1), _args.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, active = [], list(dtypes)
    for i, n in enumerate(sizes):
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        pairs = {name: (a.to(device, _DTYPES[name]), b.to(device, _DTYPES[name])) for name in active}
        best, over = dict.fromkeys(active, math.inf), set()
        for rep in range(repeats):
            for name in active if rep % 2 == 0 else active[::-1]:  # alternate who goes first
                if name in over:
                    continue
                with fp32_math(name == "tf32", device):
                    # Warm up at the first size (library start-up) and on a GPU at every size (cheap there);
                    # on a CPU a larger size's untimed call would cost as much as a timed one.
                    warm_up = (i == 0 or device.type == "cuda") and rep == 0
                    seconds, bounded = _measure(*pairs[name], min_run_time, budget_s, warm_up)
                best[name] = min(best[name], seconds)
                if bounded:
                    over.add(name)
        rows += [{"dtype": name, "n": n, "seconds": best[name], "tflops": 2 * n**3 / best[name] / 1e12,
                  "bounded": name in over} for name in active]
        active = [name for name in active if name not in over]
    return sorted(rows, key=lambda r: (dtypes.index(r["dtype"]), r["n"]))


def _is_size(n) -> bool:
    """n is an int (Python, numpy or a 0-d tensor) from 1 to MAX_MATMUL_N."""
    try:
        return _args.integer(n, "n", low=1, high=MAX_MATMUL_N) > 0
    except ValueError:
        return False


def _rows(rows, keys: set[str], name: str = "rows") -> Sequence[Mapping]:
    """rows as given, if it is a list of dicts holding keys (what matmul_tflops returns); ValueError naming it otherwise."""
    if (isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence)
            or not all(isinstance(r, Mapping) and keys <= r.keys() for r in rows)):
        raise ValueError(f"{name} must be a list of dicts with keys {', '.join(sorted(keys))} (as matmul_tflops returns), "
                         f"got {_args.shown(rows)}")
    return rows


def _report(report) -> Mapping:
    """report as given, if it is a dict with run()'s sections; ValueError naming what is missing otherwise."""
    missing = {"env", "config", "matmul", "train_step", "saved_bytes", "targets"} - set(report if isinstance(report, Mapping) else ())
    if not isinstance(report, Mapping) or missing:
        raise ValueError(f"report must be a dict as run() returns (missing: {', '.join(sorted(missing))}), "
                         f"got {_args.shown(report)}")
    return report


def fraction_of_peak(rows: Sequence[dict], dtype: str = "bf16", reference_n: int = PEAK_REFERENCE_N,
                     device_name: str = "") -> dict:
    """TFLOP/s of the reference size as a fraction of a peak measured separately: the best of the larger sizes.

    rows: matmul_tflops() output with reference_n and at least one larger size. The reference measurement
    is not part of the peak (otherwise the fraction could never exceed 1 and a goal on it would check
    nothing), so a fraction above 1 is possible and honest. The datasheet figure, matched by the exact
    device name and only for bf16/fp16, is context.
    """
    dtype = _args.choice(dtype, "dtype", tuple(_DTYPES))
    reference_n = _args.integer(reference_n, "reference_n", low=1)
    rows = _rows(rows, {"dtype", "n", "tflops"})
    mine = {r["n"]: r["tflops"] for r in rows if r["dtype"] == dtype}
    if reference_n not in mine:
        raise ValueError(f"no {dtype} row for n={reference_n}; measured sizes: {sorted(mine)}")
    larger = {n: t for n, t in mine.items() if n > reference_n}
    if not larger:
        raise ValueError(f"the peak is measured at sizes larger than n={reference_n}; measured sizes: {sorted(mine)}")
    peak_n = max(larger, key=larger.get)
    sheet = DATASHEET_BF16_TFLOPS.get(device_name) if dtype in ("bf16", "fp16") else None
    return {"dtype": dtype, "tflops_by_n": mine, "peak_n": peak_n, "peak_tflops": mine[peak_n],
            "peak_sizes": sorted(larger), "reference_n": reference_n, "reference_tflops": mine[reference_n],
            "fraction_of_peak": mine[reference_n] / mine[peak_n], "datasheet_tflops": sheet,
            "peak_fraction_of_datasheet": None if sheet is None else mine[peak_n] / sheet}


def speedup_sentence(rows: Sequence[dict], dtype: str, baseline: str = "fp32") -> str:
    """'bf16 is 3.1x faster than fp32 here (n=512)': read from the largest size both dtypes measured (+-10%: 'about as fast')."""
    rows = _rows(rows, {"dtype", "n", "seconds"})
    by = {(r["dtype"], r["n"]): r["seconds"] for r in rows}
    common = [n for (d, n) in by if d == dtype and (baseline, n) in by]
    if not common:
        return f"{dtype} was not measured at a size {baseline} was"
    n = max(common)
    ratio = by[(baseline, n)] / by[(dtype, n)]
    if 0.9 <= ratio <= 1.1:
        return f"{dtype} is about as fast as {baseline} here ({ratio:.2f}x, n={n})"
    if ratio > 1:
        return f"{dtype} is {ratio:.1f}x faster than {baseline} here (n={n})"
    return f"{dtype} is {1 / ratio:.1f}x slower than {baseline} here (n={n})"


def _batch(data, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `batch` examples as fresh tensors on device (fresh storages: counted on their own)."""
    x, y = data.tensors
    return x[:batch].clone().to(device), y[:batch].clone().to(device)


def bare_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
              amp: AmpSetup, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
    """One hand-written AMP training step: the baseline every trainer is compared with."""
    opt.zero_grad(set_to_none=True)
    with amp.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def train_step_times(model_names: Sequence[str] = models.MODELS, device: str | torch.device = "cpu",
                     precision: str | None = None, size: str = "tiny", batch: int = 32, steps: int = 20,
                     repeats: int = 7, warmup: int = 3, seed: int = 0) -> list[dict]:
    """Milliseconds per train step, fp32 vs AMP, per model: interleaved repeats of `steps` steps each.

    On CUDA the fp32 side is true fp32: TF32 is off for matmuls and cuDNN convolutions (cuDNN allows
    TF32 by default), for both sides, so the AMP speedup is measured against fp32, not against TF32.
    """
    model_names = _model_names(model_names)
    batch, steps, repeats = (_args.integer(v, k, low=1) for k, v in (("batch", batch), ("steps", steps), ("repeats", repeats)))
    warmup, seed = _args.integer(warmup, "warmup", low=0), _args.seed(seed)
    amp = pick(device, precision or "amp")  # the device's AMP dtype, even where pick() alone would keep fp32
    with fp32_math(tf32=False, device=amp.device):
        rows = _train_step_times(model_names, amp, size, batch, steps, repeats, warmup, seed)
    return [{**r, "fp32_math": "ieee" if amp.device.type == "cuda" else "default"} for r in rows]


def _train_step_times(model_names: Sequence[str], amp: AmpSetup, size: str, batch: int, steps: int, repeats: int,
                      warmup: int, seed: int) -> list[dict]:
    """train_step_times's measurement, under whatever fp32 math setting the caller chose."""
    device = amp.device
    if not amp.enabled:
        raise ValueError("compare fp32 with an AMP precision: pass precision='fp16' or 'bf16'")
    setups = {"fp32": pick(device, "fp32"), amp.precision: amp}
    rows = []
    for name in model_names:
        x, y = _batch(models.make_dataset(name, n=batch, seed=seed, size=size), batch, amp.device)
        runs = {}
        for prec, setup in setups.items():
            model = models.make_model(name, size=size, seed=seed).to(amp.device)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            runs[prec] = (model, opt, setup.make_scaler(), setup)
            for _ in range(warmup):
                bare_step(model, opt, runs[prec][2], setup, x, y, models.loss_fn)
        times = {prec: [] for prec in setups}
        for r in range(repeats):
            order = list(setups) if r % 2 == 0 else list(setups)[::-1]  # alternate who goes first
            for prec in order:
                model, opt, scaler, setup = runs[prec]
                _sync(amp.device)
                start = time.perf_counter()
                for _ in range(steps):
                    bare_step(model, opt, scaler, setup, x, y, models.loss_fn)
                _sync(amp.device)
                times[prec].append((time.perf_counter() - start) / steps * 1e3)
        ratios = [a / f for a, f in zip(times[amp.precision], times["fp32"])]
        rows.append({"model": name, "size": size, "batch": batch, "precision": amp.precision,
                     "fp32_ms": statistics.median(times["fp32"]), "amp_ms": statistics.median(times[amp.precision]),
                     "amp_over_fp32": statistics.median(ratios), "repeats_ms": times})
    return rows


def _check_loop_args(model, data, amp, loss_fn) -> None:
    """ValueError naming the argument unless model, data (a TensorDataset), amp and loss_fn are what BareLoop takes."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")
    tensors = getattr(data, "tensors", None)
    if not (isinstance(tensors, tuple) and len(tensors) == 2 and all(isinstance(t, torch.Tensor) for t in tensors)
            and len(tensors[0]) == len(tensors[1]) > 0):
        raise ValueError(f"data must be a TensorDataset of (inputs, targets) with at least one sample, "
                         f"got {_args.shown(data)}")
    if not isinstance(amp, AmpSetup):
        raise ValueError(f"amp must be an AmpSetup (ampcourse.device.pick(device, precision)), got {_args.shown(amp)}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (logits, targets) -> loss, got {_args.shown(loss_fn)}")


class BareLoop:
    """A hand-written AMP loop (chapter 3's recipe, AdamW, shuffled batches, loss logged), one iteration per call."""

    def __init__(self, model: torch.nn.Module, data, amp: AmpSetup, lr: float = 1e-3, batch: int = 32, seed: int = 0,
                 loss_fn=models.loss_fn):
        _check_loop_args(model, data, amp, loss_fn)
        lr, seed = _args.real(lr, "lr", positive=True), _args.seed(seed)
        batch = _args.integer(batch, "batch", low=1, high=len(data.tensors[0]),
                              what=f"an int from 1 to the dataset's {len(data.tensors[0])} samples")
        self.model, self.amp, self.batch, self.loss_fn = model, amp, batch, loss_fn
        # On a GPU a careful hand-written loop keeps a small dataset on the device and uses fused AdamW
        # (no host sync in scaler.step): what ampcourse.train does there too, so the comparison is fair.
        on_gpu = amp.device_type == "cuda"
        self.xs, self.ys = (t.to(amp.device) for t in data.tensors) if on_gpu else data.tensors
        # weight_decay=0: what train() uses by default (AdamW's own default, 0.01, would add work to this side only)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, **({"fused": True} if on_gpu else {}))
        self.scaler = amp.make_scaler()
        self.gen = torch.Generator().manual_seed(seed)
        self.per_epoch = len(self.xs) // batch
        self.step_count, self.perm = 0, None

    def step(self) -> float:
        """One iteration: pick the batch, step, read the loss back (as every real loop logs it)."""
        pos = self.step_count % self.per_epoch
        if pos == 0:
            self.perm = torch.randperm(len(self.xs), generator=self.gen).to(self.xs.device)
        idx = self.perm[pos * self.batch:(pos + 1) * self.batch]
        loss = bare_step(self.model, self.opt, self.scaler, self.amp, self.xs[idx].to(self.amp.device),
                         self.ys[idx].to(self.amp.device), self.loss_fn)
        self.step_count += 1
        return loss.item()  # (this also waits for the GPU)


def bare_amp_loop(model: torch.nn.Module, data, amp: AmpSetup, steps: int, lr: float = 1e-3, batch: int = 32,
                  seed: int = 0, loss_fn=models.loss_fn) -> list[float]:
    """`steps` iterations of :class:`BareLoop`: seconds per step."""
    steps = _args.integer(steps, "steps", low=0)
    loop = BareLoop(model, data, amp, lr, batch, seed, loss_fn)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - start)
    return times


def overhead_clock(device: torch.device) -> tuple[str, Callable[[], float]]:
    """The clock for trainer-vs-bare timings: this thread's CPU time on a 1-thread CPU run, else wall time.

    On a CPU with one torch thread every kernel runs in the calling thread, so its CPU time is the
    work done, and time the scheduler gives to other programs on a shared machine does not count.
    """
    device = _parse_device(device)
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return "thread_time", time.thread_time
    return "perf_counter", time.perf_counter


def trainer_overhead(model_names: Sequence[str] = ("mlp", "transformer"), device: str | torch.device | None = None,
                     precision: str | None = None, size: str = "tiny", batch: int = 32, steps: int = 30,
                     repeats: int = 5, warmup: int = 5, lr: float = 1e-3, seed: int = 0) -> list[dict]:
    """Per-step time of ampcourse.train.train over a bare AMP loop on the same model, interleaved step by step.

    Each repeat runs one train() and, before each of its steps, one step of a :class:`BareLoop` on a
    second copy of the model: bare, trainer, bare, trainer, ... So both see the same machine state at
    millisecond granularity, and slow drifts (other jobs, clock changes) cancel. A trainer step is timed
    from the end of one bare step to the start of the next (one whole iteration of train()'s loop: batch,
    forward, backward, step, bookkeeping); a bare step from its start to its end, on :func:`overhead_clock`.
    Per repeat: the median of each after `warmup` steps; the overhead is the median over repeats of
    trainer/bare - 1.
    """
    from . import train as train_module

    model_names = _model_names(model_names)
    batch, steps, repeats = (_args.integer(v, k, low=1) for k, v in (("batch", batch), ("steps", steps), ("repeats", repeats)))
    warmup, lr, seed = _args.integer(warmup, "warmup", low=0), _args.real(lr, "lr", positive=True), _args.seed(seed)
    amp = pick(device, precision)
    if warmup >= steps - 1:
        raise ValueError(f"warmup ({warmup}) must be smaller than steps - 1 ({steps - 1})")
    clock_name, _ = overhead_clock(amp.device)
    rows = []
    for name in model_names:
        data = models.make_dataset(name, n=1024, seed=seed, size=size)
        times = {"trainer": [], "bare": []}
        for _ in range(repeats):
            trainer_ms, bare_ms = paired_step_times(train_module, name, data, amp, steps, warmup, lr, batch, seed, size)
            times["trainer"].append(trainer_ms)
            times["bare"].append(bare_ms)
        ratios = [t / b for t, b in zip(times["trainer"], times["bare"])]
        rows.append({"model": name, "size": size, "batch": batch, "precision": amp.precision, "clock": clock_name,
                     "trainer_ms": statistics.median(times["trainer"]), "bare_ms": statistics.median(times["bare"]),
                     "overhead": statistics.median(ratios) - 1,
                     "overhead_ms": statistics.median(t - b for t, b in zip(times["trainer"], times["bare"])),
                     "overhead_range": [min(ratios) - 1, max(ratios) - 1], "repeats_ms": times})
    return rows


def paired_step_times(train_module, name: str, data, amp: AmpSetup, steps: int, warmup: int, lr: float = 1e-3,
                      batch: int = 32, seed: int = 0, size: str = "tiny") -> tuple[float, float]:
    """One train_module.train() run with a BareLoop step after each of its steps: median ms per step of each.

    train()'s per-step hook (on_step) runs one bare step right after each trainer step, so every trainer
    step is timed between two bare ones, without touching train()'s internals.
    """
    steps, warmup = _args.integer(steps, "steps", low=2), _args.integer(warmup, "warmup", low=0)
    if warmup >= steps - 1:
        raise ValueError(f"warmup ({warmup}) must be smaller than steps - 1 ({steps - 1})")
    _, clock = overhead_clock(amp.device)
    bare = BareLoop(models.make_model(name, size=size, seed=seed).to(amp.device), data, amp, lr, batch, seed)
    marks: list[tuple[float, float]] = []

    def bare_step_between(step, stats) -> None:
        start = clock()
        bare.step()
        marks.append((start, clock()))

    train_module.train(name, data, amp.precision, steps=steps, lr=lr, seed=seed, device=amp.device,
                       batch_size=batch, optimizer="adamw", progress=False, size=size, on_step=bare_step_between)
    bare_s = [end - start for start, end in marks]
    trainer_s = [start - end for (_, end), (start, _) in zip(marks, marks[1:])]
    return statistics.median(trainer_s[warmup:]) * 1e3, statistics.median(bare_s[warmup:]) * 1e3


def saved_bytes(model_names: Sequence[str] = models.MODELS, sizes: Sequence[str] = ("tiny",),
                device: str | torch.device = "cpu", precision: str | None = None, batch: int = 32,
                seed: int = 0) -> list[dict]:
    """Bytes saved for backward by one forward pass, fp32 vs autocast, per model and size."""
    model_names, sizes = _model_names(model_names), _sizes(sizes)
    batch, seed = _args.integer(batch, "batch", low=1), _args.seed(seed)
    amp = pick(device, precision or "amp")  # the device's AMP dtype, even where pick() alone would keep fp32
    if not amp.enabled:
        raise ValueError("compare fp32 with an AMP precision: pass precision='fp16' or 'bf16'")
    rows = []
    for size in sizes:
        for name in model_names:
            task = models.make_task(name, n=batch, seed=seed, size=size)
            model = task.model.to(amp.device)
            x, y = _batch(task.data, batch, amp.device)
            fp32 = memory.forward_saved_bytes(model, task.loss_fn, x, y)
            low = memory.forward_saved_bytes(model, task.loss_fn, x, y, amp.autocast())
            rows.append({
                "model": name, "size": size, "batch": batch, "precision": amp.precision,
                "fp32_activation_bytes": fp32.activation_bytes,
                "amp_activation_bytes": low.activation_bytes,
                "amp_weight_copy_bytes": low.weight_copy_bytes,
                "activation_ratio": low.activation_bytes / fp32.activation_bytes,
                "with_weight_copies_ratio": low.extra_bytes / fp32.extra_bytes,
                "amp_by_dtype": low.by_dtype(),
                "amp_fp32_by_saver": low.by_saver("float32"),
            })
    return rows


def _env(device: torch.device) -> dict:
    """What the numbers depend on: torch, device, CPU vector units, threads."""
    flags = sorted(f for f in cpu_flags() if f in {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile"})
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "device": str(device), "device_name": pick(device, "fp32").describe_device(),
            "cpu_flags": flags, "threads": torch.get_num_threads(), "tf32": tf32_settings()}


def _targets(report: dict) -> list[dict]:
    """The benchmark targets: each with its measured value, limit and whether it is met."""
    out = []
    for row in report["saved_bytes"]:
        if row["model"] == "transformer":
            out.append({"name": f"saved activation bytes AMP/fp32, transformer {row['size']}",
                        "value": row["activation_ratio"], "limit": SAVED_BYTES_TARGET,
                        "met": row["activation_ratio"] <= SAVED_BYTES_TARGET})
    for row in report.get("trainer_overhead", []):
        out.append({"name": f"trainer per-step overhead over a bare AMP loop, {row['model']} {row['size']}",
                    "value": row["overhead"], "limit": TRAINER_OVERHEAD_TARGET,
                    "met": row["overhead"] <= TRAINER_OVERHEAD_TARGET})
    return out


def run_config(dev: torch.device, precision: str, quick: bool, seed: int) -> dict:
    """What run() measures on this device: tiny models on a CPU; on CUDA the reference models at size="large"
    (batch 64), because tiny ones are launch-bound there and would show a speedup near 1x."""
    gpu = dev.type == "cuda"
    return {"quick": quick, "precision": precision, "seed": seed,
            "models": (["transformer"] if gpu else ["mlp"]) if quick else list(models.MODELS),
            "saved_sizes": ["tiny"] if quick else ["tiny", "small"],
            "step_size": "large" if gpu else "tiny",
            "batch": 64 if gpu else 32, "steps": 3 if quick else 20, "repeats": 2 if quick else (5 if gpu else 7),
            "matmul_sizes": list(matmul_sizes(dev, quick)), "matmul_min_run_time": 0.01 if quick else 0.05,
            "matmul_repeats": 1 if quick else 3,
            "overhead_models": (["transformer"] if gpu else ["mlp"]) if quick else ["mlp", "transformer"],
            "overhead_steps": 6 if quick else (30 if gpu else 60), "overhead_warmup": 2 if quick else 5,
            "overhead_repeats": 2 if quick else (5 if gpu else 15)}


def run(device: str | torch.device | None = None, precision: str | None = None, quick: bool = False,
        seed: int = 0) -> dict:
    """Run every measurement and return the report (see the module docstring for its schema)."""
    quick, seed = _args.flag(quick, "quick"), _args.seed(seed)
    # the device's AMP dtype by default (bf16 on any CPU): pick() alone keeps fp32 on a CPU without bf16 units,
    # where the benchmark would then have nothing to compare
    amp = pick(device, precision or "amp")
    if not amp.enabled:
        raise ValueError("the benchmark compares fp32 with AMP: pass precision='fp16' or 'bf16'")
    dev = amp.device
    config = run_config(dev, amp.precision, quick, seed)
    torch.manual_seed(seed)
    report = {"schema": SCHEMA, "env": _env(dev), "config": config}
    report["matmul"] = matmul_tflops(dev, sizes=config["matmul_sizes"], min_run_time=config["matmul_min_run_time"],
                                     repeats=config["matmul_repeats"])
    report["train_step"] = train_step_times(config["models"], dev, amp.precision, size=config["step_size"],
                                            batch=config["batch"], steps=config["steps"], repeats=config["repeats"])
    report["trainer_overhead"] = trainer_overhead(config["overhead_models"], dev, amp.precision, size=config["step_size"],
                                                  batch=config["batch"], steps=config["overhead_steps"],
                                                  repeats=config["overhead_repeats"], warmup=config["overhead_warmup"])
    report["saved_bytes"] = saved_bytes(["transformer"] if quick else config["models"], config["saved_sizes"],
                                        dev, amp.precision, batch=config["batch"])
    report["targets"] = _targets(report)
    return report


#: Where `make gpu-test` (tools/gpu_test.py) commits its report, relative to the repository.
GPU_REPORT = Path("benchmarks") / "gpu" / "report.json"


def load_gpu_report(path: str | Path | None = None) -> dict | None:
    """The recorded `make gpu-test` report, or None when none was recorded.

    Args:
        path: a report.json; None: the repository's benchmarks/gpu/report.json, from the checkout this package runs
            from or, for an installed wheel (Colab's `pip install "git+..."`), the copy built into it
            (ampcourse.shipped).

    Example::

        >>> report = load_gpu_report()  # None until `make gpu-test` has recorded one
    """
    if path is None:
        path = shipped.path(GPU_REPORT.as_posix())
        if path is None:
            return None
    if isinstance(path, bool) or not isinstance(path, (str, Path)):
        raise ValueError(f"path must be a file path (str or pathlib.Path) or None, got {_args.shown(path)}")
    path = Path(path)
    if not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not a GPU report (JSON): {err}") from None
    if not isinstance(report, dict):
        raise ValueError(f"{str(path)!r} is not a GPU report: it holds a {type(report).__name__}, not a JSON object")
    return report


def gpu_report_lines(report: dict) -> list[str]:
    """A recorded GPU report as lines for a notebook: machine, torch, date, then each goal's figure."""
    if not isinstance(report, Mapping) or not isinstance(report.get("machine", {}), Mapping):
        raise ValueError(f"report must be a dict as load_gpu_report returns, got {_args.shown(report)}")
    m = report.get("machine", {})
    lines = [f"recorded GPU run: {m.get('device', 'unknown GPU')} ({m.get('capability', '?')}), torch {m.get('torch')} "
             f"(CUDA {m.get('cuda')}), {str(report.get('started', ''))[:10]}, status {report.get('status')}"]
    for g in report.get("goals", []):
        shown = g.get("shown") or "not measured"
        met = {True: "met", False: "NOT met", None: "-"}[g.get("met")]
        lines.append(f"  {g['name']}: {shown} (goal {g['goal']}, {met})")
    return lines


def plot_matmul(rows: Sequence[dict], ax=None):
    """TFLOP/s against matrix size, one line per dtype."""
    rows = _rows(rows, {"dtype", "n", "tflops"})
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    for name in dict.fromkeys(r["dtype"] for r in rows):
        pts = [(r["n"], r["tflops"]) for r in rows if r["dtype"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", xlabel="matrix size n (n x n @ n x n)", ylabel="TFLOP/s", title="matmul throughput")
    ax.set_xticks([r["n"] for r in rows if r["dtype"] == rows[0]["dtype"]],
                  [str(r["n"]) for r in rows if r["dtype"] == rows[0]["dtype"]])
    ax.set_xticks([], minor=True)  # the log axis's minor labels would overlap the sizes
    ax.legend(fontsize=8)
    return ax


_SAVER_GROUPS = (("NativeLayerNorm", "layer norm"), ("NativeBatchNorm", "batch norm"), ("ScaledDotProduct", "attention"),
                 ("Addmm", "matmul / linear"), ("Mm", "matmul / linear"), ("Bmm", "matmul / linear"),
                 ("Convolution", "convolution"), ("Gelu", "activation fn"), ("Relu", "activation fn"),
                 ("Threshold", "activation fn"), ("NllLoss", "loss"), ("LogSoftmax", "loss"), ("Embedding", "embedding"))


def saver_group(saver: str) -> str:
    """A readable group for an autograd node name: 'NativeLayerNormBackward0' -> 'layer norm'."""
    if not isinstance(saver, str):
        raise ValueError(f"saver must be an autograd node name (str) such as 'AddmmBackward0', got {_args.shown(saver)}")
    for prefix, group in _SAVER_GROUPS:
        if saver.startswith(prefix):
            return group
    return saver.removesuffix("Backward0")


def plot_saved(runs: dict[str, memory.SavedBytes], ax=None):
    """Stacked bars of bytes saved for backward, one bar per run, split by the layer type that saved them."""
    if not isinstance(runs, Mapping) or not runs or not all(isinstance(v, memory.SavedBytes) for v in runs.values()):
        raise ValueError(f"runs must be a non-empty dict {{label: SavedBytes}} (memory.forward_saved_bytes results), "
                         f"got {_args.shown(runs)}")
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.7 * len(runs) + 1.4), dpi=80)
    grouped = {}
    for label, saved in runs.items():
        totals = {}
        for saver, nbytes in saved.by_saver().items():
            totals[saver_group(saver)] = totals.get(saver_group(saver), 0) + nbytes
        grouped[label] = totals
    groups = list(dict.fromkeys(g for totals in grouped.values() for g in totals))
    labels = list(runs)[::-1]  # first run on top
    left = [0.0] * len(labels)
    for group in groups:
        widths = [grouped[label].get(group, 0) / 2**10 for label in labels]
        ax.barh(labels, widths, left=left, label=group)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="KiB saved for backward (activations)", title="what the forward pass keeps for backward")
    ax.legend(fontsize=8, ncol=min(4, len(groups)), loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    ax.figure.tight_layout()
    return ax


def _bars(ax, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, title: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], values, width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)


def plot(report: dict):
    """Three panels: matmul TFLOP/s, ms per train step, saved-for-backward bytes as a fraction of fp32."""
    report = _report(report)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), dpi=80)
    plot_matmul(report["matmul"], axes[0])
    steps, prec = report["train_step"], report["config"]["precision"]
    _bars(axes[1], [r["model"] for r in steps], {"fp32": [r["fp32_ms"] for r in steps],
                                                 prec: [r["amp_ms"] for r in steps]},
          "ms per step (median)", f"train step, {steps[0]['size'] if steps else ''} models")
    saved = report["saved_bytes"]
    _bars(axes[2], [f"{r['model']}\n{r['size']}" for r in saved],
          {"activations": [r["activation_ratio"] for r in saved],
           "+ weight copies": [r["with_weight_copies_ratio"] for r in saved]},
          f"{prec} bytes / fp32 bytes", f"saved for backward: {prec} / fp32 (batch {report['config']['batch']})")
    axes[2].axhline(SAVED_BYTES_TARGET, color="grey", ls="--", lw=1)
    axes[2].axhline(1.0, color="black", lw=0.8)
    fig.suptitle(f"{report['env']['device_name']}, torch {report['env']['torch']}, {report['env']['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    return fig


def summary(report: dict) -> str:
    """The report as a few human-readable lines."""
    report = _report(report)
    prec = report["config"]["precision"]
    lines = [f"device: {report['env']['device_name']}  torch {report['env']['torch']}  "
             f"cpu flags: {' '.join(report['env']['cpu_flags']) or '-'}", "", "matmul TFLOP/s:"]
    for r in report["matmul"]:
        lines.append(f"  {r['dtype']:5} n={r['n']:<5} {r['tflops']:8.3f}" + ("  (one call over budget: stopped here)" if r["bounded"] else ""))
    for name in dict.fromkeys(r["dtype"] for r in report["matmul"]):
        if name != "fp32":
            lines.append("  " + speedup_sentence(report["matmul"], name))
    lines += ["", f"train step (ms, median of interleaved repeats), fp32 vs {prec}:"]
    for r in report["train_step"]:
        lines.append(f"  {r['model']:12} {r['size']:6} fp32 {r['fp32_ms']:7.2f}  {prec} {r['amp_ms']:7.2f}  ratio {r['amp_over_fp32']:.2f}")
    lines += ["", "ampcourse.train vs a bare AMP loop (ms per step, interleaved step by step, median of repeats):"]
    for r in report.get("trainer_overhead", []):
        lines.append(f"  {r['model']:12} {r['size']:6} trainer {r['trainer_ms']:7.2f}  bare {r['bare_ms']:7.2f}  "
                     f"overhead {r['overhead']:+.1%} ({r['overhead_ms']:+.3f} ms; repeats {r['overhead_range'][0]:+.1%}"
                     f" to {r['overhead_range'][1]:+.1%})")
    lines += ["", "bytes saved for backward (one forward, activations; + autocast's weight copies):"]
    for r in report["saved_bytes"]:
        lines.append(f"  {r['model']:12} {r['size']:6} fp32 {r['fp32_activation_bytes']:>10,}  {prec} {r['amp_activation_bytes']:>10,}"
                     f"  ratio {r['activation_ratio']:.3f}  (+ weight copies {r['amp_weight_copy_bytes']:,}: {r['with_weight_copies_ratio']:.3f})")
    lines += ["", "targets:"]
    for t in report["targets"]:
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {t['name']}: {t['value']:.3f} (limit {t['limit']})")
    return "\n".join(lines)


#: run()'s argument names as this command line spells them (_args.as_flags).
_FLAGS = {"device": "--device", "precision": "--precision", "seed": "--seed"}


def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.bench (every default in --help: _args.HelpFormatter)."""
    ap = _args.OneLineParser(prog="python -m ampcourse.bench", description=__doc__, error_prefix="ampcourse.bench",
                             formatter_class=_args.HelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for bench.json and bench.png")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: best available)")
    ap.add_argument("--precision", "--precisions", default=None,
                    help="the AMP side, fp16 or bf16 (or a dtype name: bfloat16, half, ...), measured beside fp32; "
                         f"default: the device's autocast dtype even where it is slow: {amp_rule()}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats: a few seconds")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's choice); 1 is steadier on a shared machine")
    ap.add_argument("--seed", type=int, default=0, help="seed for the models and the data")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the benchmark, write bench.json and bench.png into --out, print a summary."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.precision is not None:  # read as every CLI reads it; fp32 refused now, not after a minute of measuring
        try:
            args.precision = inputs.cli_precision(args.precision, "--precision", allowed=("fp16", "bf16"), refused={
                "fp32": "fp32 is always measured, as the baseline; choose the AMP side: fp16 or bf16"})
        except ValueError as err:
            ap.error(str(err))
    if args.out.exists() and not args.out.is_dir():  # say so now, not after a minute of measuring
        ap.error(f"--out {str(args.out)!r} is a file; give a folder for bench.json and bench.png")
    try:
        _args.creatable_dir(args.out, "--out")
    except ValueError as err:
        ap.error(str(err))
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        report = run(args.device, args.precision, quick=args.quick, seed=args.seed)
    except (ValueError, TypeError) as err:
        ap.error(_args.as_flags(str(err), _FLAGS))  # run()'s argument names as this command line's flags
    except RuntimeError as err:  # out of memory, a driver error: one line, not a traceback
        ap.error(f"the benchmark failed: {type(err).__name__}: {_args.first_line(err)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report).savefig(args.out / "bench.png")
    print(summary(report))
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
