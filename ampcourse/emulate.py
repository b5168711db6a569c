"""CUDA's autocast on a CPU: ``emulate.autocast`` gives CPU (and meta) tensors the casts CUDA autocast makes (chapters 3, 5 and 8).

    >>> import torch
    >>> from ampcourse import emulate
    >>> x, w = torch.randn(4, 8), torch.randn(3, 8)
    >>> with emulate.autocast("cuda", dtype=torch.bfloat16):
    ...     y = torch.nn.functional.linear(x, w)       # CUDA: a matmul runs low
    ...     p = torch.softmax(y, dim=-1)                # CUDA: softmax runs in fp32 (CPU autocast keeps bf16)
    >>> y.dtype, p.dtype
    (torch.bfloat16, torch.float32)

The interface (stable; other modules build on it):

- ``autocast(device_type="cuda", dtype=torch.float16, enabled=True, cache_enabled=True, trace=False)``:
  a context manager (and decorator) used like ``torch.autocast``. It nests, ``enabled=False`` opens a
  region without casts, and on exit it leaves no autocast state, no cast cache and no registration behind.
  With ``trace=True`` its ``.calls`` lists every autocast op it handled (:class:`Call`: the aten overload,
  the policy applied, input and output dtypes, the arguments' shapes) for checks against the real kernels.
  ``.fallbacks`` names ops that ran in fp32 because this CPU has no fp16/bf16 kernel for them.
- ``is_active()``: True inside an emulation in this thread.
- ``autocast_state(device_type)``: (enabled, dtype) as code holding tensors of that device would see on a GPU
  (inside an emulation ``torch.is_autocast_enabled("cpu")`` is True in every region and CPU's dtype is bf16).
- ``policy(dtype)``: the per-overload policy applied (``autocast_ops.policy("cuda", dtype)``, probed from
  this torch build's CUDA autocast kernels; never a typed list).
- ``LIMITS``: what it cannot reproduce.

Inside the region, as on a GPU:

- every aten overload that has an ``AutocastCUDA`` kernel in this torch build gets CUDA's policy
  (``lower``: floating inputs cast to ``dtype``; ``fp32``: cast to fp32, an explicit ``dtype=`` argument of
  a set_opt_dtype op kept; ``promote``: the widest floating input type) on its CPU/meta floating inputs
  (fp64 and integer tensors are never cast); ops CUDA bans (``binary_cross_entropy``) raise CUDA's error;
  every other op runs as called (CPU autocast's own lists are switched off);
- ``nn.LSTM``/``GRU``/``RNN`` run as through cuDNN, whose autocast wrapper casts input, hidden state and weights
  to float16, in bf16 regions too (see ``_rnn_dtype``);
- fp32 leaf tensors that require grad (weights) are cast once per region (the weight-cast cache);
- ``torch.autocast("cuda", ...)`` inside the code (Hugging Face models open such regions) and
  ``torch.amp.custom_fwd/custom_bwd(device_type="cuda")`` work as on a GPU. Since CPU tensors stand for CUDA
  tensors, ``torch.autocast("cpu", ...)`` inside an emulation opens CUDA's region too: device-derived code
  (``torch.autocast(x.device.type, enabled=False)``, HF's RoPE) acts as it would on a GPU, and a training loop
  written for CPU autocast (ampcourse's ``train_step``, the doctor) gets CUDA's policy by running inside one
  outer ``emulate.autocast(enabled=False)``.
  Make the ``torch.autocast`` object inside the region too: one made before the region and entered inside it is a
  plain CPU autocast that this emulation does not see, and its ops run in fp32 (the doctor gallery's gradient
  check measured fp32 against fp32 that way until it moved its ``torch.autocast(...)`` call inside);
  ``custom_bwd`` needs the backward pass inside an emulation (``with emulate.autocast(enabled=False):
  loss.backward()``), since on exit the emulator leaves nothing behind for it; so does activation checkpointing
  (``torch.utils.checkpoint``), whose recompute in backward re-enters the region its forward ran in;
- ``torch.is_autocast_enabled("cuda")`` and ``torch.get_autocast_dtype("cuda")`` read as on a GPU.

How, and why at this level: the casts are applied where torch applies them, at the dispatcher's autocast
key, before an op is decomposed. For the region's duration, a Python kernel is registered (``torch.library``)
at the ``AutocastCPU`` key for each overload CUDA registers (and a fallthrough for those only CPU
registers), the CPU autocast key is switched on (and added to the thread's dispatch keys, so meta tensors,
which carry no autocast key, reach it too), and each kernel reads CUDA's autocast state. A
``TorchDispatchMode`` would be the wrong level: it sees the pieces (``addmm`` for ``linear``, ``_softmax``,
``nll_loss_forward``), after autograd. A ``TorchFunctionMode`` would see the Python call but not the
registered ops reached inside C++ composites (``cross_entropy_loss``, on no list, calls ``log_softmax`` and
``nll_loss``, which are: on CUDA ``nll_loss`` runs in fp32). At the autocast key both are right, and autograd records the casts, so backward runs in the
dtypes CUDA's would.

While any thread emulates, real CPU autocast in other threads is suspended (the kernels are process-wide).

Cost (measured on the course's 2-core CPU machine, torch 2.13): the first emulation in a process probes the
policy (seconds; then read from the disk cache); each outermost enter/exit registers and removes the
kernels (~20 ms), so a training loop should sit inside one outer ``emulate.autocast(enabled=False)`` and
open its per-step regions inside it; each autocast op costs a Python call (~70 us more than CPU autocast).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import _args, _errors, autocast_ops, formats
from .autocast_ops import Policy

__all__ = ["autocast", "autocast_state", "is_active", "policy", "session", "Call", "LIMITS"]

#: What the emulator does not reproduce: dtypes and casts are CUDA's, the arithmetic inside each op is the CPU's.
LIMITS: tuple[str, ...] = (
    "accumulation inside kernels: a CPU bf16/fp16 matmul accumulates in its own way, not as cuBLAS does "
    "(cuBLAS may also use reduced-precision reductions for fp16/bf16, torch.backends.cuda.matmul."
    "allow_fp16_reduced_precision_reduction / allow_bf16_reduced_precision_reduction)",
    "TF32: on Ampere and later, fp32 matmuls and convolutions may run with TF32 (10-bit mantissa) inputs; here "
    "fp32 ops are full fp32 (ampcourse's chapter 10 emulates TF32 separately)",
    "fused attention: CUDA's flash and memory-efficient SDPA kernels keep the softmax in fp32 inside the kernel; "
    "the CPU kernel run here has its own internal precision",
    "ops without a CPU kernel for fp16/bf16 run in fp32 with their output cast to the autocast dtype "
    "(listed in .fallbacks)",
    "ops the policy probe could not classify run unchanged (autocast_ops.policy() gives the reason); the registered "
    "ops they call inside still get CUDA's policy, as under a real autocast fallthrough",
    "RNN modules (nn.LSTM, nn.GRU, nn.RNN) run as through cuDNN, whose autocast wrapper (_cudnn_rnn) casts input, "
    "hidden state and weights to float16 in fp16 and bf16 regions alike; with torch.backends.cudnn.enabled=False "
    "CUDA takes its native RNN path instead, whose inner matmuls follow the lists: that path is not emulated (the "
    "RNN runs unchanged)",
    "named tensors (torch 2.11; gone in 2.13) cannot reach the Python kernels the emulator registers: an op on one "
    "raises inside a region (drop the names first, tensor.rename(None))",
)

_NAMED_NYI = "NYI: Named tensors are currently unsupported in TorchScript"  # torch 2.11, a named tensor in a region
_KEY = torch._C.DispatchKey.AutocastCPU
_KEYSET = torch._C.DispatchKeySet(_KEY)
_LOW = formats.AUTOCAST_DTYPES  # one home: ampcourse.formats


@dataclass(frozen=True)
class Call:
    """One autocast op the emulator handled (``trace=True``)."""

    op: str  # 'aten::linear'
    category: str  # the policy applied: 'lower', 'fp32', 'promote', 'unsupported', or 'off' (autocast disabled)
    inputs: tuple  # the arguments as called: tensors as ('tensor', shape, dtype name), other values as given
    kwargs: dict
    output: str | None  # the first tensor output's dtype name
    autocast_dtype: str | None = None  # CUDA's autocast dtype in effect ('bfloat16'), None with autocast off


class _Local(threading.local):
    """Per-thread emulation state: depth, the weight-cast cache, the trace being recorded."""

    def __init__(self):
        self.depth = 0
        self.cache: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its low-precision cast)
        self.traces: list[list[Call]] = []
        self.fallbacks: set[str] = set()


_local = _Local()
_lock = threading.RLock()
_global = {"refs": 0, "lib": None, "patched": None}


def is_active() -> bool:
    """True inside an emulation in this thread."""
    return _local.depth > 0


def autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for tensors of ``device_type``, and its dtype, as code holding them would see on a GPU.

    Code that reads the state by its tensors' device (``torch.is_autocast_enabled(x.device.type)``) reads CPU's
    inside an emulation, where CPU tensors stand for CUDA ones: the CPU autocast key is on in every emulated
    region (``enabled=False`` ones too: the kernels sit there) and CPU's dtype is its own default (bf16), never the
    region's. Read it through this function instead: inside an emulation "cpu" (and "meta") gives CUDA's state.

    Args:
        device_type: the tensors' device type ("cpu", "cuda", "meta", ...).

    Returns:
        (enabled, dtype): torch.is_autocast_enabled and torch.get_autocast_dtype for that device, or for "cuda"
        inside an emulation.

    Example:
        >>> with autocast("cuda", dtype=torch.float16, enabled=False):
        ...     torch.is_autocast_enabled("cpu"), autocast_state("cpu")
        (True, (False, torch.float16))
    """
    if is_active() and device_type in ("cpu", "meta"):
        device_type = "cuda"
    if device_type == "meta":  # outside an emulation meta tensors get no autocast
        return False, torch.get_autocast_dtype("cpu")
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def policy(dtype: torch.dtype = torch.float16) -> dict[str, Policy]:
    """The per-overload policy the emulator applies for dtype: CUDA's, probed from this torch build.

    Args:
        dtype: torch.float16 or torch.bfloat16.

    Example:
        >>> policy(torch.bfloat16)["aten::softmax.int"].category
        'fp32'
    """
    return autocast_ops.policy("cuda", dtype)


# --- casting, as autocast_mode.h does it ---------------------------------------------------------------------


def _eligible(t) -> bool:
    """A floating tensor on CPU or meta that is not fp64 (CUDA's rule, with CPU/meta standing for CUDA)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
            and t.device.type in ("cpu", "meta"))


def _cast_one(t: torch.Tensor, to: torch.dtype, low: torch.dtype) -> torch.Tensor:
    """t cast to `to`, through the weight-cast cache for fp32 leaf tensors that require grad (weights)."""
    if t.dtype == to:
        return t
    cacheable = (to == low and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                 and not t._is_view() and torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled())
    if not cacheable:
        return t.to(to)
    # as torch's cached_cast: keyed by the tensor, no version check (a weight changed in place inside the region
    # keeps its old cast there, on CUDA too), dropped when the outermost region exits
    hit = _local.cache.get(id(t))
    if hit is not None and hit[0]() is t and hit[1].dtype == to:  # (a nested region of the other dtype: cast anew)
        return hit[1]
    # made with gradients on, as torch's (pytorch#158232): a cast cached under no_grad (an evaluation, a reentrant
    # checkpoint's forward) is reused by the next forward in the region, whose weights must still get gradients
    with torch.enable_grad():
        out = t.to(to)
    _local.cache[id(t)] = (weakref.ref(t), out)
    return out


def _cast(value, to: torch.dtype, low: torch.dtype):
    """Cast eligible tensors in value (a tensor, or a list/tuple of them) to `to`."""
    if _eligible(value):
        return _cast_one(value, to, low)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, to, low) for v in value)
    return value


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    """Every tensor in the arguments, lists included."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def _promote_type(args, kwargs, low: torch.dtype) -> torch.dtype:
    """The widest eligible floating type, starting from low (at::autocast::promote_type)."""
    current = low
    for t in _tensors(args, kwargs):
        if not _eligible(t):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif not (current == low and t.dtype == low):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _first_tensor(args, kwargs):
    """The first tensor argument (set_opt_dtype and append_dtype look only at it)."""
    return next(_tensors(args, kwargs), None)


@contextlib.contextmanager
def _below() -> Iterator[None]:
    """Run what follows under the autocast key, as the real wrapper does (inner ops are not cast again)."""
    with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
        yield


def _describe(v):
    """A picklable description of an argument: tensors by shape and dtype (for tracing)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), autocast_ops._name(v.dtype))
    if isinstance(v, (list, tuple)):
        return type(v)(_describe(x) for x in v)
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("torch", str(v))
    return v


def _first_dtype(out) -> str | None:
    """The dtype name of the first tensor in out."""
    if isinstance(out, torch.Tensor):
        return autocast_ops._name(out.dtype)
    if isinstance(out, (list, tuple)):
        return next((d for d in map(_first_dtype, out) if d is not None), None)
    return None


def _fp32_then_low(op, args, kwargs, low: torch.dtype):
    """Run op in fp32 and cast its floating outputs to low (CPU lacks the low-precision kernel)."""
    out = op(*_cast(list(args), torch.float32, low), **{k: _cast(v, torch.float32, low) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor):
        return out.to(low) if out.is_floating_point() else out
    if isinstance(out, tuple):
        return tuple(o.to(low) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
    return out


# --- the kernels ---------------------------------------------------------------------------------------------


def _make_kernel(name: str):
    """The AutocastCPU kernel that applies CUDA's policy for one overload."""
    op = autocast_ops._overload(name)
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if "dtype" in names else None
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")

    def kernel(*args, **kwargs):
        if not (_local.depth and torch.is_autocast_enabled("cuda")):
            with _below():
                out = op(*args, **kwargs)
            _trace(name, "off", args, kwargs, out, None)
            return out
        called = (args, kwargs)  # traced as called, before the casts: a replay on real kernels starts from here
        low = torch.get_autocast_dtype("cuda")
        pol = policy(low if low in _LOW else torch.float16).get(name)
        category = pol.category if pol is not None else "unchanged"
        if category == "unsupported" and pol.reason.startswith("CUDA autocast raises: "):
            raise RuntimeError(pol.reason.removeprefix("CUDA autocast raises: "))
        args = list(args)
        if category == "lower" or category == "promote":
            to = low if category == "lower" else _promote_type(args, kwargs, low)
            to = torch.float16 if pol.kind == "fp16" else to  # _cudnn_rnn: float16 in bf16 regions too (_rnn_dtype)
            args, kwargs = _cast(args, to, low), {k: _cast(v, to, low) for k, v in kwargs.items()}
        elif category == "fp32" and _eligible(_first_tensor(args, kwargs)):
            if pol.kind == "fp32_set_opt_dtype" and dtype_at is not None:
                if dtype_at < len(args):  # keep an explicit dtype, as set_opt_dtype does
                    args[dtype_at] = torch.float32 if args[dtype_at] is None else args[dtype_at]
                elif kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
            else:
                args, kwargs = _cast(args, torch.float32, low), {k: _cast(v, torch.float32, low)
                                                                 for k, v in kwargs.items()}
        if category == "unsupported" and composite:
            # an overload the probe could not classify: as a fallthrough would, run its composite kernel with the
            # autocast key still on, so the registered ops it calls inside get CUDA's policy (linalg_matrix_norm
            # calls linalg_vector_norm, fp32 on CUDA); running it below the key left every one of them uncast
            out = op.decompose(*args, **kwargs)
        else:
            out = _run_below(name, op, args, kwargs, low)
        _trace(name, category, *called, out, low)
        return out

    return kernel


def _run_below(name: str, op, args, kwargs, low: torch.dtype):
    """op below the autocast key; in fp32, its output cast to low, where this CPU has no low-precision kernel."""
    with _below():
        try:
            return op(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as err:
            if not _errors.missing_low_kernel(err):
                raise
            _local.fallbacks.add(name)
            return _fp32_then_low(op, args, kwargs, low)


#: the RNN overloads nn.LSTM, nn.GRU and nn.RNN call (padded input, and packed data with batch_sizes)
_RNN_OPS = tuple(f"aten::{rnn}.{form}" for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu") for form in ("input", "data"))


def _rnn_dtype(low: torch.dtype) -> torch.dtype:
    """The dtype CUDA's cuDNN RNN wrapper casts to in a region of dtype low: float16, in bf16 regions too.

    aten/src/ATen/cudnn/AutocastRNN.cpp (``_cudnn_rnn_cast_reflatten``, pytorch/pytorch) hard-codes ``at::kHalf``
    for the input, hx, cx and the re-flattened weights; the probe confirms it where this build registers the kernel
    (the policy's ``kind='fp16'`` in bf16 regions: 2.11+cu130, 2.15+cu132). A build without cuDNN (the +cpu wheels)
    registers none; the CUDA wheel of the same version does, hence float16 then too.
    """
    pol = policy(low if low in _LOW else torch.float16).get("aten::_cudnn_rnn")
    if pol is not None and pol.category == "lower" and pol.kind != "fp16":
        return low
    return torch.float16


def _make_rnn_kernel(name: str):
    """The AutocastCPU kernel for an RNN overload: what CUDA's ``_cudnn_rnn`` autocast wrapper does.

    On CUDA ``lstm``/``gru``/``rnn_*`` (no autocast kernel of their own) reach ``_cudnn_rnn`` when cuDNN takes the
    input (every floating dtype since pytorch#164411, cuDNN >= 9.13), and its wrapper casts there; on a CPU they never
    reach it (the RNN ran in fp32 under the emulator), so the cast is made here, at the overload nn.LSTM calls.
    """
    op = autocast_ops._overload(name)
    at_params = [a.name for a in op._schema.arguments].index("params")

    def kernel(*args, **kwargs):
        if not (_local.depth and torch.is_autocast_enabled("cuda") and torch.backends.cudnn.enabled):
            with _below():
                out = op(*args, **kwargs)
            _trace(name, "off" if not torch.is_autocast_enabled("cuda") else "unchanged", args, kwargs, out, None)
            return out
        called = (args, kwargs)
        low = torch.get_autocast_dtype("cuda")
        to = _rnn_dtype(low)
        args = list(args)
        params = args[at_params]
        # the wrapper re-flattens the weights to fp16 when the first is eligible and not fp16 already (all share one
        # dtype, it checks); not through the weight-cast cache: copy_weights_to_flat_buf_views casts on every call
        if params and _eligible(params[0]) and params[0].dtype != to:
            with _below():
                args[at_params] = [p.to(to) if _eligible(p) else p for p in params]
        # input, hx and cx through cached_cast(at::kHalf, ...)
        args = [v if i == at_params else _cast(v, to, low) for i, v in enumerate(args)]
        kwargs = {k: _cast(v, to, low) for k, v in kwargs.items()}
        out = _run_below(name, op, args, kwargs, to)
        _trace(name, "lower", *called, out, low)
        return out

    return kernel


def _trace(name: str, category: str, args, kwargs, out, low: torch.dtype | None) -> None:
    """Record the call in every tracing emulation of this thread."""
    if _local.traces:
        call = Call(name, category, tuple(_describe(a) for a in args), {k: _describe(v) for k, v in kwargs.items()},
                    _first_dtype(out), None if low is None else autocast_ops._name(low))
        for calls in _local.traces:
            calls.append(call)


def _register() -> torch.library.Library:
    """Register CUDA's policy at the AutocastCPU key: a kernel per CUDA overload, a fallthrough for CPU-only ones."""
    # aten's overloads only: an extension's ops (a library imported later may register autocast kernels of its own)
    # would need a Library of their namespace; they run as called
    cuda = [n for n in autocast_ops.registered_ops("cuda") if n.startswith("aten::")]
    cpu_only = {n for n in autocast_ops.registered_ops("cpu") if n.startswith("aten::")}
    cpu_only = sorted(cpu_only - set(cuda) - set(_RNN_OPS))  # the RNN overloads get CUDA's cuDNN wrapper below
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - overriding aten's autocast kernels is the point
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended, and undone on exit
        for name in cuda:
            lib.impl(name.removeprefix("aten::"), _make_kernel(name), "AutocastCPU")
        for name in _RNN_OPS:
            lib.impl(name.removeprefix("aten::"), _make_rnn_kernel(name), "AutocastCPU")
        for name in cpu_only:
            lib.impl(name.removeprefix("aten::"), torch.library.fallthrough_kernel, "AutocastCPU")
    return lib


# --- torch.autocast("cuda") and custom_fwd/custom_bwd without a GPU -----------------------------------------


def _patch() -> tuple:
    """Let torch.autocast("cuda", ...) and custom_fwd(cast_inputs=...) act while emulating; return the originals."""
    mode = torch.amp.autocast_mode
    init, cast = mode.autocast.__init__, mode._cast

    def autocast_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if is_active() and (device_type == "cpu" or (device_type == "cuda" and not torch.cuda.is_available())):
            # CPU tensors stand for CUDA ones: torch.autocast("cpu") (x.device.type) opens CUDA's region
            if device_type == "cpu" and dtype is None:
                dtype = torch.get_autocast_dtype("cpu")  # what the caller's "cpu" region would have used
            init(self, "cuda", dtype=dtype, enabled=False, cache_enabled=cache_enabled)  # skips the GPU check
            self._enabled = enabled
            return
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def cast_inputs(value, device_type, dtype):
        if device_type == "cuda" and is_active():  # CPU and meta tensors stand for CUDA ones
            return cast(cast(value, "cpu", dtype), "meta", dtype)
        return cast(value, device_type, dtype)

    clear = torch.clear_autocast_cache

    def clear_autocast_cache():
        # The emulated weight-cast cache is torch's as far as callers can tell: code that clears torch's after
        # changing weights in place (ampcourse.train.train_step after the optimizer step) clears this one too, or
        # inside one outer emulation every later step would run on the first step's low-precision weights.
        clear()
        _local.cache.clear()

    mode.autocast.__init__, mode._cast, torch.clear_autocast_cache = autocast_init, cast_inputs, clear_autocast_cache
    ckpt = _patch_checkpoint()
    return init, cast, clear, ckpt


def _patch_checkpoint():
    """Let torch.utils.checkpoint recompute under the state its forward ran in; return the original (or None).

    Activation checkpointing reads the autocast state by the inputs' device when the forward runs and re-enters it
    for the recompute in backward. Inside an emulation CPU's state reads "on, bf16" in every region (the kernels sit
    at the CPU key), so a block checkpointed in a disabled region (the fp32 reference) or an fp16 one was recomputed
    under bf16: "Recomputed values ... have different metadata than during the forward pass". It reads CUDA's
    emulated state instead (:func:`autocast_state`), as it would on a GPU.
    """
    import torch.utils.checkpoint as checkpoint

    original = getattr(checkpoint, "_get_autocast_kwargs", None)
    if original is None:  # a torch that reads the state elsewhere: nothing to patch
        return None

    def get_autocast_kwargs(device_type="cuda"):
        device_kwargs, cpu_kwargs = original(device_type)
        if not is_active():
            return device_kwargs, cpu_kwargs
        enabled, dtype = autocast_state("cpu")
        cpu_kwargs = {**cpu_kwargs, "enabled": enabled, "dtype": dtype}
        if device_kwargs is not None and device_type in ("cpu", "meta"):
            device_kwargs = {**device_kwargs, "enabled": enabled, "dtype": dtype}
        return device_kwargs, cpu_kwargs

    checkpoint._get_autocast_kwargs = get_autocast_kwargs
    return original


def _unpatch(saved: tuple) -> None:
    """Put torch.autocast's __init__, custom_fwd's _cast, torch.clear_autocast_cache and checkpoint's reader back."""
    mode = torch.amp.autocast_mode
    init, cast, clear, ckpt = saved
    mode.autocast.__init__, mode._cast, torch.clear_autocast_cache = init, cast, clear
    if ckpt is not None:
        import torch.utils.checkpoint as checkpoint
        checkpoint._get_autocast_kwargs = ckpt


def _acquire() -> None:
    """First emulation in the process: register the kernels and patches."""
    with _lock:
        if _global["refs"] == 0:
            _global["lib"] = _register()
            _global["patched"] = _patch()
        _global["refs"] += 1


def _release() -> None:
    """Last emulation in the process ends: remove the kernels (CPU autocast's own come back) and patches."""
    with _lock:
        _global["refs"] -= 1
        if _global["refs"] == 0:
            _global["lib"]._destroy()
            _unpatch(_global["patched"])
            _global["lib"] = _global["patched"] = None


# --- the context manager ----------------------------------------------------------------------------------------


class autocast(contextlib.ContextDecorator):  # noqa: N801 - named like torch.autocast, which it stands in for
    """CUDA's autocast for CPU and meta tensors (see the module docstring).

    Args:
        device_type: 'cuda' (the only policy emulated).
        dtype: torch.float16 (CUDA's default) or torch.bfloat16.
        enabled: False opens a region without casts (inside an emulation, as ``torch.autocast(enabled=False)``).
        cache_enabled: cast each fp32 weight once per region (torch's weight-cast cache).
        trace: record every autocast op handled in ``.calls``.

    Example:
        >>> with autocast("cuda", dtype=torch.float16) as emu:
        ...     out = model(x)
        >>> out.dtype
        torch.float16
    """

    def __init__(self, device_type: str = "cuda", dtype: torch.dtype = torch.float16, enabled: bool = True,
                 cache_enabled: bool = True, trace: bool = False):
        if device_type != "cuda":
            raise ValueError(f"emulate.autocast emulates CUDA's policy; device_type must be 'cuda', got "
                             f"{_args.shown(device_type)} (for CPU's own, use torch.autocast('cpu'))")
        autocast_ops._check_dtype(dtype)
        if not isinstance(enabled, bool) or not isinstance(cache_enabled, bool) or not isinstance(trace, bool):
            raise ValueError(f"enabled, cache_enabled and trace must be bools, got {_args.shown(enabled)}, "
                             f"{_args.shown(cache_enabled)}, {_args.shown(trace)}")
        self.device_type, self.dtype, self.enabled = device_type, dtype, enabled
        self.cache_enabled, self.trace = cache_enabled, trace
        self.calls: list[Call] = []
        self._saved: list[tuple] = []

    @property
    def fallbacks(self) -> set[str]:
        """Ops run in fp32 (then cast to the autocast dtype) because this CPU has no fp16/bf16 kernel for them."""
        return set(_local.fallbacks)

    def __enter__(self) -> autocast:
        policy(self.dtype)  # probe (or read the cache) before anything is registered
        _acquire()
        saved = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"),
                 torch.is_autocast_cache_enabled(), torch._C._dispatch_tls_is_dispatch_key_included(_KEY))
        self._saved.append(saved)
        torch.set_autocast_enabled("cuda", self.enabled)
        torch.set_autocast_dtype("cuda", self.dtype)
        torch.set_autocast_enabled("cpu", True)  # the AutocastCPU key on, where the kernels sit
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, True)  # ... for meta tensors too
        torch.set_autocast_cache_enabled(self.cache_enabled)
        torch.autocast_increment_nesting()
        _local.depth += 1
        if self.trace:
            _local.traces.append(self.calls)
        return self

    def __exit__(self, *exc) -> None:
        cuda_on, cuda_dtype, cpu_on, cache_on, included = self._saved.pop()
        if self.trace:
            _local.traces[:] = [t for t in _local.traces if t is not self.calls]
        _local.depth -= 1
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        if _local.depth == 0:
            _local.cache.clear()
        torch.set_autocast_enabled("cuda", cuda_on)
        torch.set_autocast_dtype("cuda", cuda_dtype)
        torch.set_autocast_enabled("cpu", cpu_on)
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, included)
        torch.set_autocast_cache_enabled(cache_on)
        _release()
        error = exc[1]
        if isinstance(error, RuntimeError) and str(error).startswith(_NAMED_NYI):
            # torch 2.11 cannot hand a named tensor to a Python kernel (the boxed call goes through TorchScript's
            # conversion); its message blames TorchScript, which the caller never used
            raise RuntimeError("emulate.autocast: this torch cannot pass named tensors to the emulator's kernels "
                               "(emulate.LIMITS); drop the names before the region: tensor.rename(None)") from error


def session(policy: str | None, device_type: str) -> tuple[contextlib.AbstractContextManager, str]:
    """The context a tool's whole run goes inside for ``policy=``, and the policy's name for its report.

    The one reading of the ``policy=`` argument of ``trial``, ``examine`` and their ``--policy`` flags.

    Args:
        policy: None (or the device's own type): the device's own autocast lists; ``"cuda"`` on a CPU device: CUDA's,
            through one outer ``autocast("cuda", enabled=False)``, inside which the tool's own
            ``torch.autocast("cpu", ...)`` regions apply CUDA's lists (and the kernels stay registered across steps).
        device_type: the type of the device the tool runs on ("cpu", "cuda", ...).

    Example:
        >>> context, name = session("cuda", "cpu")
        >>> name
        'cuda (emulated on cpu)'
    """
    if policy is None or policy == device_type:
        return contextlib.nullcontext(), device_type
    if policy != "cuda" or device_type != "cpu":
        raise ValueError(f"policy must be None (the device's own) or 'cuda' (emulated on a CPU device), got "
                         f"{_args.shown(policy)} on {device_type}")
    return autocast("cuda", enabled=False), "cuda (emulated on cpu)"
