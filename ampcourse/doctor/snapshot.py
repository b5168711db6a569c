"""Saving and restoring everything examine() could touch: gradients, buffers, training flags, the precision policy
and every RNG stream (torch CPU and CUDA, Python's, NumPy's, and the generators the model's modules hold), so that
examining leaves the model as it was and every pass starts from the same state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..policy import apply_policy, policy_of, remove_policy
from .._rng import held_streams, set_stream_state, stream_state


@dataclass
class Snapshot:
    """Gradients, buffers, training flags, the policy and the RNG streams, to restore after examining."""

    grads: dict[int, tuple[torch.nn.Parameter, torch.Tensor | None]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    training: list[tuple[nn.Module, bool]]
    policy: dict[str, str]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    py_rng: object
    np_rng: object
    #: (generator, its state) for each generator the model holds (held_streams), and for those of its copies (follow)
    held: list[tuple[Any, Any]] = field(default_factory=list)
    held_keys: dict[str, Any] = field(default_factory=dict)  # where each held generator sits -> its state

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Snapshot:
        """Record the state (gradients by reference: nothing is copied but the buffers)."""
        params = list(model.parameters())
        if optimizer is not None:
            params += [p for g in optimizer.param_groups for p in g["params"]]
        grads = {id(p): (p, p.grad) for p in params}
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        streams = held_streams(model)
        keys = {k: stream_state(g) for k, g in streams.items()}
        held = [(g, keys[k]) for k, g in streams.items()]
        return cls(grads, buffers, [(m, m.training) for m in model.modules()], policy_of(model), torch.get_rng_state(),
                   cuda, random.getstate(), np.random.get_state(), held, keys)

    def follow(self, copy_of_model: nn.Module) -> None:
        """Reset a copy's generators too (the fp32 reference copy of a low-precision model holds its own copies of
        the model's generators: each reference pass must draw what the model's passes draw)."""
        self.held += [(g, self.held_keys[k]) for k, g in held_streams(copy_of_model).items() if k in self.held_keys]

    def reset_rng(self) -> None:
        """Put every RNG stream (torch CPU and CUDA, Python's random, NumPy's, the generators the model holds) back
        where the caller left them, so each pass draws the same dropout masks and the same random numbers a forward
        may take from Python, NumPy or a generator of its own."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        for rng, state in self.held:
            set_stream_state(rng, state)

    def reset_buffers(self) -> None:
        """Buffers (BatchNorm's running statistics) as the caller left them: each pass starts from the same state."""
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)

    def restore(self, model: nn.Module) -> None:
        """Everything back as it was."""
        for p, g in self.grads.values():
            p.grad = g
        self.reset_buffers()
        for m, mode in self.training:
            m.training = mode
        remove_policy(model)
        if self.policy:
            apply_policy(model, self.policy)
        self.reset_rng()
