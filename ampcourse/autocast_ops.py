"""What autocast does to each op, measured live on this torch build and device (never typed in; chapter 3).

    >>> from ampcourse.autocast_ops import op_table, format_table
    >>> rows = op_table("cpu", torch.bfloat16)
    >>> print(format_table(rows))
    >>> {r.op: r.category for r in rows}["linear"]
    'lower'

Each op runs three times under ``torch.amp.autocast(device_type, dtype)``: with fp32 inputs, with
low-precision inputs, and (for ops with several floating-point inputs) with mixed inputs. The output
dtypes decide the category:

- ``lower``: fp32 inputs come out in the low-precision dtype (autocast casts them down: matmuls, convs);
- ``fp32``: low-precision inputs come out in fp32 (autocast casts them up: losses, reductions);
- ``promote``: mixed inputs run in the widest input type (autocast's promote list, or ordinary type
  promotion);
- ``unchanged``: the output follows the input dtype (autocast leaves the op alone).

The lists differ per device: on CPU, ``softmax`` and ``layer_norm`` of a bf16 input stay bf16, while
CUDA autocast runs them in fp32. Generate the table on the device you train on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import json
import os
import pickle
import select
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _args

__all__ = ["CATEGORIES", "Probe", "OpRow", "OpSpec", "OPS", "Policy", "op_table", "format_table", "differences",
           "registered_ops", "policy", "fake_cuda_available"]

CATEGORIES = {
    "lower": "runs in the low-precision dtype (fp32 inputs are cast down)",
    "fp32": "runs in fp32 (low-precision inputs are cast up)",
    "promote": "runs in the widest input dtype (mixed inputs: fp32)",
    "unchanged": "autocast leaves it alone: output dtype = input dtype",
    "unsupported": "raised an error for this dtype on this device",
}


@dataclass(frozen=True)
class OpSpec:
    """An op to probe: its floating-point input shapes and how to call it."""

    name: str
    shapes: tuple[tuple[int, ...], ...]  # one shape per floating-point input
    call: Callable[..., torch.Tensor]  # call(*float_inputs) -> tensor


def _target(n: int, classes: int, device: torch.device) -> torch.Tensor:
    """Class indices 0, 1, 2, ... (mod classes): deterministic integer targets."""
    return torch.arange(n, device=device) % classes


def _specs() -> tuple[OpSpec, ...]:
    """The ops in the table: matmul-like, pointwise, normalisations, reductions, losses, multi-input."""
    sdpa = F.scaled_dot_product_attention
    return (
        OpSpec("linear", ((4, 8), (3, 8), (3,)), F.linear),
        OpSpec("matmul (@)", ((4, 8), (8, 3)), torch.matmul),
        OpSpec("bmm", ((2, 4, 8), (2, 8, 3)), torch.bmm),
        OpSpec("addmm", ((4, 3), (4, 8), (8, 3)), torch.addmm),
        OpSpec("conv2d", ((1, 2, 6, 6), (3, 2, 3, 3)), F.conv2d),
        OpSpec("scaled_dot_product_attention", ((1, 2, 4, 8),) * 3, sdpa),
        OpSpec("relu", ((4, 8),), F.relu),
        OpSpec("gelu", ((4, 8),), F.gelu),
        OpSpec("max_pool2d", ((1, 2, 6, 6),), lambda x: F.max_pool2d(x, 2)),
        OpSpec("exp", ((4, 8),), torch.exp),
        OpSpec("log", ((4, 8),), torch.log),
        OpSpec("pow", ((4, 8),), lambda x: torch.pow(x, 2)),
        OpSpec("sum", ((4, 8),), torch.sum),
        OpSpec("cumsum", ((4, 8),), lambda x: torch.cumsum(x, 1)),
        OpSpec("softmax", ((4, 8),), lambda x: F.softmax(x, dim=-1)),
        OpSpec("log_softmax", ((4, 8),), lambda x: F.log_softmax(x, dim=-1)),
        OpSpec("layer_norm", ((4, 8), (8,), (8,)), lambda x, w, b: F.layer_norm(x, (8,), w, b)),
        OpSpec("group_norm", ((4, 8), (8,), (8,)), lambda x, w, b: F.group_norm(x, 2, w, b)),
        OpSpec("cross_entropy", ((4, 8),), lambda x: F.cross_entropy(x, _target(4, 8, x.device))),
        OpSpec("nll_loss", ((4, 8),), lambda x: F.nll_loss(x, _target(4, 8, x.device))),
        OpSpec("mse_loss", ((4, 8), (4, 8)), F.mse_loss),
        OpSpec("binary_cross_entropy_with_logits", ((4, 8), (4, 8)), F.binary_cross_entropy_with_logits),
        OpSpec("add (a + b)", ((4, 8), (4, 8)), torch.add),
        OpSpec("mul (a * b)", ((4, 8), (4, 8)), torch.mul),
        OpSpec("cat", ((4, 8), (4, 8)), lambda a, b: torch.cat([a, b])),
        OpSpec("addcmul", ((4, 8), (4, 8), (4, 8)), torch.addcmul),
        OpSpec("dot", ((8,), (8,)), torch.dot),
    )


#: The probed ops, in table order.
OPS: tuple[OpSpec, ...] = _specs()


@dataclass(frozen=True)
class Probe:
    """One run of an op under autocast: the input dtypes and what came out."""

    inputs: tuple[str, ...]
    output: str  # a dtype name ('bfloat16', 'float32', ...) or 'error: <message>'

    @property
    def failed(self) -> bool:
        """True when the op raised."""
        return self.output.startswith("error")


@dataclass(frozen=True)
class OpRow:
    """What autocast did to one op: the probes and the category they imply.

    ``kind`` names the fp32 flavour where the probe can tell (``'fp32'``: inputs cast up;
    ``'fp32_set_opt_dtype'``: the op's own ``dtype`` argument set to fp32; ``'fp32_append_dtype'``: an
    overload with a ``dtype`` argument called instead), ``reason`` says why a row is ``'unsupported'``,
    and ``entered`` is the aten op the call entered (its last top-level one; fake-CUDA probes only).
    """

    op: str
    category: str  # a key of CATEGORIES
    from_fp32: Probe  # all floating-point inputs fp32
    from_low: Probe  # all floating-point inputs in the autocast dtype
    from_mixed: Probe | None  # first input low precision, the rest fp32 (ops with 2+ float inputs)
    kind: str | None = None  # the fp32 kind (see above), for category 'fp32'
    reason: str | None = None  # why the row is 'unsupported'
    entered: str | None = None  # 'aten::softmax': the (last top-level) aten op the call entered

    @property
    def decisive(self) -> Probe:
        """The probe that shows the category: fp32 in for 'lower', mixed in for 'promote', else low in."""
        if self.category == "lower":
            return self.from_fp32
        if self.category == "promote" and self.from_mixed is not None:
            return self.from_mixed
        return self.from_low

    @property
    def inputs(self) -> tuple[str, ...]:
        """Input dtypes of the decisive probe."""
        return self.decisive.inputs

    @property
    def output(self) -> str:
        """Output dtype of the decisive probe."""
        return self.decisive.output


def _name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def _probe(spec: OpSpec, dtypes: Sequence[torch.dtype], device: torch.device, amp_dtype: torch.dtype) -> Probe:
    """Run spec under autocast with inputs of the given dtypes and record the output dtype."""
    gen = torch.Generator().manual_seed(0)
    # positive inputs keep log/pow/bce well defined; built outside autocast in the probe's dtypes
    inputs = [(torch.rand(shape, generator=gen) + 0.5).to(device=device, dtype=dt) for shape, dt in zip(spec.shapes, dtypes)]
    try:
        with torch.amp.autocast(device_type=device.type, dtype=amp_dtype):
            out = spec.call(*inputs)
        result = _name(out.dtype)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        result = "error: " + str(err).strip().splitlines()[0][:80]
    return Probe(tuple(_name(d) for d in dtypes), result)


def _categorise(low: str, fp32: Probe, lowp: Probe, mixed: Probe | None) -> str:
    """The category implied by the three probes (see the module docstring)."""
    if fp32.failed or lowp.failed:
        return "unsupported"
    if fp32.output == low:
        return "lower"
    if lowp.output == "float32":
        return "fp32"
    if mixed is not None and mixed.output == "float32":
        return "promote"
    return "unchanged"


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    """ValueError unless dtype is torch.float16 or torch.bfloat16."""
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast dtype must be torch.float16 or torch.bfloat16, got {_args.shown(dtype)}")
    return dtype


def _check_args(device_type: str, dtype: torch.dtype) -> torch.device:
    """Validate the device type and autocast dtype; return the device to probe on.

    'cuda' is accepted without a GPU: its table then comes from CUDA's autocast kernels in this torch
    build, run on fake CUDA tensors (see :func:`fake_cuda_available`).
    """
    _check_dtype(dtype)
    if isinstance(device_type, torch.device):  # a device, as torch.autocast's callers often hold one: its type
        device_type = device_type.type
    if not isinstance(device_type, str) or device_type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"unknown device_type {_args.shown(device_type)}; use 'cpu', 'cuda', 'mps' or 'xpu'")
    if device_type == "cuda" and not torch.cuda.is_available():
        if not fake_cuda_available():
            raise ValueError("device_type 'cuda' is not available here, and this torch build registers no CUDA "
                             "autocast kernels to probe; use 'cpu'")
        return torch.device("cuda")
    if device_type != "cpu":
        backend = getattr(torch, device_type, None) if device_type != "mps" else torch.backends.mps
        if backend is None or not backend.is_available():
            raise ValueError(f"device_type {device_type!r} is not available here; use 'cpu'")
    return torch.device(device_type)


def _check_ops(ops) -> None:
    """ValueError unless ops is a sequence of OpSpec."""
    if isinstance(ops, OpSpec) or not isinstance(ops, Sequence) or not all(isinstance(o, OpSpec) for o in ops):
        raise ValueError(f"ops must be a sequence of OpSpec (default: autocast_ops.OPS), got {_args.shown(ops)}")


def op_table(device_type: str, dtype: torch.dtype, ops: Sequence[OpSpec] = OPS) -> list[OpRow]:
    """Run each op under device_type's autocast at dtype and classify what autocast did to it.

    On a machine without a GPU, ``op_table("cuda", dtype)`` runs CUDA's own autocast kernels from this
    torch build on fake CUDA tensors (forward only, in a child process): the rows are CUDA's policy, not
    a copy of a list.

    Args:
        device_type: 'cpu', 'cuda' (a GPU or, without one, the fake-CUDA probe), 'mps' or 'xpu'.
        dtype: the autocast dtype, torch.float16 or torch.bfloat16.
        ops: the ops to probe (default :data:`OPS`); an ``OpSpec(name, shapes, call)`` may call any torch
            function, an ``nn.functional`` op or ``torch.ops.aten.<op>.<overload>`` directly.

    Example:
        >>> rows = {r.op: r for r in op_table("cuda", torch.bfloat16)}
        >>> rows["softmax"].category, rows["softmax"].kind
        ('fp32', 'fp32_set_opt_dtype')
    """
    device = _check_args(device_type, dtype)
    _check_ops(ops)
    if device.type == "cuda" and not torch.cuda.is_available():
        return _fake_cuda_table(dtype, tuple(ops))
    low = _name(dtype)
    pol = policy("cuda", dtype) if device.type == "cuda" else None  # on a GPU: the fp32 kinds, as without one
    rows = []
    for spec in ops:
        fp32, lowp, mixed = _three_probes(spec, lambda s, d: _probe(s, d, device, dtype), dtype)
        category = _categorise(low, fp32, lowp, mixed)
        reason = _reason(fp32, lowp) if category == "unsupported" else None
        entered = _entered_real(spec, dtype, device) if pol is not None and category != "unsupported" else None
        kind = _kind_of(entered, pol) if pol is not None and category == "fp32" else None
        rows.append(OpRow(spec.name, category, fp32, lowp, mixed, kind=kind, reason=reason, entered=entered))
    return rows


def _entered_real(spec: OpSpec, dtype: torch.dtype, device: torch.device) -> str | None:
    """The aten op a low-precision call of spec enters on a real device, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    inputs = [(torch.rand(s) + 0.5).to(device=device, dtype=dtype) for s in spec.shapes]
    try:
        with torch.amp.autocast(device.type, dtype=dtype), profile(activities=[ProfilerActivity.CPU]) as prof:
            spec.call(*inputs)
    except Exception:  # noqa: BLE001 - the row keeps entered=None
        return None
    top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return top[-1] if top else None


def _three_probes(spec: OpSpec, run: Callable, dtype: torch.dtype) -> tuple[Probe, Probe, Probe | None]:
    """The fp32-in, low-in and (2+ inputs) mixed-in probes of one op."""
    n = len(spec.shapes)
    fp32 = run(spec, [torch.float32] * n)
    lowp = run(spec, [dtype] * n)
    mixed = run(spec, [dtype] + [torch.float32] * (n - 1)) if n > 1 else None
    return fp32, lowp, mixed


def _reason(fp32: Probe, lowp: Probe) -> str:
    """Why a row is unsupported: the first error seen."""
    return (fp32 if fp32.failed else lowp).output.removeprefix("error: ")


# ---------------------------------------------------------------------------------------------------------------
# CUDA's policy without a GPU: this build's AutocastCUDA kernels on fake CUDA tensors, in a child process.
#
# Why a child: anything that requires grad on a fake CUDA tensor aborts the process from C++ (not catchable),
# and a caller's OpSpec may build one. Why fake tensors: CUDA's autocast wrapper casts only tensors whose device
# is CUDA, and a FakeTensor over a meta tensor claims to be on cuda:0 without memory or kernels behind it.
# torch.autocast("cuda") disables itself when no GPU is present; the setters below do not, so the probe sets
# and restores the autocast state itself (and clears the autocast cache, which the setters leave alone).
# ---------------------------------------------------------------------------------------------------------------

_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}


def registered_ops(device_type: str = "cuda") -> list[str]:
    """Every aten overload with an autocast kernel for device_type in this torch build, sorted.

    Read from the dispatcher (``torch._C._dispatch_get_registrations_for_dispatch_key``), keeping only real
    kernels (a registered fallthrough is autocast leaving the op alone).

    Args:
        device_type: 'cuda' or 'cpu'.

    Example:
        >>> "aten::mm" in registered_ops("cuda")
        True
    """
    if device_type not in _KEYS:
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {_args.shown(device_type)}")
    key = _KEYS[device_type]
    names = []
    for name in torch._C._dispatch_get_registrations_for_dispatch_key(key):
        line = next((ln for ln in torch._C._dispatch_dump_table(name).splitlines() if ln.startswith(key + ":")), "")
        if "fallthrough" not in line:
            names.append(name)
    return sorted(names)


def fake_cuda_available() -> bool:
    """True when this torch build registers CUDA autocast kernels (every CPU and CUDA wheel seen does)."""
    return "aten::mm" in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")


@contextmanager
def _cuda_autocast_state(dtype: torch.dtype | None) -> Iterator[None]:
    """CUDA autocast on at dtype (off when dtype is None) for this thread; the previous state and an empty cache
    afterwards. Off is set, not assumed: a forked probe inherits its caller's autocast state (a caller inside
    CUDA's autocast, or the emulator, would otherwise make the probe's "autocast off" call an autocast call)."""
    prev = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    torch.set_autocast_enabled("cuda", dtype is not None)
    if dtype is not None:
        torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
        torch.clear_autocast_cache()


def _quiet_fake_logs() -> None:
    """FakeTensor logs a traceback for every meta kernel that raises; the probe expects many (child only)."""
    import logging

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


def _fake_probe(spec: OpSpec, dtypes: Sequence[torch.dtype], fake_mode, amp_dtype: torch.dtype) -> Probe:
    """Run spec on fake CUDA tensors of the given dtypes under CUDA autocast; record the output dtype."""
    from torch._subclasses.fake_tensor import FakeTensor

    inputs = [FakeTensor(fake_mode, torch.empty(shape, device="meta", dtype=dt), torch.device("cuda", 0))
              for shape, dt in zip(spec.shapes, dtypes)]
    try:
        with fake_mode, _cuda_autocast_state(amp_dtype):  # under the mode, factories (targets) are fake too
            out = spec.call(*inputs)
        result = _name(out.dtype)
    except Exception as err:  # noqa: BLE001 - any failure of a probe is a reported row, never a crash
        result = "error: " + _args.first_line(err, 200, type(err).__name__)
    return Probe(tuple(_name(d) for d in dtypes), result)


def _entered(spec: OpSpec, dtype: torch.dtype, fake_mode) -> str | None:
    """The aten op a low-precision call of spec enters, from a profiler trace of the fake-CUDA call."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.profiler import ProfilerActivity, profile

    inputs = [FakeTensor(fake_mode, torch.empty(s, device="meta", dtype=dtype), torch.device("cuda", 0))
              for s in spec.shapes]
    try:
        with fake_mode, _cuda_autocast_state(dtype), profile(activities=[ProfilerActivity.CPU]) as prof:
            spec.call(*inputs)
    except Exception:  # noqa: BLE001 - the row keeps entered=None
        return None
    # the last top-level op: a call that builds its targets first (arange) then enters the loss
    top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return top[-1] if top else None


def _kind_of(entered: str | None, policy: dict[str, "Policy"]) -> str | None:
    """The fp32 kind of the aten op a call entered, when all its registered overloads agree."""
    if entered is None:
        return None
    # overloads the probe could not run (a named-tensor one, registered by some builds) say nothing of the kind
    kinds = {p.kind for name, p in policy.items()
             if (name == entered or name.startswith(entered + ".")) and p.category != "unsupported"}
    return kinds.pop() if len(kinds) == 1 else None


def _fake_rows(dtype: torch.dtype, ops: tuple[OpSpec, ...], policy: dict[str, "Policy"]) -> list[OpRow]:
    """Probe each op on fake CUDA tensors (runs in the child)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _quiet_fake_logs()
    low = _name(dtype)
    rows = []
    for spec in ops:
        mode = FakeTensorMode()
        fp32, lowp, mixed = _three_probes(spec, lambda s, d: _fake_probe(s, d, mode, dtype), dtype)
        category = _categorise(low, fp32, lowp, mixed)
        entered = _entered(spec, dtype, mode) if category != "unsupported" else None
        kind = _kind_of(entered, policy) if category == "fp32" else None
        reason = _reason(fp32, lowp) if category == "unsupported" else None
        rows.append(OpRow(spec.name, category, fp32, lowp, mixed, kind=kind, reason=reason, entered=entered))
    return rows


def _died(spec: OpSpec, why: str) -> OpRow:
    """The row of an op whose probe process died (a C++ abort: e.g. a tensor that requires grad)."""
    probe = Probe(tuple("float32" for _ in spec.shapes), "error: " + why)
    return OpRow(spec.name, "unsupported", probe, probe, None, reason=why)


_TABLES: dict[tuple, list[OpRow]] = {}


def _fake_cuda_table(dtype: torch.dtype, ops: tuple[OpSpec, ...]) -> list[OpRow]:
    """CUDA's op table from fake CUDA tensors: all ops in one child process; op by op if it dies."""
    key = (torch.__version__, dtype, tuple((s.name, s.shapes, s.call) for s in ops))
    if key in _TABLES:
        return list(_TABLES[key])
    path = _cache_file("cuda", dtype, "table") if ops == OPS else None  # the default table keeps on disk
    rows = _read_rows(path)
    if rows is not None:
        _TABLES[key] = rows
        return list(rows)
    pol = policy("cuda", dtype)
    rows, why = _in_child(_fake_rows, dtype, ops, pol)
    if rows is None:  # one op took the process down: find which, each in its own child
        rows = []
        for spec in ops:
            one, why = _in_child(_fake_rows, dtype, (spec,), pol)
            rows.extend(one if one is not None else [_died(spec, why)])
    _TABLES[key] = rows
    _write_json(path, [dataclasses.asdict(r) for r in rows])
    return list(rows)


def _read_rows(path: Path | None) -> list[OpRow] | None:
    """Rows from a cached table, or None (no cache, or unreadable)."""
    data = _read_json(path)
    if data is None:
        return None
    try:
        def probe(d):
            return None if d is None else Probe(tuple(d["inputs"]), d["output"])
        return [OpRow(**{**d, "from_fp32": probe(d["from_fp32"]), "from_low": probe(d["from_low"]),
                         "from_mixed": probe(d["from_mixed"])}) for d in data]
    except (KeyError, TypeError):
        return None


def _read_json(path: Path | None):
    """The JSON in path, or None when there is none or it is unreadable (then it is probed again)."""
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else None
    except (OSError, ValueError):
        return None


def _write_json(path: Path | None, data) -> None:
    """Write data to path atomically; a read-only cache directory only costs a probe next time."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass


def _silence_fds() -> None:
    """Send the child's stdout/stderr file descriptors to /dev/null: torch's C++ warnings and the profiler's
    start/stop lines would otherwise reach a notebook's output (ipykernel forwards file-descriptor output)."""
    import faulthandler

    faulthandler.disable()  # a probe that aborts would dump a traceback through the parent's (pytest's) stderr
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


_CHILD_TIMEOUT = 600.0  # seconds: every probe measured here takes under 15 s, on a busy 2-core machine


_CHILD_MODES_OFF = None  # set in a forked probe only: see _fresh_thread_state


def _fresh_thread_state() -> None:
    """In a forked probe: drop the thread state fork copied from the caller, so a probe measures torch, not its caller.

    A probe started inside the doctor's op watch (a dispatch mode that reads every output: ``.item()`` raised on
    every fake tensor, so all 126 overloads read "not probeable"), inside CUDA's autocast or inside an emulation
    (binary_cross_entropy's "autocast off" call still under autocast) was cached per build with those answers. The
    child leaves every dispatch and function mode, switches autocast off on every device and takes the
    AutocastCPU key out of the thread's included keys (the emulator puts it there); it never returns to the caller.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    global _CHILD_MODES_OFF
    # pops the user, infra and pre-dispatch modes; kept referenced, since a discarded context manager's generator
    # is closed at garbage collection and its cleanup pushes the modes back (the child exits with os._exit)
    _CHILD_MODES_OFF = _disable_current_modes()
    _CHILD_MODES_OFF.__enter__()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for device_type in ("cpu", "cuda"):
        torch.set_autocast_enabled(device_type, False)
    torch._C._dispatch_tls_set_dispatch_key_included(torch._C.DispatchKey.AutocastCPU, False)
    torch.clear_autocast_cache()


def _in_child(fn: Callable, *args, timeout: float = _CHILD_TIMEOUT):
    """fn(*args) in a forked child process: (result, None), or (None, why) when the child died or hung.

    Without fork (Windows), fn runs in this process: a probe that aborts then takes the caller down.
    """
    if not hasattr(os, "fork"):
        return fn(*args), None
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork() with threads alive (a Jupyter kernel has some):
        warnings.simplefilter("ignore", DeprecationWarning)  # the child runs only the probe, bounded by `timeout`
        pid = os.fork()
    if pid == 0:  # the child: run, send the pickled result, leave without running the parent's atexit hooks
        code = 0
        try:
            os.close(read)
            _silence_fds()
            _fresh_thread_state()
            with os.fdopen(write, "wb") as out:
                pickle.dump(fn(*args), out)
        except BaseException:  # noqa: BLE001 - reported to the parent as a dead child
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    data, deadline = b"", time.monotonic() + timeout
    with os.fdopen(read, "rb", buffering=0) as inp:
        while True:  # read until the child closes the pipe, or give up at the deadline (a child that hangs)
            ready, _, _ = select.select([inp], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None, f"the probe process took longer than {timeout:.0f} s and was stopped"
            chunk = inp.read(1 << 16)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    if data and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return pickle.loads(data), None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return None, f"the probe process died ({'signal ' + str(sig) if sig else 'exit ' + str(os.WEXITSTATUS(status))})"


# ---------------------------------------------------------------------------------------------------------------
# The policy of every registered overload, probed from its schema (what the emulator applies).
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What device_type's autocast does to one aten overload, as probed.

    ``category`` is a key of :data:`CATEGORIES`; ``kind`` the fp32 flavour (see :class:`OpRow`), or ``'fp16'``
    for a ``'lower'`` overload that casts to float16 whatever the region's dtype (``_cudnn_rnn``, see
    :func:`_cudnn_rnn_args`);
    ``reason`` why it is ``'unsupported'`` (the error CUDA autocast raises for a banned op, or what the
    probe could not tell).
    """

    op: str  # 'aten::softmax.int'
    category: str
    kind: str | None = None
    reason: str | None = None
    #: output dtype names of the schema-built call (see :func:`schema_args`) with fp32, low and mixed inputs
    #: on fake CUDA tensors (None where the call raised): what a check of the emulator compares against
    outputs: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "outputs", tuple(self.outputs))  # a list, when read back from the JSON cache


def _overload(name: str):
    """torch.ops.aten.softmax.int for 'aten::softmax.int'."""
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def schema_args(op, make: Callable[[], torch.Tensor]) -> tuple[list, dict, list]:
    """Arguments for an aten overload built from its schema: tensors from make(), defaults, small scalars.

    Returns (args, kwargs, tensors made). The same arguments, with CPU tensors from make(), let a check run
    the emulator on exactly the call the policy probe made on fake CUDA tensors.

    The shapes need not suit the op: autocast's wrapper casts the inputs before the op checks them, so a
    cast is seen even when the op then raises.
    """
    # a Scalar of 1.0, not 2.0: linalg_matrix_norm(ord=2) rejects fp16/bf16 inputs before anything is dispatched, so
    # no cast was seen and CUDA's fp32 overload read "not probeable" (ord=1 reaches the wrapper; pow(x, 1.0) too)
    plain = {"int": 1, "float": 1.0, "bool": False, "str": "ij,jk->ik", "number": 1.0, "List[int]": [1]}
    args, kwargs, tensors = [], {}, []
    for a in op._schema.arguments:
        t = str(a.type)
        if t in ("Tensor", "Optional[Tensor]"):
            v = make()
            tensors.append(v)
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            v = [make(), make()]
            tensors.extend(v)
        elif a.has_default_value():
            v = a.default_value
        elif t.startswith("Optional"):
            v = None
        else:
            v = plain.get(t)
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    return args, kwargs, tensors


def _cudnn_rnn_args(op, args: list, kwargs: dict, fake_mode) -> None:
    """Make the schema-built ``_cudnn_rnn`` call one its autocast wrapper can run without a GPU (in place).

    The wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp, ``_cudnn_rnn_cast_reflatten``; read on pytorch/pytorch)
    asserts ``weight_stride0`` is 2 or 4 (3 or 5 with ``proj_size``): the plain int 1 failed that INTERNAL ASSERT,
    and the policy read "CUDA autocast raises", as if CUDA banned the op. Weights not already float16 are cast
    and re-flattened through cuDNN descriptors, which need a GPU; so the weights here are float16 (two per layer,
    no bias, no flat buffer) and what the probe sees is the cast of input, hx and cx: to ``at::kHalf``, hard-coded,
    in bf16 regions too (the 2.11+cu130 and 2.15+cu132 wheels cast to float16 under bf16 autocast; pytorch#164411
    let cuDNN RNNs take bf16 inputs, it did not change the wrapper's cast).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    names = [a.name for a in op._schema.arguments]

    def half() -> torch.Tensor:
        return FakeTensor(fake_mode, torch.empty((2, 2), device="meta", dtype=torch.float16), torch.device("cuda", 0))

    for name, value in (("weight", [half(), half()]), ("weight_stride0", 2), ("weight_buf", None), ("proj_size", 0),
                        ("dropout_state", None)):
        args[names.index(name)] = value


#: ops whose schema-built call needs adjusting before their autocast wrapper accepts it
_PROBE_ARGS = {"aten::_cudnn_rnn": _cudnn_rnn_args}


def _record(op, dtypes: Sequence[torch.dtype], amp_dtype: torch.dtype | None, fake_mode):
    """Call op on fake CUDA inputs (first dtypes[0], the rest dtypes[1]) and record what reached the backend.

    Returns (casts, dtype_calls, error, dispatched, output): the inputs cast (index, to dtype), the calls made
    with a ``dtype`` argument of float32 (the op name), the error raised, how many ops were dispatched, and
    the output's dtype (None when it raised or returned no tensor).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list[torch.Tensor] = []

    def make() -> torch.Tensor:
        dt = dtypes[0] if not made else dtypes[1]
        made.append(FakeTensor(fake_mode, torch.empty((2, 2), device="meta", dtype=dt), torch.device("cuda", 0)))
        return made[-1]

    args, kwargs, tensors = schema_args(op, make)
    adjust = _PROBE_ARGS.get(op._schema.name)  # 'aten::_cudnn_rnn': the op's name, every overload
    if adjust is not None:
        adjust(op, args, kwargs, fake_mode)
    ids = {id(t): i for i, t in enumerate(tensors)}

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.casts, self.dtype_calls, self.count = [], [], 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            kw = kw or {}
            self.count += 1
            if func is torch.ops.aten._to_copy.default and a and id(a[0]) in ids and "dtype" in kw:
                self.casts.append((ids[id(a[0])], kw["dtype"]))
            if torch.float32 in (kw.get("dtype"), *[x for x in a if isinstance(x, torch.dtype)]):
                self.dtype_calls.append(func.name())
            return func(*a, **kw)

    rec = Recorder()
    err = out = None
    with fake_mode, _cuda_autocast_state(amp_dtype), rec:
        try:
            result = op(*args, **kwargs)
            first = result[0] if isinstance(result, (tuple, list)) and result else result
            out = first.dtype if isinstance(first, torch.Tensor) else None
        except Exception as e:  # noqa: BLE001 - the error is part of what the probe learns
            err = _args.first_line(e, default=type(e).__name__)
    return rec.casts, rec.dtype_calls, err, rec.count, out


def _classify(name: str, dtype: torch.dtype, fake_mode) -> Policy:
    """The policy of one registered overload from three recorded calls (and one without autocast)."""
    op = _overload(name)
    f32, low = torch.float32, dtype
    # the schema shows a Dimname as `str`: the overload's name tells (softmax.Dimname, sum.dim_DimnameList, norm.names_...)
    if re.search(r"(?i)dimname|^names_", name.partition(".")[2]):  # torch 2.11's CUDA build registers these
        return Policy(name, "unsupported", reason="not probeable: a named-tensor (Dimname) overload; the probe builds "
                      "unnamed tensors (the unnamed overloads of the op are probed)", outputs=(None, None, None))
    up_casts, _, err_f, n_f, out_f = _record(op, (f32, f32), dtype, fake_mode)
    low_casts, low_dtype_calls, err_l, n_l, out_l = _record(op, (low, low), dtype, fake_mode)
    mixed_casts, _, _, _, out_m = _record(op, (low, f32), dtype, fake_mode)
    outputs = tuple(None if o is None else _name(o) for o in (out_f, out_l, out_m))
    found = functools.partial(Policy, name, outputs=outputs)  # every verdict carries what the calls returned
    if any(to == low for _, to in up_casts):
        return found("lower")
    if any(to == torch.float16 for _, to in up_casts) and not any(to == f32 for _, to in up_casts):
        return found("lower", kind="fp16")  # cast down, to fp16 in a bf16 region: cuDNN RNNs (_cudnn_rnn_args)
    # cast up, called with dtype=float32, or (fp16 softmax: _softmax(half_to_float=True)) fp32 out of low in
    if any(to == f32 for _, to in low_casts) or low_dtype_calls or out_l == f32:
        has_dtype_arg = any(a.name == "dtype" for a in op._schema.arguments)
        # append_dtype: the wrapper calls a sibling overload with a dtype argument (norm.Scalar -> norm.ScalarOpt_dtype)
        packet = name.split(".")[0]
        appended = any(c != name and c.split(".")[0] == packet for c in low_dtype_calls)
        kind = "fp32_set_opt_dtype" if has_dtype_arg else "fp32_append_dtype" if appended else "fp32"
        return found("fp32", kind=kind)
    if any(to == f32 for _, to in mixed_casts):
        return found("promote")
    if err_f and n_f == 0 and err_l and n_l == 0:  # raised before anything was dispatched: autocast's own error?
        _, _, err_off, _, _ = _record(op, (f32, f32), None, fake_mode)
        if err_off != err_f:
            return found("unsupported", reason=f"CUDA autocast raises: {err_f}")
    return found("unsupported", reason="not probeable: no cast seen on the inputs built from its schema"
                  + (f" ({err_l[:60]})" if err_l else ""))


def _probe_policy(device_type: str, dtype: torch.dtype) -> dict[str, Policy]:
    """Every registered overload's policy (runs in the child)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _quiet_fake_logs()
    out = {}
    for name in registered_ops(device_type):
        try:
            out[name] = _classify(name, dtype, FakeTensorMode())
        except Exception as err:  # noqa: BLE001 - an overload this probe cannot call is reported, not guessed
            out[name] = Policy(name, "unsupported", reason=f"not probeable: {type(err).__name__}: {str(err)[:60]}")
    return out


def _rebuild(v, make: Callable):
    """An argument from its description (emulate.Call): tensors through make(shape, dtype)."""
    if isinstance(v, tuple) and len(v) == 3 and v[0] == "tensor":
        return make(v[1], getattr(torch, v[2]))
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "torch":
        name = v[1].removeprefix("torch.")
        return getattr(torch, name) if hasattr(torch, name) else torch.device("cuda" if "cpu" in name else name)
    if isinstance(v, (list, tuple)):
        return type(v)(_rebuild(x, make) for x in v)
    return v


def _replay_calls(calls: Sequence) -> list[str]:
    """Each call on fake CUDA tensors under CUDA autocast (runs in the child)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    _quiet_fake_logs()
    out = []
    for call in calls:
        mode = FakeTensorMode()

        def make(shape, dt):
            return FakeTensor(mode, torch.empty(shape, device="meta", dtype=dt), torch.device("cuda", 0))

        try:
            args = [_rebuild(a, make) for a in call.inputs]
            kwargs = {k: _rebuild(v, make) for k, v in call.kwargs.items()}
            with mode, _cuda_autocast_state(getattr(torch, call.autocast_dtype)):
                result = _overload(call.op)(*args, **kwargs)
            first = result[0] if isinstance(result, (tuple, list)) else result
            out.append(_name(first.dtype) if isinstance(first, torch.Tensor) else "no tensor")
        except Exception as err:  # noqa: BLE001 - a call fake CUDA cannot run is reported
            out.append("error: " + _args.first_line(err, 80, type(err).__name__))
    return out


def replay(calls: Sequence) -> list[str]:
    """Replay emulated calls (``emulate.Call``) on CUDA's real autocast kernels, on fake CUDA tensors.

    Returns each call's output dtype name under CUDA autocast (or ``'error: ...'``), to compare with
    the ``output`` the emulator produced. Runs in a child process, as every fake-CUDA probe does.

    Args:
        calls: what ``emulate.autocast(trace=True).calls`` recorded (calls with autocast off are skipped
            by the caller: nothing is cast there).

    Example:
        >>> with emulate.autocast(dtype=torch.bfloat16, trace=True) as emu:
        ...     model(x)
        >>> all(c.output == r for c, r in zip(emu.calls, replay(emu.calls)))
        True
    """
    result, why = _in_child(_replay_calls, list(calls))
    if result is None:
        raise RuntimeError(f"replaying on fake CUDA failed: {why}")
    return result


_POLICIES: dict[tuple, dict[str, Policy]] = {}


def _cache_file(device_type: str, dtype: torch.dtype, what: str = "policy") -> Path | None:
    """Where the probed policy is kept between processes: per torch build and per version of this module."""
    root = os.environ.get("AMPCOURSE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                              os.path.expanduser("~/.cache"), "ampcourse")
    if root in ("", "0", "off"):
        return None
    build = f"{torch.__version__}-{torch.version.git_version}-{Path(__file__).read_bytes()}"
    digest = hashlib.sha256(build.encode()).hexdigest()[:16]
    return Path(root) / f"autocast-{what}-{device_type}-{_name(dtype)}-{digest}.json"


def policy(device_type: str = "cuda", dtype: torch.dtype = torch.float16) -> dict[str, Policy]:
    """device_type's autocast policy for every overload with an autocast kernel, probed from this torch build.

    Each overload is called from its schema on fake CUDA tensors under CUDA autocast (in a child process),
    and what its autocast wrapper casts decides the category. Cached in memory and on disk
    (``~/.cache/ampcourse``, or ``$AMPCOURSE_CACHE``; ``AMPCOURSE_CACHE=off`` disables it), per torch build.

    Args:
        device_type: 'cuda' (the only device probed this way).
        dtype: the autocast dtype, torch.float16 or torch.bfloat16.

    Example:
        >>> policy("cuda", torch.bfloat16)["aten::softmax.int"].kind
        'fp32_set_opt_dtype'
    """
    if device_type != "cuda":
        raise ValueError(f"policy() probes CUDA's autocast kernels only; got device_type {_args.shown(device_type)}")
    _check_dtype(dtype)
    key = (torch.__version__, device_type, dtype)
    if key not in _POLICIES:
        _POLICIES[key] = _load_or_probe(device_type, dtype)
    return dict(_POLICIES[key])


def _load_or_probe(device_type: str, dtype: torch.dtype) -> dict[str, Policy]:
    """The policy from the disk cache, or probed in a child process (and stored)."""
    path = _cache_file(device_type, dtype)
    data = _read_json(path)
    if data is not None:
        try:
            return {d["op"]: Policy(**d) for d in data}
        except (KeyError, TypeError):
            pass  # a cache from another layout is probed again
    result, why = _in_child(_probe_policy, device_type, dtype)
    if result is None:
        raise RuntimeError(f"probing {device_type}'s autocast policy failed: {why}")
    _write_json(path, [dataclasses.asdict(p) for p in result.values()])
    return result


def _short(output: str) -> str:
    """'bfloat16' -> 'bf16', 'float32' -> 'fp32', errors -> 'error'."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(output, "error" if output.startswith("error") else output)


def _check_rows(rows, name: str) -> None:
    """ValueError unless rows is a sequence of OpRow (what op_table returns)."""
    if isinstance(rows, (str, OpRow)) or not isinstance(rows, Sequence) or not all(isinstance(r, OpRow) for r in rows):
        raise ValueError(f"{name} must be a list of OpRow, as op_table() returns, got {_args.shown(rows)}")


def format_table(rows: Sequence[OpRow]) -> str:
    """A plain-text table: op, output dtype for fp32 / low / mixed inputs, category (and the fp32 kind)."""
    _check_rows(rows, "rows")
    low = _short(rows[0].from_low.inputs[0]) if rows else "low"
    head = f"{'op':34} {'fp32 in':>8} {low + ' in':>8} {'mixed in':>9}  category"
    lines = [head, "-" * len(head)]
    for r in rows:
        mixed = _short(r.from_mixed.output) if r.from_mixed is not None else "-"
        kind = f" ({r.kind.removeprefix('fp32_')})" if r.kind and r.kind != "fp32" else ""
        lines.append(f"{r.op:34} {_short(r.from_fp32.output):>8} {_short(r.from_low.output):>8} {mixed:>9}  "
                     f"{r.category}{kind}")
    return "\n".join(lines)


def differences(a: Sequence[OpRow] | str, b: Sequence[OpRow] | str,
                dtype: torch.dtype = torch.float16) -> list[tuple[str, str, str]]:
    """Ops whose category differs between two tables: (op, category in a, category in b).

    Args:
        a, b: two tables from :func:`op_table`, or two device types ('cpu', 'cuda'), probed at dtype.
        dtype: the autocast dtype for device types given by name.

    Example:
        >>> ("softmax", "unchanged", "fp32") in differences("cpu", "cuda", torch.bfloat16)
        True
    """
    a = op_table(a, dtype) if isinstance(a, (str, torch.device)) else a
    b = op_table(b, dtype) if isinstance(b, (str, torch.device)) else b
    _check_rows(a, "a")
    _check_rows(b, "b")
    cats_b = {r.op: r.category for r in b}
    return [(r.op, r.category, cats_b[r.op]) for r in a if r.op in cats_b and cats_b[r.op] != r.category]
