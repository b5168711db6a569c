"""Every random stream a model's forward may draw from: torch's (CPU, and CUDA's), Python's ``random``, NumPy's
global one, and the generators the model's own modules hold (``torch.rand(..., generator=self.gen)``). What runs a
model and promises to leave its randomness alone (the doctor's passes and reruns, a trial's preflight) keeps them
all, not only torch's.

    >>> import torch, torch.nn as nn
    >>> m = nn.Linear(2, 2); m.gen = torch.Generator().manual_seed(0)
    >>> with kept(m):
    ...     _ = torch.rand(3, generator=m.gen)
    >>> float(torch.rand(1, generator=m.gen)) == float(torch.rand(1, generator=torch.Generator().manual_seed(0)))
    True
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

#: The random-number generators a module may hold as an attribute (SystemRandom has no state: not one of them).
RNG_TYPES = (torch.Generator, random.Random, np.random.Generator, np.random.RandomState)


def held_streams(model: nn.Module) -> dict[str, Any]:
    """The random-number generators the model's modules hold: a ``torch.Generator`` for inline dropout, a
    ``random.Random``, a NumPy ``Generator`` or ``RandomState``, as an attribute or inside a list, tuple or dict
    attribute. Keyed by where they sit, so a deep copy of the model finds its own copies at the same keys.

    Args:
        model: the module whose submodules are searched (each once).

    Example::

        >>> m = nn.Linear(2, 2); m.gen = torch.Generator().manual_seed(0)
        >>> list(held_streams(m))
        ['gen']
    """
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, value in vars(module).items():
            if isinstance(value, (list, tuple)):
                items = [(f"{attr}[{i}]", v) for i, v in enumerate(value)]
            elif isinstance(value, dict) and not attr.startswith("_"):  # not _parameters, _buffers, the hooks
                items = [(f"{attr}[{k!r}]", v) for k, v in value.items()]
            else:
                items = [(attr, value)]
            for key, v in items:
                if isinstance(v, RNG_TYPES) and not isinstance(v, random.SystemRandom):
                    out[prefix + key] = v
    return out


def stream_state(rng: Any) -> Any:
    """A copy of one generator's state, for :func:`set_stream_state`.

    Args:
        rng: a ``torch.Generator``, ``random.Random``, NumPy ``Generator`` or ``RandomState``.

    Example::

        >>> g = torch.Generator().manual_seed(1); s = stream_state(g); a = torch.rand(1, generator=g)
        >>> set_stream_state(g, s); bool(torch.rand(1, generator=g) == a)
        True
    """
    if isinstance(rng, torch.Generator):
        return rng.get_state()
    if isinstance(rng, random.Random):
        return rng.getstate()
    if isinstance(rng, np.random.Generator):
        return copy.deepcopy(rng.bit_generator.state)
    return rng.get_state()


def set_stream_state(rng: Any, state: Any) -> None:
    """Put one generator back at a state :func:`stream_state` took.

    Args:
        rng: the generator.
        state: what :func:`stream_state` returned for it.
    """
    if isinstance(rng, torch.Generator):
        rng.set_state(state)
    elif isinstance(rng, random.Random):
        rng.setstate(state)
    elif isinstance(rng, np.random.Generator):
        rng.bit_generator.state = copy.deepcopy(state)
    else:
        rng.set_state(state)


@contextlib.contextmanager
def kept(model: nn.Module | None = None, device: torch.device | str | None = None) -> Iterator[None]:
    """Run a block and put every random stream back as it was: torch's CPU stream (and the device's when it is
    CUDA), Python's, NumPy's global one and the generators ``model`` holds (:func:`held_streams`).

    Args:
        model: whose held generators to keep too (None: only the global streams).
        device: a CUDA device whose stream to keep as well (None or a CPU device: none).

    Example::

        >>> with kept():
        ...     _ = random.random()
    """
    dev = torch.device(device) if device is not None else None
    cuda = [dev] if dev is not None and dev.type == "cuda" else []
    held = [(g, stream_state(g)) for g in held_streams(model).values()] if model is not None else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
            for g, s in held:
                set_stream_state(g, s)
