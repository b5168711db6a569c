"""Count the memory that training holds: tensors saved for backward, weights, gradients, optimizer state (chapter 2).

    >>> from ampcourse.memory import saved_for_backward, training_state_bytes
    >>> saved = saved_for_backward(lambda: loss_fn(model(x), y), params=model.parameters())
    >>> saved.activation_bytes, saved.by_dtype()
    >>> training_state_bytes(model, optimizer)       # after one optimizer step

Saved tensors are recorded with ``torch.autograd.graph.saved_tensors_hooks`` while the forward pass
runs. Several saved tensors can be views of one storage (a reshape, a transpose), so each storage is
counted once, with its full size: that is the memory autograd keeps alive until backward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from . import _args
from .models import data_errors

__all__ = ["SavedTensor", "SavedBytes", "saved_for_backward", "forward_saved_bytes",
           "training_state_bytes", "dtype_name"]

#: What a saved storage is: a parameter (or buffer) itself (memory that exists anyway), autocast's low-precision
#: copy of a parameter (extra memory), or anything else the forward pass made (activations).
KINDS = ("activation", "weight copy", "parameter")


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16', 'int64', ...: a dtype without the 'torch.' prefix."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {_args.shown(dtype)}")
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SavedTensor:
    """One storage that autograd keeps for the backward pass."""

    shape: tuple[int, ...]  # shape of the first saved view of this storage
    dtype: str
    nbytes: int  # the whole storage, not just the view
    kind: str  # one of KINDS
    saved_by: str = "?"  # the autograd node and slot that saved it, e.g. 'NativeLayerNormBackward0.input'


def _check_kind(kind) -> None:
    """ValueError listing KINDS unless kind is one of them or None (a typo would silently count 0 bytes)."""
    if kind is not None and (not isinstance(kind, str) or kind not in KINDS):
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))} or None, got {_args.shown(kind)}")


@dataclass(frozen=True)
class SavedBytes:
    """The storages saved for backward during one forward pass, each counted once."""

    tensors: tuple[SavedTensor, ...]

    def bytes(self, kind: str | None = None) -> int:
        """Total bytes of one kind ('activation', 'weight copy', 'parameter'), or of all kinds."""
        _check_kind(kind)
        return sum(t.nbytes for t in self.tensors if kind is None or t.kind == kind)

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved activations (excluding parameters and autocast's weight copies)."""
        return self.bytes("activation")

    @property
    def weight_copy_bytes(self) -> int:
        """Bytes of low-precision parameter copies that autocast made and autograd saved."""
        return self.bytes("weight copy")

    @property
    def extra_bytes(self) -> int:
        """Memory held for backward on top of the parameters: activations + weight copies."""
        return self.activation_bytes + self.weight_copy_bytes

    def by_dtype(self, kind: str | None = "activation") -> dict[str, int]:
        """Bytes per dtype for one kind (default: activations), largest first."""
        _check_kind(kind)
        counts = Counter()
        for t in self.tensors:
            if kind is None or t.kind == kind:
                counts[t.dtype] += t.nbytes
        return dict(counts.most_common())

    def by_saver(self, dtype: str | None = None, kind: str | None = "activation") -> dict[str, int]:
        """Bytes per saving autograd node ('NativeLayerNormBackward0', ...), optionally for one dtype."""
        _check_kind(kind)
        if dtype is not None and not isinstance(dtype, str):
            raise ValueError(f"dtype must be a dtype name such as 'float32' or None, got {_args.shown(dtype)}")
        counts = Counter()
        for t in self.tensors:
            if (kind is None or t.kind == kind) and (dtype is None or t.dtype == dtype):
                counts[t.saved_by.split(".")[0]] += t.nbytes
        return dict(counts.most_common())


def _storage_key(t: torch.Tensor) -> tuple:
    """Identify a tensor's storage (device + address), so views of it are counted once."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat view of every element in t's storage, in memory order."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def _is_weight_copy(t: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """True when t's storage holds exactly a parameter cast to t's (different) dtype."""
    if not t.is_floating_point():
        return False
    flat = _whole_storage(t)
    for p in params:
        if p.dtype != t.dtype and p.numel() == flat.numel() and p.device == t.device:
            if torch.equal(flat, p.detach().contiguous().reshape(-1).to(t.dtype)):
                return True
    return False


def _saved_by(out: object) -> dict[tuple, str]:
    """Walk the autograd graph behind out and name the node slot that saved each storage."""
    roots = [t.grad_fn for t in (out if isinstance(out, (tuple, list)) else [out])
             if torch.is_tensor(t) and t.grad_fn is not None]
    names: dict[tuple, str] = {}
    seen, stack = set(), roots
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                for t in value if isinstance(value, (tuple, list)) else [value]:
                    if torch.is_tensor(t):
                        names.setdefault(_storage_key(t), f"{node.name()}.{attr.removeprefix('_saved_')}")
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def saved_for_backward(forward: Callable[[], object], params: Iterable[torch.Tensor] = ()) -> SavedBytes:
    """Run forward() and return the storages autograd saved for backward, classified and counted once."""
    if not callable(forward):
        raise ValueError(f"forward must be a callable taking no arguments (it runs the forward pass), got {_args.shown(forward)}")
    if isinstance(params, torch.Tensor):
        params = [params]
    try:
        params = list(params)
    except TypeError:
        raise ValueError(f"params must be an iterable of tensors (model.parameters()), got {_args.shown(params)}") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise ValueError(f"params must be an iterable of tensors (model.parameters()), got {_args.shown(params)}")
    param_keys = {_storage_key(p) for p in params}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)  # keep a reference: a freed storage's address could be reused and miscounted
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    labels = _saved_by(out)
    seen: dict[tuple, SavedTensor] = {}
    for t in saved:
        key = _storage_key(t)
        if key in seen:
            continue
        kind = ("parameter" if key in param_keys else
                "weight copy" if _is_weight_copy(t, params) else "activation")
        seen[key] = SavedTensor(tuple(t.shape), dtype_name(t.dtype), t.untyped_storage().nbytes(), kind,
                                labels.get(key, "?"))
    del out, saved
    return SavedBytes(tuple(seen.values()))


def forward_saved_bytes(model: torch.nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                        autocast=None) -> SavedBytes:
    """Saved-for-backward storages of loss_fn(model(x), y), inside an autocast context if given."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (logits, targets) -> loss, got {_args.shown(loss_fn)}")
    if autocast is not None and not (hasattr(autocast, "__enter__") and hasattr(autocast, "__exit__")):
        raise ValueError(f"autocast must be a context manager (amp.autocast()) or None, got {_args.shown(autocast)}")

    def forward() -> torch.Tensor:
        with autocast if autocast is not None else contextlib.nullcontext():  # noqa: SIM117
            with data_errors(model, x, y):
                return loss_fn(model(x), y)

    return saved_for_backward(forward, params=list(model.parameters()) + list(model.buffers()))


def training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of weights, gradients and each optimizer state entry (e.g. Adam's exp_avg, exp_avg_sq, step)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {_args.shown(optimizer)}")
    params = list(model.parameters())
    out = {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
    }
    if optimizer is not None:
        per_key = Counter()
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    per_key[key] += value.numel() * value.element_size()
        out.update(per_key)
    return out
