"""Per-module precision policies: run chosen submodules in fp32 (or another dtype) inside autocast (chapter 5).

    >>> from ampcourse.policy import apply_policy, precision_report
    >>> apply_policy(model, {nn.LayerNorm: "fp32", "blocks.1.mlp": "bf16"})   # rules: class or name glob
    >>> with amp.autocast():
    ...     out = model(x)                       # LayerNorms run with autocast off, on fp32 inputs
    >>> precision_report(model, x, amp=amp)      # {module name: dtype of its output}

Autocast decides per *op* (matmuls low, reductions fp32); a policy decides per *module*, on top of it.
The module keeps its parameters, names and state_dict: only its ``forward`` is wrapped (an instance
attribute, undone by :func:`remove_policy`), so checkpoints are unaffected.
"""

from __future__ import annotations

import contextlib
import fnmatch
import types
from collections.abc import Mapping

import torch
import torch.nn as nn

from . import _args
from .device import AmpSetup, PRECISIONS, parse_precision
from .models import data_errors

__all__ = ["apply_policy", "remove_policy", "policy_of", "precision_report", "cast_floats"]


def cast_floats(obj, dtype: torch.dtype):
    """Cast every floating-point tensor in a (nested) tuple, list or dict to dtype; leave the rest alone."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                         f"got {_args.shown(dtype)}")
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _device_type(module: nn.Module, args: tuple) -> str:
    """The device type autocast needs: from the first tensor argument, else the first parameter, else cpu."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    p = next(module.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _policy_forward(self: nn.Module, *args, **kwargs):
    """The module's own forward, run in the precision its policy names."""
    device_type = _device_type(self, args)
    if self._ampcourse_precision == "fp32":
        # Autocast off, and inputs that earlier layers produced in fp16/bf16 brought back to fp32.
        with torch.autocast(device_type, enabled=False):
            return self._ampcourse_forward(*cast_floats(args, torch.float32), **cast_floats(kwargs, torch.float32))
    with torch.autocast(device_type, dtype=PRECISIONS[self._ampcourse_precision]):
        return self._ampcourse_forward(*args, **kwargs)


def _check_model(model) -> None:
    """ValueError unless model is a torch.nn.Module (a policy wraps its submodules' forward)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {_args.shown(model)}")


def _matches(name: str, module: nn.Module, rule) -> bool:
    """A rule is a module class (isinstance) or a glob over the qualified name ('blocks.*.ln1')."""
    if isinstance(rule, type):
        return isinstance(module, rule)
    return fnmatch.fnmatchcase(name, rule)


def apply_policy(model: nn.Module, rules: Mapping[type | str, str | torch.dtype]) -> dict[str, str]:
    """Wrap the forward of each submodule a rule matches (later rules win); return {name: precision}."""
    _check_model(model)
    if not isinstance(rules, Mapping):
        raise ValueError(f"rules must be a mapping {{module class or name pattern: precision}}, such as "
                         f"{{nn.LayerNorm: 'fp32'}}, got {_args.shown(rules)}")
    parsed = []
    for rule, precision in rules.items():
        if not isinstance(rule, (type, str)):
            raise ValueError(f"a policy rule is a module class or a name pattern, got {rule!r}")
        prec = parse_precision(precision)
        parsed.append((rule, prec))
    remove_policy(model)
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        for rule, prec in parsed:
            if _matches(name, module, rule):
                chosen[name] = prec
    unmatched = [r for r, _ in parsed if not any(_matches(n, m, r) for n, m in model.named_modules())]
    if unmatched:
        raise ValueError(f"policy rules {unmatched!r} match no module; names look like "
                         f"{[n for n, _ in model.named_modules() if n][:6]}")
    modules = dict(model.named_modules())
    for name, prec in chosen.items():
        m = modules[name]
        m._ampcourse_precision = prec
        m._ampcourse_forward = m.forward
        # Bound to the module, so copy.deepcopy(model) binds the copy's forward to the copy.
        m.forward = types.MethodType(_policy_forward, m)
    return chosen


def remove_policy(model: nn.Module) -> None:
    """Undo apply_policy: every module runs its own forward again."""
    _check_model(model)
    for m in model.modules():
        if "_ampcourse_forward" in m.__dict__:
            del m.forward, m._ampcourse_forward, m._ampcourse_precision


def policy_of(model: nn.Module) -> dict[str, str]:
    """The precision each wrapped submodule runs in: {name: 'fp32' | 'fp16' | 'bf16'}."""
    _check_model(model)
    return {n: m._ampcourse_precision for n, m in model.named_modules() if "_ampcourse_forward" in m.__dict__}


def precision_report(model: nn.Module, *inputs, amp: AmpSetup | None = None) -> dict[str, torch.dtype]:
    """Run the model once (under amp.autocast() if given) and return the output dtype of every leaf module."""
    _check_model(model)
    if amp is not None and not isinstance(amp, AmpSetup):
        raise ValueError(f"amp must be an AmpSetup (ampcourse.device.pick(device, precision)) or None, got {_args.shown(amp)}")
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                seen[name] = out.dtype
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules()
               if n and not any(True for _ in m.children())]
    ctx = amp.autocast() if amp is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), ctx, data_errors(model, inputs[0] if inputs else None):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen
