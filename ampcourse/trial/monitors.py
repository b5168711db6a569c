"""What a trial watches inside the model (chapter 10): monitors, forward hooks that record one number per layer per step.

A :class:`Monitor` names a series and the modules to hook; the built-in ones read the largest pre-softmax attention
logit per block, the largest output logit and the largest activation per block. ``_Hooks`` holds one run's hooks:
the values stay 0-d tensors on the device until the step's one read-back, and a module recomputed during backward
(activation checkpointing) is kept apart and compared with its forward (``recompute_gap``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .. import _args, _compiled, emulate
from .. import inputs as _inputs

__all__ = ["Monitor", "Measure", "attention_logit_max", "output_logit_max", "activation_max", "default_monitors",
           "RECOMPUTE_GAP"]

#: A monitor's measure: (module, forward inputs, forward output) -> a 0-d tensor (kept on the device until the
#: end of the step, so a monitor costs no host sync of its own).
Measure = Callable[[nn.Module, tuple, Any], torch.Tensor]
#: The series of a step's recompute gap (see _Hooks.take), one value per step.
RECOMPUTE_GAP = "recompute_gap"


@dataclass(frozen=True)
class Monitor:
    """A per-layer quantity recorded at every step of every run.

    Args:
        name: the series name (``"attention_logit_max"``); its values are ``Trial.series[run][f"{name}/{layer}"]``.
        where: ``where(model)`` returns ``[(layer label, module to hook, measure), ...]``; the measure runs in a
            forward hook of that module, gets ``(module, inputs, output.detach())`` and returns a 0-d tensor.
            When a module runs more than once in a step's forward pass (a shared module), the step keeps the
            largest value; calls during backward (activation checkpointing recomputing it) are not recorded here
            but compared with it: see ``Trial`` (``recompute_gap``).
        by_magnitude: judge the run's own values by their size, not by their gap to fp32: the monitor departs when
            |L| * u passes the tolerance, with L the value and u the unit roundoff of the run's format (2**-8
            for bf16, 2**-11 for fp16; bf16 at |L| > 25.6 for tolerance 0.1). It is a threshold on a magnitude,
            not a measured error: it says how large a rounding error *could* be, for values that feed a softmax
            (attention scores, output logits). Softmax is shift-invariant, so what matters there is the absolute
            error of its inputs: logits each moved by at most delta = |L| * u change a probability by a factor
            within exp(+-2 * delta). Other monitors (the default) depart on their relative gap to the fp32 run.

    Example::

        def logsumexp(model):  # PaLM's z-loss watches log Z of the output logits
            return [("output", model, lambda m, args, out: out.float().logsumexp(-1).abs().max())]
        t = trial("transformer", monitors=[*default_monitors(), Monitor("log_z", logsumexp)])
    """

    name: str
    where: Callable[[nn.Module], list[tuple[str, nn.Module, Measure]]]
    by_magnitude: bool = False


def _scores_max(block: nn.Module) -> Measure:
    """The largest |q.k|/sqrt(d_head) from a block's fused qkv projection output (B, T, 3*D): the pre-softmax logits.

    A block with ``q_norm`` and ``k_norm`` modules (QK-norm) has them applied first, so the monitor reads the
    logits softmax sees. The scores are masked as the attention masks them: causally (a query sees the keys up
    to its own position, as the reference ``Block`` does), unless the block has ``causal = False``.
    """
    heads = block.heads
    q_norm, k_norm = getattr(block, "q_norm", None), getattr(block, "k_norm", None)
    causal = bool(getattr(block, "causal", True))

    def measure(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # The hook runs inside the step's autocast region, where `@` would cast q and k back to bf16/fp16: the
        # scores would be rounded, and on a CPU a low-precision `@` of this shape took ~4x as long (torch 2.13).
        if not emulate.autocast_state(out.device.type)[0]:  # the fp32 run: no context to enter
            return _scores(out)
        with torch.autocast(out.device.type, enabled=False):
            return _scores(out)

    def _scores(out: torch.Tensor) -> torch.Tensor:
        b, t, three_d = out.shape
        d = three_d // 3
        qk = out[..., :2 * d].float().view(b, t, 2, heads, d // heads)  # fp32 (see measure)
        q, k = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2)  # v is never copied
        if q_norm is not None and k_norm is not None:
            with torch.no_grad():  # their weights require grad: without this they would build a graph
                q, k = q_norm(q), k_norm(k)
        scores = q @ k.transpose(-2, -1)  # (B, heads, query, key)
        if causal:  # a future key's score never reaches softmax: unmasked, the largest |score| can be one of those
            scores = torch.tril(scores)  # zeros above the diagonal; the diagonal itself is always seen
        return _abs_amax(scores) / math.sqrt(d // heads)
    return measure


def _attention_blocks(model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """Every module with a fused ``qkv`` Linear and a ``heads`` count (the reference transformer's Block)."""
    found = []
    for name, module in _compiled.named_modules(model):
        qkv, heads = getattr(module, "qkv", None), getattr(module, "heads", None)
        if isinstance(qkv, nn.Linear) and isinstance(heads, int):
            found.append((name, qkv, _scores_max(module)))
    return found


def attention_logit_max() -> Monitor:
    """The largest pre-softmax attention logit |q.k|/sqrt(d) per block (modules with ``qkv`` and ``heads``)."""
    return Monitor("attention_logit_max", _attention_blocks, by_magnitude=True)


def _abs_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d tensor of x's dtype (nan if any element is nan).

    ``x.abs().amax()``, not ``torch.linalg.vector_norm(x, inf)``: the same value, but on a CPU (torch 2.13, a
    tensor of 16k-32k elements) the norm took ~45-90 us against ~5-12 us, a visible share of a tiny model's step.
    """
    return x.abs().amax()


def _abs_max(module: nn.Module, args: tuple, out: Any) -> torch.Tensor:
    """max |output| as 0-d fp32 (the max of bf16 values is a bf16 value: exact in fp32).

    Of the tensor the output leads with (``(logits, aux)``: the logits; ``.logits``); nan for an output without one.
    """
    t = out if isinstance(out, torch.Tensor) else _inputs.first_tensor(out)
    if t is None:
        return torch.tensor(math.nan)
    return _abs_amax(t.detach()).float()  # in the output's dtype: no fp32 copy of it (the hook passes it detached)


def output_logit_max() -> Monitor:
    """The largest |output| of the whole model: the output (vocabulary) logits of a language model."""
    return Monitor("output_logit_max", lambda model: [("output", model, _abs_max)], by_magnitude=True)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """The members of every nn.ModuleList (a transformer's blocks); the top-level children where there is none."""
    found = [(f"{name}.{i}".lstrip("."), block, _abs_max) for name, module in _compiled.named_modules(model)
             if isinstance(module, nn.ModuleList) for i, block in enumerate(module)]
    return found or [(name, child, _abs_max) for name, child in _compiled.eager(model).named_children()]


def activation_max() -> Monitor:
    """The largest |activation| leaving each block (ModuleList members, else the top-level children)."""
    return Monitor("activation_max", _blocks)


def default_monitors() -> list[Monitor]:
    """Attention-logit max per block, output-logit max, activation max per block."""
    return [attention_logit_max(), output_logit_max(), activation_max()]


def _measured(value: Any) -> str:
    """What a monitor's measure returned, for the error message."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{_args.shown(value)} (a {type(value).__name__}, not a tensor)"


def _where(monitor: Monitor, model: nn.Module) -> list[tuple[str, nn.Module, Measure]]:
    """monitor.where(model), checked: a list of (layer label, module of the model, callable measure) triples."""
    found = monitor.where(model)
    triples = list(found) if isinstance(found, (list, tuple)) else None
    ours = {id(m) for m in model.modules()}
    if triples is None or not all(isinstance(t, (tuple, list)) and len(t) == 3 and isinstance(t[0], str)
                                  and isinstance(t[1], nn.Module) and id(t[1]) in ours and callable(t[2])
                                  for t in triples):
        raise _inputs.InputError(f"monitor {monitor.name!r}: where(model) returned {_args.shown(found)}; it must return "
                                 "a list of (layer label, module of the model, measure) triples")
    return triples


class _Hooks:
    """The forward hooks of one run's monitors: each step's values stay 0-d tensors until read()."""

    def __init__(self, model: nn.Module, monitors: Sequence[Monitor]):
        self.labels: list[str] = []
        self.values: dict[str, torch.Tensor] = {}  # this step's forward calls
        self.reruns: dict[str, torch.Tensor] = {}  # this step's calls during backward (a recompute)
        # made once, on the model's device: they are stacked with the other values in the step's one read-back
        device = next(model.parameters()).device
        self.nan, self.zero = torch.tensor(math.nan, device=device), torch.tensor(0.0, device=device)
        self.handles = []
        for monitor in monitors:
            for layer, module, measure in _where(monitor, model):
                label = f"{monitor.name}/{layer}"
                if label not in self.labels:
                    self.labels.append(label)
                    self.handles.append(module.register_forward_hook(self._hook(label, measure)))

    def _hook(self, label: str, measure: Measure):
        def hook(module, args, out):
            # A detached output: the measure's ops build no autograd graph (cheaper than a no_grad block per call).
            value = measure(module, args, out.detach() if isinstance(out, torch.Tensor) else out)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:  # else an error that blamed the data
                raise _inputs.InputError(f"monitor {label!r}: its measure returned {_measured(value)}; a measure "
                                         "returns a 0-d tensor (one number, e.g. out.abs().amax())")
            if value.dtype != torch.float32 or value.dim():  # the built-in measures return 0-d fp32 already
                value = value.detach().float().reshape(())
            if value.device != self.nan.device:  # e.g. a CPU nan for an output without a tensor, on a CUDA model:
                value = value.to(self.nan.device)  # all values are stacked in one read-back on the model's device
            # Inside the autograd engine (a graph task is running) this call is a recompute for backward
            # (torch.utils.checkpoint, a hand-written recompute): kept apart, compared with the forward's in take().
            store = self.reruns if torch._C._current_graph_task_id() != -1 else self.values
            old = store.get(label)
            store[label] = value if old is None else torch.maximum(old, value)
        return hook

    def take(self) -> list[torch.Tensor]:
        """This step's values in label order (nan for a layer that did not run), then the recompute gap; reset.

        The recompute gap is the largest |recomputed - forward| / |forward| over the labels that ran again
        during backward (0 when none did): a faithful recompute gives exactly the forward's values, so
        exactly 0 (on a deterministic device), whichever way a wrong one strays.
        """
        nan = self.nan
        out = [self.values.get(label, nan) for label in self.labels]
        gaps = [(again - self.values[label]).abs() / self.values[label].abs().clamp_min(1e-30)
                for label, again in self.reruns.items() if label in self.values]
        out.append(torch.stack(gaps).amax() if gaps else self.zero)
        self.values, self.reruns = {}, {}
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
