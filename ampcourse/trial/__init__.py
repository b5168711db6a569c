"""fp32 and AMP side by side over N steps: where a long run in bf16 or fp16 departs from fp32, and in which layer (chapter 10).

The AMP doctor (``ampcourse.doctor``) examines one step. A trial trains the *same* initial model on the *same*
batches once in fp32 (the reference) and once in each precision asked for, side by side, and records per step the
loss and its gap to fp32, the gradient-norm ratio, the loss scale and skipped steps, each layer's drift from fp32
and its update ratio, and what the monitors read (attention and output logits, activations). It reports the first
step where a precision departs from fp32 by more than ``tolerance``, and the layer that departs first.

    >>> from ampcourse.trial import trial
    >>> t = trial("transformer", precisions=("bf16", "fp16"), steps=200)
    >>> print(t.summary())        # per precision: final loss gap, worst drift, skips, the first departure
    >>> t.departure("bf16")       # Departure(step=..., series='attention_logit_max', layer='blocks.1', ...) or None
    >>> t.plot(); t.to_json("trial.json")

From a shell (like the doctor's)::

    python -m ampcourse.trial --model transformer --steps 200
    python -m ampcourse.trial --model transformer --precisions bf16,fp16,fp16-noscaler --lr 3e-3 --out trial.json

Precisions: ``fp32`` (a second fp32 run: its gap is exactly zero), ``bf16``, ``fp16`` (with a GradScaler set as
``ampcourse.train`` sets it) and ``fp16-noscaler`` (what happens when people forget it). The same arguments give
the same series, bit for bit, on one machine.

Where each part lives:

- ``monitors``: :class:`Monitor`, the built-in monitors and the forward hooks of a run;
- ``result``: :class:`Trial` (summary, plot, JSON), :class:`Departure` and how a departure is judged;
- ``runs``: :func:`trial`, its runs and their steps, and the flat views of the weights;
- ``cli`` and ``__main__``: ``python -m ampcourse.trial``.
"""

from __future__ import annotations

from .cli import main
from .monitors import (RECOMPUTE_GAP, Measure, Monitor, activation_max, attention_logit_max, default_monitors,
                       output_logit_max)
from .result import DRIFT_LINES, PRECISIONS, REFERENCE, Departure, Trial, unit_roundoff
from .runs import CHUNK_BYTES, RunFailed, trial

__all__ = ["Monitor", "Departure", "Trial", "trial", "RunFailed", "attention_logit_max", "output_logit_max", "activation_max",
           "default_monitors", "unit_roundoff", "REFERENCE", "PRECISIONS", "CHUNK_BYTES", "main"]
