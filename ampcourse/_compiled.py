"""torch.compile's wrapper (``OptimizedModule``) seen through: the eager module and its names.

``torch.compile(model)`` returns a wrapper whose only child is the model, as ``_orig_mod``; its parameters are the
model's. Tools that hook modules or name layers (the doctor, ``trial``'s monitors and per-layer series) read the
eager module, and name layers as the learner wrote them ("0", "blocks.1.attn"), not "_orig_mod.0".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

_WRAPPED = "_orig_mod"


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` is torch.compile's wrapper, told by name: importing torch._dynamo costs seconds.

    Args:
        module: any nn.Module.

    Example::

        >>> is_compiled(nn.Linear(2, 2))
        False
    """
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, _WRAPPED, None), nn.Module)


def eager(module: nn.Module) -> nn.Module:
    """The eager module inside torch.compile's wrapper (the same parameters); any other module as it is.

    Example::

        >>> lin = nn.Linear(2, 2)
        >>> eager(lin) is lin
        True
    """
    while is_compiled(module):
        module = getattr(module, _WRAPPED)
    return module


def eager_name(name: str) -> str:
    """A module name from ``named_modules()`` without the wrappers' ``_orig_mod`` segments ("" for the root).

    Example::

        >>> eager_name("_orig_mod.blocks.0._orig_mod.attn"), eager_name("_orig_mod")
        ('blocks.0.attn', '')
    """
    return ".".join(part for part in name.split(".") if part and part != _WRAPPED)


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` as the learner wrote the model: wrappers skipped (their eager module follows under
    the same name), names without ``_orig_mod``.

    Args:
        model: an nn.Module, compiled or not, or with compiled submodules.

    Example::

        >>> [name for name, _ in named_modules(nn.Sequential(nn.Linear(2, 2)))]
        ['', '0']
    """
    for name, module in model.named_modules():
        if not is_compiled(module):
            yield eager_name(name), module


@contextlib.contextmanager
def eager_children(model: nn.Module) -> Iterator[int]:
    """While inside, every compiled submodule of `model` is replaced in its parent by its eager module; put back after.

    For tools that hook every op of a pass (the doctor's op watch): inside a compiled submodule dynamo would trace the
    tool's own dispatch code (recompiles, seconds for a tiny model), and the names would read ``block._orig_mod.fc``.
    The parameters are the same objects, so nothing the tool measures changes; the model is as it was afterwards, also
    when the body raises.

    Args:
        model: the module whose submodules (not itself: unwrap that one with :func:`eager`) to see through.

    Yields:
        how many compiled submodules were replaced.

    Example::

        >>> with eager_children(nn.Sequential(nn.Linear(2, 2))) as n:
        ...     n
        0
    """
    swapped = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
               if child is not None and is_compiled(child)]
    for parent, name, child in swapped:
        parent._modules[name] = eager(child)
    try:
        yield len(swapped)
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child
