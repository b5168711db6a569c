"""Count one training step without computing it: every aten op on meta tensors, its bytes, FLOPs and memory.

    >>> from ampcourse.plan.capture import capture_step
    >>> step = capture_step(model, (x,), loss_fn=F.cross_entropy, targets=y, precision="bf16")
    >>> step.ops[0].op, step.ops[0].flops, step.peak_bytes

The model's parameters are replaced by meta tensors of the same shapes (the learner's model is never moved or
changed), so nothing is allocated and no arithmetic runs: a GPT-2 step is counted in seconds. Three layers of
interception, outermost first:

1. attention kernels (a ``TorchFunctionMode``): ``scaled_dot_product_attention`` becomes the kernel a GPU
   runs, flash attention for bf16/fp16 inputs without a mask, memory-efficient attention otherwise, so the
   counted bytes and saved tensors are a GPU's (no T x T matrix), whatever this CPU would have chosen;
2. the autocast policy of the target (:func:`autocast_policy`: CUDA's, casting each op's inputs as
   ``torch.autocast("cuda", dtype)`` would), above autograd so that the casts are part of the graph and backward
   runs in the dtypes CUDA's would: ``ampcourse.emulate.autocast(device_type="cuda")`` (at the dispatcher's
   autocast key, the policy probed from this torch build's CUDA kernels) when the course has it, else this
   module's fallback, a ``TorchFunctionMode`` over CUDA's documented op lists (it agrees with the emulation op for
   op on a GPT-2 block; it cannot see the inner ops of Python-level composites);
3. a ``TorchDispatchMode`` below autograd that sees every aten op of forward, backward and the optimizer step
   and records its dtype, FLOPs (``torch.utils.flop_counter``'s formulas), bytes read and written, and the
   storages it allocates; a weak reference on each new storage tells when it is freed, so the live bytes and
   their peak follow the step as a GPU's allocator would see them.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .. import _args

__all__ = ["OpRecord", "StepCounts", "NeedsRealValues", "capture_step", "autocast_policy", "policy_name",
           "CUDA_LOWER", "CUDA_FP32", "CUDA_PROMOTE"]

_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


class NeedsRealValues(RuntimeError):
    """The model's forward reads a tensor's value (``.item()``, ``if x.any():``): it cannot be planned on meta."""


@dataclass
class OpRecord:
    """One aten op of the step.

    Args:
        phase: ``forward``, ``backward`` or ``optimizer``.
        op: the aten op (``aten.mm``).
        dtype: the dtype it computes in (its first floating-point input, else its output).
        flops: floating-point operations (torch.utils.flop_counter's formula; 0 for ops without one).
        bytes_read: bytes of its tensor inputs (broadcast dimensions counted once).
        bytes_written: bytes of its outputs (in-place ops: the tensor they write).
        kernels: kernel launches (1; foreach ops over many tensors: one per tensor list).
        module: the innermost module running it (forward only; "" elsewhere).
        shape: the shape of its first output.
        saved_bytes: bytes of its outputs that autograd keeps for backward (each storage once).
    """

    phase: str
    op: str
    dtype: str
    flops: int
    bytes_read: int
    bytes_written: int
    kernels: int = 1
    module: str = ""
    shape: tuple = ()
    saved_bytes: int = 0

    @property
    def matmul(self) -> bool:
        """True for ops with a FLOP formula (matmuls, convolutions, attention): the tensor-core ops."""
        return self.flops > 0


@dataclass
class StepCounts:
    """What one training step of one recipe does: its ops and its memory, in bytes.

    ``peak_bytes`` is the most bytes live at once (weights + optimizer state + gradients + activations +
    temporaries), the quantity ``torch.cuda.max_memory_allocated`` reports on a GPU (without the allocator's
    rounding to 512-byte blocks); ``step_peak_bytes`` the part of it allocated during the step (the peak above
    weights, buffers, optimizer state and inputs, which exist before it). ``saved_bytes`` counts what autograd holds for backward at the end of the
    forward, each storage once, parameters excluded; ``weight_copy_bytes`` the part of it that is autocast's
    low-precision copies of the weights.
    """

    precision: str
    ops: list[OpRecord]
    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    inputs_bytes: int
    saved_bytes: int
    weight_copy_bytes: int
    peak_bytes: int
    step_peak_bytes: int
    peak_phase: str
    policy: str
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# The autocast policy of the target: CUDA's. ``autocast_policy`` is the one place that decides it.

#: CUDA autocast's lower-precision ops (torch docs, "Automatic Mixed Precision package: CUDA Ops that can
#: autocast to float16", and aten/src/ATen/autocast_mode.cpp's lower_precision_fp list for CUDA).
CUDA_LOWER = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
    "linalg_multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "convolution", "_convolution", "prelu", "linear", "matmul", "mm", "mv", "einsum", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
#: CUDA autocast's float32 ops (same sources: "CUDA Ops that can autocast to float32"; rms_norm measured).
CUDA_FP32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss", "rms_norm", "instance_norm",
})
#: The fp32 ops CUDA runs by passing ``dtype=torch.float32`` (autocast_mode.cpp's fp32_set_opt_dtype) instead of
#: casting the input first.
_SET_OPT_DTYPE = frozenset({"sum", "prod", "cumsum", "cumprod", "softmax", "log_softmax"})
#: CUDA autocast's promote ops: mixed inputs run in the widest floating-point type.
CUDA_PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                          "scatter_add", "tensordot", "cat", "stack"})


def _floating(t: object) -> bool:
    """A floating-point tensor autocast may cast (float64 is left alone, as autocast does)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CudaAutocastEmulation(TorchFunctionMode):
    """CUDA's autocast policy applied above autograd to tensors on any device (meta here).

    ``torch.autocast("cuda")`` does nothing without a GPU, and its kernels only see CUDA tensors; this mode
    casts each listed op's floating-point inputs as CUDA autocast would, with its weight-cast cache (a
    parameter is cast once per autocast region, and that copy is what backward keeps).
    """

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _to(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """t cast to dtype; a leaf parameter's cast is cached for this region, as autocast caches it."""
        if t.dtype == dtype:
            return t
        if t.is_leaf and t.requires_grad:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            cast = t.to(dtype)
            self._cache[id(t)] = (t, cast)
            return cast
        return t.to(dtype)

    def _cross_entropy(self, func, args, kwargs):
        """CUDA registers no autocast kernel for cross_entropy: it decomposes into log_softmax in the input's
        dtype (its explicit dtype= is kept) and nll_loss, which autocast runs in fp32."""
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        bound = dict(zip(names, args)) | kwargs
        x = bound["input"]
        if bound.get("label_smoothing", 0.0) or not _floating(x) or x.dim() < 1:
            args, kwargs = tree_map(lambda t: self._to(t, torch.float32) if _floating(t) else t, (args, kwargs))
            return func(*args, **kwargs)
        logp = torch.log_softmax(x, 1 if x.dim() > 1 else 0, dtype=x.dtype)
        weight = bound.get("weight")
        return F.nll_loss(logp.float(), bound["target"], None if weight is None else weight.float(),
                          ignore_index=bound.get("ignore_index", -100), reduction=bound.get("reduction", "mean"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in CUDA_LOWER:
            args, kwargs = tree_map(lambda t: self._to(t, self.dtype) if _floating(t) else t, (args, kwargs))
            return func(*args, **kwargs)
        if name == "cross_entropy":
            return self._cross_entropy(func, args, kwargs)
        if name in _SET_OPT_DTYPE and "dtype" not in kwargs and any(
                _floating(t) and t.dtype != torch.float32 for t in args[:1]):
            return func(*args, **kwargs, dtype=torch.float32)  # CUDA passes dtype=float32: reads low, sums in fp32
        if name in CUDA_FP32:
            args, kwargs = tree_map(lambda t: self._to(t, torch.float32) if _floating(t) else t, (args, kwargs))
            return func(*args, **kwargs)
        if name in CUDA_PROMOTE:
            leaves = [t for t in tree_flatten((args, kwargs))[0] if _floating(t)]
            if leaves:
                wide = max((t.dtype for t in leaves), key=lambda d: torch.finfo(d).bits)
                args, kwargs = tree_map(lambda t: self._to(t, wide) if _floating(t) else t, (args, kwargs))
            return func(*args, **kwargs)
        # Not on a list: autocast leaves it alone. (Limitation of a function mode: the inner ops of a Python-level
        # function such as F.multi_head_attention_forward are not seen, so its matmuls stay in their input dtype.)
        return func(*args, **kwargs)


def _emulate_module():
    """ampcourse.emulate when it exists (the course's own CUDA-autocast emulation), else None."""
    try:
        from .. import emulate  # noqa: PLC0415 (optional: a sibling module that may not exist in this checkout)
    except ImportError:
        return None
    return emulate if hasattr(emulate, "autocast") else None


def policy_name() -> str:
    """Which autocast policy :func:`autocast_policy` applies."""
    if _emulate_module() is not None:
        return "ampcourse.emulate.autocast(device_type='cuda')"
    return "CUDA autocast op lists (torch docs, autocast_mode.cpp) applied by ampcourse.plan.capture"


def autocast_policy(precision: str) -> contextlib.AbstractContextManager:
    """The autocast of the target GPU for a recipe: CUDA's policy, on meta tensors. fp32/tf32: no autocast.

    The one place that decides the policy: ``ampcourse.emulate.autocast(device_type="cuda", dtype=...)`` when
    the course has it, else this module's emulation of CUDA's op lists (:data:`CUDA_LOWER`, :data:`CUDA_FP32`,
    :data:`CUDA_PROMOTE`).

    Args:
        precision: ``fp32``, ``tf32``, ``bf16`` or ``fp16``.

    Example:
        >>> with autocast_policy("bf16"):
        ...     y = torch.nn.functional.linear(torch.empty(4, 8, device="meta"), torch.empty(3, 8, device="meta"))
        >>> y.dtype
        torch.bfloat16
    """
    if precision not in _LOW:
        return contextlib.nullcontext()
    emulate = _emulate_module()
    if emulate is not None:
        return emulate.autocast(device_type="cuda", dtype=_LOW[precision])
    return _CudaAutocastEmulation(_LOW[precision])


def _step_region(precision: str) -> contextlib.AbstractContextManager:
    """An outer emulation with autocast off around a whole micro-step, so that what backward runs of the forward
    (activation checkpointing's recompute, custom_bwd) sees the region the forward ran in, as on a GPU."""
    emulate = _emulate_module() if precision in _LOW else None
    if emulate is None:
        return contextlib.nullcontext()
    return emulate.autocast(device_type="cuda", dtype=_LOW[precision], enabled=False)


# ---------------------------------------------------------------------------------------------------------------
# Attention as a GPU runs it.

class _GpuAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as the fused kernel a GPU picks: flash for bf16/fp16 without a mask and a
    head size up to 256, memory-efficient attention otherwise (fp32, masks). Grouped-query attention and other
    cases are left to torch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args)) | kwargs
        q, k, v = bound["query"], bound["key"], bound["value"]
        if torch.is_autocast_enabled("cuda"):  # an emulation at the dispatcher casts later: cast here, as CUDA would
            low = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(low) if _floating(t) else t for t in (q, k, v))
        mask, p, causal = bound.get("attn_mask"), bound.get("dropout_p", 0.0), bound.get("is_causal", False)
        scale = bound.get("scale")
        if bound.get("enable_gqa") or q.dim() != 4 or q.shape[1] != k.shape[1] or q.dtype != k.dtype != v.dtype:
            return func(*args, **kwargs)
        if mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
        if mask is not None:
            mask = mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, p, causal,
                                                                      scale=scale)[0]


# ---------------------------------------------------------------------------------------------------------------
# Counting below autograd.

#: aten ops that launch no kernel (allocation without initialisation, metadata, aliasing).
_NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
              "aten.detach", "aten.alias", "aten.lift_fresh", "aten._local_scalar_dense", "aten.set_",
              "aten.resize_", "aten._unsafe_view", "aten._reshape_alias"}


def _touched_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads from t: broadcast (stride-0) dimensions once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _storage(t: torch.Tensor):
    """t's untyped storage, or None for tensors without one (sparse, nested ...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _bound_args(func, args, kwargs) -> dict:
    """An aten op's arguments by their schema names (``is_causal``, ``query``, ``weight`` ...)."""
    names = [a.name for a in func._schema.arguments]
    return dict(zip(names, args)) | dict(kwargs)


def _causal_fraction(query: torch.Tensor, key: torch.Tensor) -> float:
    """The share of the query x key score matrix a causal kernel computes: the unmasked part, top-left aligned
    (row i keeps keys 0..i), as torch's ``is_causal=True`` defines it.

    What this relies on: with ``is_causal=True`` the fused kernels stop each query block's loop over key blocks at
    the diagonal instead of computing and masking the rest. Flash attention caps ``n_block_max`` at the diagonal
    (flash_fwd_kernel.h and flash_bwd_kernel.h, ``if (Is_causal)``); torch's memory-efficient kernel caps
    ``num_keys`` at "query_start + causal_diagonal_offset + kQueriesPerBlock ... to avoid extra computations"
    (aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h; kernel_backward.h starts each key
    block's queries at ``getQueryStart``, the diagonal).
    The blocks on the diagonal are computed whole, so a kernel does a little more than this fraction (about one
    block's width over twice the sequence: 64 / 2048 = 3% at T = 1024); the FLOP formula of the dense case times
    this fraction is what we count.
    """
    tq, tk = query.shape[-2], key.shape[-2]
    if tq == 0 or tk == 0:
        return 1.0
    m = min(tq, tk)
    kept = m * (m + 1) // 2 + (tq - m) * tk
    return kept / (tq * tk)


#: Ops that read only the rows their indices pick (an embedding lookup, index_select, gather): a GPU kernel reads
#: the indices and those rows, not the whole table.
_GATHERS = {"aten.embedding", "aten.index_select", "aten.gather"}


def _gathered_bytes(name: str, bound: dict, out: torch.Tensor) -> int:
    """Bytes a gather reads: its indices plus the elements it gathers (the output's size, in the source's dtype)."""
    index = bound.get("indices") if name == "aten.embedding" else bound.get("index")
    index_bytes = index.numel() * index.element_size() if isinstance(index, torch.Tensor) else 0
    return index_bytes + out.numel() * out.element_size()


class _Counter(TorchDispatchMode):
    """Records every aten op on meta tensors and follows the live bytes of the storages they allocate."""

    def __init__(self, module_stack: list[str]):
        super().__init__()
        self.phase = "forward"
        self.ops: list[OpRecord] = []
        self.module_stack = module_stack
        self.live = 0  # bytes allocated during the step and not yet freed
        self.peak = 0
        self.peak_phase = "forward"
        self._known: set[int] = set()
        self._finalizers: list[weakref.finalize] = []
        self.owner: dict[int, int] = {}  # storage -> index in ops of the op that allocated it

    def _free(self, key: int, nbytes: int) -> None:
        """A storage allocated during the step died."""
        self.live -= nbytes
        self._known.discard(key)

    def track(self, out, owner: int | None = None) -> None:
        """Count the new storages among out's tensors as allocated now (by the op at index owner of ops)."""
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "meta":
                continue
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if key in self._known:
                continue
            self._known.add(key)
            if owner is not None:
                self.owner[key] = owner
            nbytes = st.nbytes()
            self.live += nbytes
            self._finalizers.append(weakref.finalize(st, self._free, key, nbytes))
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase

    def adopt(self, tensors) -> None:
        """Mark storages that existed before the step as known (they are counted in the baseline)."""
        for t in tensors:
            st = _storage(t)
            if st is not None:
                self._known.add(st._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as err:
            text = str(err)
            if "meta" in text and ("item" in text or "data-dependent" in text or "_local_scalar_dense" in text
                                   or "Cannot copy out of meta" in text or "is_nonzero" in text):
                raise NeedsRealValues(f"the forward reads a tensor's value ({func}: {text.splitlines()[0]})") from err
            raise
        recorded = self._record(func, args, kwargs, out)
        self.track(out, len(self.ops) - 1 if recorded else None)
        return out

    def saved(self, key: int, nbytes: int) -> None:
        """Autograd keeps the storage key: charge it to the op that allocated it."""
        index = self.owner.get(key)
        if index is not None:
            self.ops[index].saved_bytes += nbytes

    def _record(self, func, args, kwargs, out) -> bool:
        """Append the op's OpRecord (ops on host tensors, views and bare allocations launch no kernel): True if so."""
        name = str(func.overloadpacket)
        if func.is_view or name in _NO_KERNEL:
            return False
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "meta" for t in ins + outs):
            return False  # host-side bookkeeping (Adam's step counter on the CPU): no GPU kernel
        mutated = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info is not None
                   and arg.alias_info.is_write and isinstance(a, torch.Tensor)]
        if name.startswith("aten._foreach") or func.overloadpacket.__name__.startswith("_amp_foreach"):
            mutated += [t for a in args[:1] if isinstance(a, (list, tuple)) for t in a
                        if isinstance(t, torch.Tensor) and name.endswith("_")]
        written = outs if outs else mutated
        floating = [t for t in ins if t.is_floating_point()] or [t for t in outs if t.is_floating_point()]
        dtype = str(floating[0].dtype).removeprefix("torch.") if floating else (
            str((ins + outs)[0].dtype).removeprefix("torch.") if ins + outs else "none")
        flops = 0
        counter = flop_registry.get(func.overloadpacket)
        if counter is not None:
            try:
                flops = int(counter(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not cover this overload: count it as a memory op
                flops = 0
        bound = _bound_args(func, args, kwargs)
        if flops and bound.get("is_causal") is True and "attention" in name:
            flops = int(flops * _causal_fraction(bound["query"], bound["key"]))
        read = sum(_touched_bytes(t) for t in ins if t.device.type == "meta")
        if name in _GATHERS and outs:
            read = _gathered_bytes(name, bound, outs[0])
        self.ops.append(OpRecord(
            phase=self.phase, op=name, dtype=dtype, flops=flops,
            bytes_read=read,
            bytes_written=sum(t.numel() * t.element_size() for t in written if t.device.type == "meta"),
            module=self.module_stack[-1] if self.module_stack and
            self.phase == "forward" else "", shape=tuple(outs[0].shape) if outs else ()))
        return True


# ---------------------------------------------------------------------------------------------------------------
# The step.

def _meta_tensor(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A contiguous meta tensor of t's shape and dtype (a batch copied to a GPU is contiguous: a slice of a larger
    tensor on the host does not bring the rest of its storage along)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out.requires_grad_(requires_grad)


def _to_meta(value):
    """Inputs (a tensor, tuple or dict of them, other values unchanged) as meta tensors."""
    return tree_map(lambda t: _meta_tensor(t, False) if isinstance(t, torch.Tensor) else t, value)


@contextlib.contextmanager
def _module_names(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """Keep stack[-1] the innermost module running, by forward pre-hooks and hooks."""
    handles = []

    def pop(module, args, output) -> None:  # a hook that returns a value would replace the module's output
        if stack:
            stack.pop()

    for name, module in model.named_modules():
        label = name or type(module).__name__
        handles.append(module.register_forward_pre_hook(lambda m, a, _l=label: stack.append(_l) and None))
        handles.append(module.register_forward_hook(pop))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _loss_of(out) -> torch.Tensor | None:
    """The loss a model returned itself: a Hugging Face output with .loss, a dict with 'loss', or a tuple whose first
    element is a scalar with a gradient (what a Hugging Face model returns with ``return_dict=False`` and labels:
    ``(loss, logits, ...)``)."""
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and _is_scalar_loss(out[0]):
        return out[0]
    return getattr(out, "loss", None)


def _is_scalar_loss(t: object) -> bool:
    """t is a one-element floating-point tensor with a gradient: a loss backward can start from."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == 1 and t.grad_fn is not None


_VIEW_NODES = {"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
               "UnsafeViewBackward0", "AsStridedBackward0", "SliceBackward0", "SelectBackward0", "UnsqueezeBackward0",
               "SqueezeBackward0", "AliasBackward0"}


def _through_views(node):
    """The first autograd node below a chain of view nodes."""
    for _ in range(8):
        if node is None or node.name() not in _VIEW_NODES or not node.next_functions:
            return node
        node = node.next_functions[0][0]
    return node


def _storages_bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _storage(t)
        if st is not None:
            seen.setdefault(st._cdata, st.nbytes())
    return sum(seen.values())


def _is_cast_of_param(t: torch.Tensor) -> bool:
    """t is autocast's cast of a parameter, or a view of one (addmm saves weight.t())."""
    node, cast = _through_views(t.grad_fn), False
    if node is not None and node.name() == "ToCopyBackward0":
        node, cast = _through_views(node.next_functions[0][0]), True
    return cast and node is not None and "AccumulateGrad" in node.name()


class _SavedTensors:
    """The storages autograd saves for backward (a saved-tensor pack hook), each once, parameters excluded."""

    def __init__(self, param_keys: set[int], counter: _Counter):
        self.param_keys = param_keys
        self.counter = counter
        self.active = True
        self.storages: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, is a weight copy)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if self.active and st is not None and st._cdata not in self.param_keys and st._cdata not in self.storages:
            self.storages[st._cdata] = (st.nbytes(), _is_cast_of_param(t))
            self.counter.saved(st._cdata, st.nbytes())
        return t


_READS_VALUES = ("item", "data-dependent", "is_nonzero", "Cannot copy out of meta", "value of")


def _forward_loss(model: nn.Module, inputs, loss_fn: Callable | None, targets) -> torch.Tensor:
    """The loss of one forward on meta tensors (inside :func:`_on_meta`); NeedsRealValues when the forward reads a
    value."""
    try:
        out = _call(model, inputs)
        loss = _loss_of(out)
        if loss is None:
            loss = loss_fn(out, targets) if loss_fn is not None else out
    except NeedsRealValues:
        raise
    except (RuntimeError, NotImplementedError) as err:
        text = str(err)
        if "meta" in text and any(w in text for w in _READS_VALUES):
            raise NeedsRealValues(f"the forward reads a tensor's value ({text.splitlines()[0]})") from err
        raise
    if not _is_scalar_loss(loss):
        raise ValueError(_no_loss_message(out, inputs, loss_fn))
    return loss


def _described(value: object) -> str:
    """A tensor as its shape and dtype (its repr on meta says nothing useful), anything else as its type."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _no_loss_message(out, inputs, loss_fn: Callable | None) -> str:
    """Why no scalar loss came out of the step, in one line that fits what was passed."""
    got = (f"a {type(out).__name__} of {len(out)} ({', '.join(_described(o) for o in out[:3])}"
           f"{', ...' if len(out) > 3 else ''})" if isinstance(out, (tuple, list)) else _described(out))
    cli = " (from the command line: a factory returning (model, inputs, loss_fn, targets))"
    if loss_fn is not None:
        return f"the step needs a scalar loss with a gradient: loss_fn returned {got}"
    if isinstance(out, (tuple, list)):
        return (f"the step needs a scalar loss with a gradient: the model returned {got}, without a scalar loss "
                f"first; pass loss_fn=, e.g. lambda out, t: F.cross_entropy(out[0], t){cli}")
    labels = isinstance(inputs, Mapping) and "labels" in inputs
    return (f"the step needs a scalar loss with a gradient: the model returned {got}; pass loss_fn={cli}"
            + ("" if labels else ", or inputs with labels for a model that returns its own loss"))


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW with fp32 state and foreach kernels, as torch picks on a CUDA device."""
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _call(model: nn.Module, inputs):
    """model(*inputs) or model(**inputs)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*(inputs if isinstance(inputs, tuple) else (inputs,)))


def _on_meta(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """The model's parameters and buffers swapped for their meta stand-ins (tied ones kept tied), as
    torch.func.functional_call does, but around forward *and* backward: activation checkpointing
    (torch.utils.checkpoint) recomputes its blocks during backward, where a functional_call over the forward alone
    had put the real weights back (its recompute met CPU weights with meta inputs)."""
    from torch.nn.utils.stateless import _reparametrize_module  # functional_call's own context manager

    return _reparametrize_module(model, tensors, tie_weights=True, strict=False)


#: What a model's training step on meta tensors may raise that is about the model (or its optimizer), not about the
#: planner: turned into one InputError naming it.
_MODEL_ERRORS = (RuntimeError, NotImplementedError, TypeError, IndexError, AssertionError)


def _model_error(err: BaseException) -> _args.InputError:
    """One line for a model whose step cannot run on meta tensors, with the usual causes."""
    text = _args.first_line(err, 300)
    hint = ""
    if "sparse gradients" in text:
        hint = ("; its gradients are sparse (Embedding(sparse=True)): pass optimizer=, e.g. "
                "lambda ps: torch.optim.SGD(ps, lr=0.1)")
    elif "device" in text and "meta" in text:
        hint = ("; the forward makes a tensor on the CPU (torch.rand/torch.tensor without device=, or a CPU "
                "torch.Generator of its own): on a GPU it would fail the same way, so take the device from an input")
    return _args.InputError(f"the model's training step cannot run on meta tensors ({type(err).__name__}: "
                            f"{text}){hint}")


def _dtype_notes(trainable: list[torch.Tensor], precision: str) -> list[str]:
    """What a recipe's prediction means for a model whose parameters are not fp32 (``model.half()``,
    ``model.bfloat16()``): the counts follow the model as it is, which is not the torch.amp recipe."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in trainable
                  if p.is_floating_point() and p.dtype != torch.float32})
    if not low:
        return []
    notes = [f"the model's trainable parameters are {' and '.join(low)}, not fp32: no fp32 master weights, and the "
             f"fp32 and tf32 recipes compute in {' and '.join(low)} (the model's own dtype), not in fp32"]
    if precision == "fp16" and "float16" in low:
        # torch.amp.GradScaler.unscale_ checks the gradients' dtype: "Attempting to unscale FP16 gradients."
        notes.append("fp16 recipe: GradScaler refuses float16 gradients (unscale_ raises 'Attempting to unscale "
                     "FP16 gradients'), so this step cannot run on a GPU as predicted; keep the parameters fp32 "
                     "(model.float()) and let autocast cast")
    return notes


def capture_step(model: nn.Module, inputs, *, precision: str = "fp32", loss_fn: Callable | None = None,
                 targets=None, optimizer: Callable | None = None, accum_steps: int = 1) -> StepCounts:
    """Count one training step (``accum_steps`` forward + backward, one optimizer step) on meta tensors.

    Args:
        model: the model (any device, meta included); it is not moved or changed.
        inputs: a tensor, a tuple of positional tensors or a dict of keyword tensors (shapes and dtypes matter,
            values do not).
        precision: ``fp32``/``tf32`` (no autocast), ``bf16`` or ``fp16`` (CUDA's autocast; fp16 with a
            GradScaler's scale and unscale).
        loss_fn: ``loss_fn(output, targets) -> loss``; None when the model returns its own loss (a Hugging Face
            model given ``labels``) or returns the loss tensor itself.
        targets: the targets for loss_fn.
        optimizer: a callable ``params -> torch.optim.Optimizer`` (default: AdamW, fp32 state, foreach).
        accum_steps: micro-batches per optimizer step.

    Example:
        >>> counts = capture_step(torch.nn.Linear(8, 4), torch.empty(2, 8), loss_fn=lambda o, t: o.sum())
        >>> [r.op for r in counts.ops if r.phase == "forward"]
        ['aten.addmm', 'aten.sum']
    """
    params = {n: _meta_tensor(p, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)}
    # tied weights (GPT-2's embedding and head) are one parameter: keep them one meta tensor
    by_id: dict[int, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        params[n] = by_id.setdefault(id(p), params[n])
    buffers = {n: _meta_tensor(b, False) for n, b in model.named_buffers(remove_duplicate=False)}
    trainable = list({id(p): p for p in params.values() if p.requires_grad}.values())
    meta_inputs, meta_targets = _to_meta(inputs), _to_meta(targets)
    opt = (optimizer or default_optimizer)(trainable)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a callable params -> torch.optim.Optimizer, it returned "
                         f"{type(opt).__name__}")
    # Steady state: the optimizer's state exists before the step (a first step would create it mid-step).
    for p in trainable:
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except _MODEL_ERRORS as err:
        raise _model_error(err) from err
    opt.zero_grad(set_to_none=True)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
             and t.device.type == "meta"]

    stack: list[str] = []
    counter = _Counter(stack)
    counter.adopt(list(params.values()) + list(buffers.values()) + state +
                  [t for t in tree_flatten((meta_inputs, meta_targets))[0] if isinstance(t, torch.Tensor)])
    weights = _storages_bytes(list(params.values()))
    baseline = weights + _storages_bytes(list(buffers.values())) + _storages_bytes(state)
    inputs_bytes = _storages_bytes([t for t in tree_flatten((meta_inputs, meta_targets))[0]
                                    if isinstance(t, torch.Tensor)])
    saved = _SavedTensors({_storage(p)._cdata for p in params.values()}, counter)
    scale = torch.empty((), device="meta") if precision == "fp16" else None
    notes: list[str] = _dtype_notes(trainable, precision)
    passes = 2 if accum_steps > 1 else 1
    with contextlib.ExitStack() as stack_ctx:
        stack_ctx.enter_context(counter)
        for micro in range(passes):
            counter.phase = "forward"
            n_before = len(counter.ops)
            saved.active = micro == 0  # what backward keeps: the first micro-step's (the others are alike)
            try:
                with _step_region(precision), _on_meta(model, {**params, **buffers}):
                    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                            _module_names(model, stack), _GpuAttention(), autocast_policy(precision):
                        loss = _forward_loss(model, meta_inputs, loss_fn, meta_targets)
                    counter.phase = "backward"
                    if accum_steps > 1:
                        loss = loss / accum_steps
                    if scale is not None:
                        loss = loss * scale  # GradScaler.scale(loss)
                    loss.backward()
                    del loss
            except NeedsRealValues:
                raise
            except _MODEL_ERRORS as err:
                raise _model_error(err) from err
            if micro == 1:  # the later micro-steps are like this one: count them (accum_steps - 1) times
                repeat = counter.ops[n_before:]
                counter.ops.extend(OpRecord(**vars(r)) for _ in range(accum_steps - 2) for r in repeat)
        counter.phase = "optimizer"
        grads = [p.grad for p in trainable if p.grad is not None]
        if scale is not None:  # GradScaler.unscale_ (with its inf/NaN check) and update
            found_inf = torch.empty((), device="meta")
            # a sparse gradient is unscaled through its values, as GradScaler does (Embedding(sparse=True))
            torch._amp_foreach_non_finite_check_and_unscale_([g._values() if g.is_sparse else g for g in grads],
                                                             found_inf, scale.reciprocal())
        gradients = _storages_bytes(grads)
        del grads
        try:
            opt.step()
        except _MODEL_ERRORS as err:
            raise _model_error(err) from err
        opt.zero_grad(set_to_none=True)
    saved_bytes = sum(n for n, _ in saved.storages.values())
    weight_copies = sum(n for n, is_copy in saved.storages.values() if is_copy)
    if accum_steps > 1:
        notes.append(f"micro-steps 3..{accum_steps} counted as copies of micro-step 2")
    return StepCounts(precision=precision, ops=counter.ops, weights_bytes=weights, gradients_bytes=gradients,
                      optimizer_state_bytes=_storages_bytes(state), inputs_bytes=inputs_bytes,
                      saved_bytes=saved_bytes, weight_copy_bytes=weight_copies,
                      peak_bytes=baseline + inputs_bytes + counter.peak, step_peak_bytes=counter.peak,
                      peak_phase=counter.peak_phase,
                      policy=policy_name() if precision in _LOW else "none (fp32)", notes=notes)
