"""The AMP doctor: measure how a model behaves in fp16 and bf16, and advise what to do about it.

    >>> from ampcourse.doctor import examine
    >>> report = examine(model, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=opt)
    >>> report                        # in Jupyter: HTML, worst findings first, each citing its number
    >>> report.recommended_precision, report.recommended_init_scale, report.fp32_modules
    >>> report.plot()                 # activation and gradient ranges against the fp16 / bf16 windows
    >>> report.to_json("doctor.json")

From a shell, on a reference model or on a factory of your own that returns
``(model, inputs, targets, loss_fn)`` (optionally a fifth item, the optimizer)::

    python -m ampcourse.doctor --model transformer
    python -m ampcourse.doctor --model mypkg.mymodule:make --device cuda --out report.json --html report.html

What it runs (the model's parameters, buffers, ``.grad``, training flags, the optimizer and the RNG
streams are restored afterwards, bit for bit):

1. one forward + backward pass as the model is (fp32): per module, a log2 histogram of its outputs and
   of their gradients, and of every parameter gradient (histograms, never copies of the tensors: at most
   2**17 values wait, copied, to be counted together);
2. per requested precision, one forward pass under ``torch.autocast``: output dtypes, inf/NaN, and each
   leaf module's *own* error (its autocast output against the same module rerun in fp32 on the same
   inputs), so a problem is pinned on the module that causes it, not on everything after it;
3. fp32 islands (:func:`ampcourse.policy.apply_policy`) for the modules that fail, checked by rerunning;
4. an optimizer audit: dtypes, updates lost to rounding in low-precision parameters, Adam's eps.

Gradient ranges are counted in the categories of :func:`ampcourse.scaling.range_counts` (the tests
check the histogram counts against it) at the thresholds of :func:`ampcourse.scaling.zone_thresholds`.
"""

from __future__ import annotations

import argparse
import functools
import html
import importlib
import json
import math
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from . import _args, formats
from .device import AmpSetup, parse_precision, pick
from .models import data_errors
from .policy import apply_policy, policy_of, remove_policy
from .scaling import RANGE_CATEGORIES, range_counts, zone_thresholds

__all__ = ["examine", "Report", "Finding", "Log2Hist", "KINDS", "SEVERITIES", "REL_TOL", "main"]

#: Every kind of finding, in the order the report sorts them within one severity.
KINDS = ("nonfinite", "activation_overflow", "precision_loss", "gradient_overflow", "gradient_underflow",
         "lost_updates", "eps_underflow", "scaler_needed", "no_scaler_needed")
SEVERITIES = ("error", "warning", "info")

#: A leaf module's own relative error under autocast that counts as precision loss: 8 units of the format's
#: rounding step (fp16 ~0.8%, bf16 ~6%); rounding inputs and weights once costs about one unit.
REL_TOL = {p: 8 * formats.spec(p).eps for p in ("fp16", "bf16")}
GRAD_MARGIN = 8.0  # the recommended scale keeps max|grad| x scale this many times below fp16's max
UNDERFLOW_WARN = 0.01  # warn when more than 1% of the nonzero gradients flush to zero
LOST_WARN = 0.10  # warn when more than 10% of the update elements round to no change
MAX_ISLANDS = 4  # more fp32 modules than this, and fp16 is not worth it: use bf16 or fp32
DEFAULT_SCALE = 2.0**16  # torch.amp.GradScaler's init_scale
_SAMPLE = 1024  # output values per module kept to compare a precision's final outputs with fp32
#: Modules whose output only selects or rearranges input values: rerun in fp32 on the same inputs (converted exactly),
#: they return the same values, so their own error is 0 (or inf with an inf/NaN) without running them again.
_EXACT = frozenset({nn.Identity, nn.Flatten, nn.Unflatten, nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d})
#: Values histogrammed per tensor at most (evenly spaced; max and inf/NaN counts use every value): the
#: counting, not the model, dominated examine()'s time on large activations (benchmarks/README.md).
COUNT_CAP = 2**16


# -- histograms ---------------------------------------------------------------------------------------------

class Log2Hist:
    """Counts of |x| per binade [2**b, 2**(b+1)) and per closeness to the binade's top, plus zeros, infs/NaNs, max.

    A tensor's range, not its values. Each value is counted from its float32 bits: the exponent gives its
    binade (fp32 subnormals included), and the fraction its class Q = 1 + (leading ones of the fraction),
    capped at QMAX, or 0 when the value is exactly a power of two. Q places each value against the rounding
    thresholds of fp16 and bf16 (65520 = 2**16 * (1 - 2**-12), ...), so :meth:`counts` equals
    ``range_counts`` at power-of-two scales, from a fixed-size table and a few cheap integer ops per value.
    Float64 tensors are counted as float32. With ``cap`` (the doctor uses :data:`COUNT_CAP`) a large tensor
    is counted on evenly spaced values; its max and its infs/NaNs always come from every value.
    """

    LO, HI = -149, 127  # binades from fp32's smallest subnormal (2**-149) to its largest (2**127)
    QMAX = 13  # Q classes 0 (a power of two) .. 13 (within 2**-12 of the binade's top): enough for fp16 and bf16
    _ROW0 = 32  # table row of binade b is b + 127 + _ROW0; row 0 holds zeros, the last row infs and NaNs
    _ROWS = 255 + _ROW0 + 1
    _NB = _ROWS * (QMAX + 1)  # table size

    def __init__(self) -> None:
        self._table: np.ndarray | None = None  # host counts, _ROWS x (QMAX + 1); filled by _Counter.flush()
        self._n = self._nonfinite = 0
        self._max = 0.0
        self._frozen: tuple[np.ndarray, int, int, int, float] | None = None
        self._cum: np.ndarray | None = None  # counts below each (binade, Q), in table order: counts() in O(1)
        self._counts: dict[tuple[float, str], dict[str, int]] = {}  # counts() per (scale, fmt) since the last add

    @property
    def _nq(self) -> int:
        return self.QMAX + 1

    def add(self, t: torch.Tensor, cap: int | None = None) -> None:
        """Count the values of a floating-point tensor (ignored otherwise); cap: histogram at most about this many
        evenly spaced values, each standing for its share of the tensor (max and infs/NaNs come from every value)."""
        if cap is not None:
            cap = _args.integer(cap, "cap", low=1)
        counter = _Counter()
        counter.add(t, [self], cap)
        counter.flush()

    @classmethod
    def _fast_index(cls, values: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
        """_bin_index for normal numbers, zeros, infs and NaNs, from float32 values seen as int32, in cheap integer
        ops written into the four rows of work (no compares, no where, no allocation); returns one of those rows.

        Zeros and fp32 subnormals (exponent field 0) land in the row of binade -127: zeros at Q 0, subnormals at Q >= 1,
        which _Counter.flush() checks on the host (an fp32 subnormal is rare: it then recounts with _bin_index).
        """
        bits, frac, nz, q = work
        torch.bitwise_and(values, 0x7FFFFFFF, out=bits)
        torch.bitwise_and(bits, 0x7FFFFF, out=frac)
        torch.add(frac, 0x7FFFFF, out=nz).bitwise_right_shift_(23)  # 0 iff frac == 0 (a power of two: Q 0), else 1
        # Q = 1 + leading ones of the fraction = 24 - bit length of its complement (read off a float's exponent).
        q.view(torch.float32).copy_(frac.bitwise_xor_(0x7FFFFF))
        q.bitwise_right_shift_(23).neg_().add_(150).clamp_(max=cls.QMAX).mul_(nz)
        return q.add_(bits.bitwise_right_shift_(23).add_(cls._ROW0).mul_(cls.QMAX + 1))

    @classmethod
    def _bin_index(cls, bits: torch.Tensor) -> torch.Tensor:
        """The table index of each value from its |x| float32 bits (int32): row (binade) x (QMAX + 1) + Q."""
        sub = bits < 0x00800000  # zero or an fp32 subnormal: read its bits from float(bits) instead, 149 binades up
        eff = torch.where(sub, bits.float().view(torch.int32) - (149 << 23), bits)
        frac = eff & 0x7FFFFF
        # Q = 1 + leading ones of the fraction = 24 - bit length of its complement (read off a float's exponent).
        q = (150 - ((frac ^ 0x7FFFFF).float().view(torch.int32) >> 23)).clamp_(max=cls.QMAX)
        q = torch.where(frac == 0, 0, q)
        rows = ((eff >> 23) + cls._ROW0).clamp_(0, cls._ROWS - 1)  # zero lands below every binade: row 0
        return rows * (cls.QMAX + 1) + q

    def _add_counts(self, table: np.ndarray, n: int, top: float, nonfinite: int) -> None:
        """Add one tensor's counts (a host table row, numel, max |finite x|, infs/NaNs)."""
        if self._table is None:
            self._table = table.astype(np.int64).reshape(self._ROWS, self._nq)
        else:
            self._table = self._table + table.reshape(self._ROWS, self._nq)
        self._n += n
        self._max = max(self._max, top)
        self._nonfinite += nonfinite
        self._frozen, self._cum, self._counts = None, None, {}

    def merge(self, other: Log2Hist) -> Log2Hist:
        """A new histogram holding the counts of both."""
        if not isinstance(other, Log2Hist):
            raise ValueError(f"other must be a Log2Hist, got {_args.shown(other)}")
        return Log2Hist.merged([self, other])

    @staticmethod
    def merged(hists: Sequence[Log2Hist]) -> Log2Hist:
        """A new histogram holding the counts of all of them (one sum, not a chain of merges)."""
        out = Log2Hist()
        full = [h for h in hists if h._table is not None]
        if full:
            out._add_counts(np.sum([h._table for h in full], axis=0), sum(h._n for h in full),
                            max(h._max for h in full), sum(h._nonfinite for h in full))
        return out

    def _values(self) -> tuple[np.ndarray, int, int, int, float]:
        """(positive finite counts as binade x Q, numel, zeros, nonfinite, max) as host values."""
        if self._frozen is None:
            nq = self._nq
            if self._table is None:
                self._frozen = (np.zeros((self.HI - self.LO + 1, nq), np.int64), 0, 0, 0, 0.0)
            else:
                first = self.LO + 127 + self._ROW0
                self._frozen = (self._table[first:self._ROWS - 1], self._n, int(self._table[0].sum()),
                                self._nonfinite, float(self._max))
        return self._frozen

    def _cumulative(self) -> np.ndarray:
        """Counts of the values below each (binade, Q), in table order, then the total: counts() in O(1)."""
        if self._cum is None:
            self._cum = np.concatenate([[0], np.cumsum(self._values()[0])])
        return self._cum

    @property
    def numel(self) -> int:
        """How many values were counted."""
        return self._values()[1]

    @property
    def zeros(self) -> int:
        """How many were exactly zero."""
        return self._values()[2]

    @property
    def nonfinite(self) -> int:
        """How many were inf or NaN."""
        return self._values()[3]

    @property
    def nonzero(self) -> int:
        """Finite nonzero values: those a format can flush or overflow."""
        return int(self._cumulative()[-1])

    @property
    def max(self) -> float:
        """The largest finite |x| (0.0 if none)."""
        return self._values()[4]

    @property
    def min(self) -> float:
        """The lower edge of the smallest occupied binade (0.0 if none)."""
        nz = np.flatnonzero(self._values()[0].sum(1))
        return math.ldexp(1.0, int(nz[0]) + self.LO) if nz.size else 0.0

    def _below(self, t: float, goes_up: bool, shift: int) -> int:
        """How many values x have x * 2**shift below t (x * 2**shift == t included when t rounds down)."""
        below, nq = self._cumulative(), self._nq
        fm, fe = math.frexp(t)  # t = fm * 2**fe lies in binade fe - 1
        b = fe - 1 - shift - self.LO  # that binade's row, for the unscaled values
        if b < 0:
            return 0
        if b * nq >= below.size - 1:
            return int(below[-1])
        if fm == 0.5:  # t is a power of two: the binade starts at t; values exactly t are class 0
            return int(below[b * nq + (0 if goes_up else 1)])
        d = -math.log2(1 - fm)
        if not d.is_integer():
            raise ValueError(f"threshold {t!r} is not 2**E * (1 - 2**-d): Log2Hist cannot place it exactly")
        return int(below[b * nq + min(int(d), nq)])  # Q < d: m < 1 - 2**-d, so x < t

    def counts(self, scale: float = 1.0, fmt: str = "fp16") -> dict[str, int]:
        """range_counts(values, scale, fmt), from the histogram; scale must be a power of two (as GradScaler's are)."""
        scale = _args.real(scale, "scale", positive=True, what="a positive power of two (such as 2.0**16)")
        fmt = formats.spec(fmt).name  # an unknown name fails here, listing the format names
        return dict(self._counts_at(scale, fmt))

    def _counts_at(self, scale: float, fmt: str) -> dict[str, int]:
        """counts() for a checked float scale and format name, cached (the doctor asks hundreds of times)."""
        key = (scale, fmt)
        if self._frozen is not None and key in self._counts:
            return self._counts[key]
        fm, fe = math.frexp(scale) if scale > 0 and math.isfinite(scale) else (0.0, 0)
        if fm != 0.5:
            raise ValueError(f"scale must be a positive power of two (such as 2.0**16), got {scale!r}")
        _, _, zero, nonfinite, _ = self._values()
        flush, sub, over = (self._below(t, goes_up, fe - 1) for t, goes_up in _thresholds(fmt))
        out = {"overflow": self.nonzero - over + nonfinite, "fine": over - sub, "subnormal": sub - flush,
               "underflow": flush, "zero": zero}
        self._counts[key] = out
        return out

    def share(self, category: str, scale: float = 1.0, fmt: str = "fp16") -> float:
        """The share of the nonzero values that land in a range_counts category."""
        if not isinstance(category, str) or category not in RANGE_CATEGORIES:
            raise ValueError(f"category must be one of {RANGE_CATEGORIES}, got {category!r}")
        n = self.nonzero + self.nonfinite
        return self.counts(scale, fmt)[category] / n if n else 0.0

    def _share(self, category: str, scale: float = 1.0, fmt: str = "fp16") -> float:
        """share() for the doctor's own, known-good arguments (no argument checks)."""
        n = self.nonzero + self.nonfinite
        return self._counts_at(float(scale), fmt)[category] / n if n else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Occupied binades as {log2 lower edge: count}, plus the totals."""
        bins, n, z, nf, m = self._values()
        return {"numel": n, "zeros": z, "nonfinite": nf, "max": m,
                "log2_bins": {int(i) + self.LO: int(c) for i, c in enumerate(bins.sum(1)) if c}}


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |x| of a non-empty tensor (NaN if one is NaN), in one pass without an |x| copy (fresh pages cost more)."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(hi, -lo).abs()  # abs: max(-0.0, 0.0) may be -0.0


class _Entry:
    """One queued tensor: the histograms it goes into, and its counts once flushed."""

    __slots__ = ("targets", "result")

    def __init__(self, targets: list[Log2Hist]) -> None:
        self.targets = targets  # may still grow (a container's output is its last child's) until flushed
        self.result: tuple[np.ndarray, int, float, int] | None = None

    def feed(self, h: Log2Hist) -> None:
        """Count this tensor into one more histogram (now if flushed, else at the flush)."""
        if self.result is not None:
            h._add_counts(*self.result)
        else:
            self.targets.append(h)


class _Counter:
    """Histogram counting, batched: per tensor only its max (and inf/NaN count) is taken when it is queued, and its
    values (or COUNT_CAP of them) are copied into one reusable buffer; flush() bins the buffer in a few in-place integer
    ops and one bincount, read back with the queued maxima (on CUDA: two host syncs per flush, not one per tensor).

    Per-tensor small ops, host reads (a sync on CUDA) and fresh allocations (page faults on a CPU), not the counting
    itself, dominated the doctor's time on small models (benchmarks/README.md, "AMP doctor cost"). At most LIMIT
    values wait: memory stays bounded (five buffers of LIMIT int32, about 2.5 MiB).
    """

    LIMIT = 2**17

    def __init__(self) -> None:
        self._work: torch.Tensor | None = None  # 5 x size int32: the values, then four scratch rows for flush()
        self._reset()

    def _reset(self) -> None:
        """Nothing queued."""
        self.spans: list[tuple[int, int]] = []  # (offset, length) of each entry's values in the buffer
        self.steps: list[int] = []  # each binned value stands for this many
        self.numels: list[int] = []
        self.tops: list[float | torch.Tensor] = []  # max |finite x|: a float where already read, else a 0-dim tensor
        self.nonfinite: list[int | torch.Tensor] = []
        self.entries: list[_Entry] = []
        self.pending = 0

    def _buffer(self, size: int, dev: torch.device) -> torch.Tensor:
        """The work buffer, at least size values per row, on dev (kept between flushes: no fresh pages each time)."""
        if self._work is None or self._work.shape[1] < size or self._work.device != dev:
            self._work = torch.empty(5, max(size, self.LIMIT), dtype=torch.int32, device=dev)
        return self._work

    def add(self, t: torch.Tensor, targets: list[Log2Hist], cap: int | None = None) -> _Entry | None:
        """Queue a floating-point tensor (None for anything else) for the histograms in targets."""
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return None
        a = t.detach().reshape(-1)
        if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            a = a.float()  # float64 is counted as float32 (out-of-range values become inf); fp16/bf16 widen exactly
        n = a.numel()
        if n == 0:
            top, nonfinite = 0.0, 0
        else:
            top = _abs_max(a)  # inf or NaN if any value is
            if a.device.type == "cpu" and math.isfinite(top := float(top)):  # all finite (a read-back is free on a CPU)
                nonfinite = 0
            else:  # an inf/NaN may be there: the largest finite value and the count need a second look
                finite = torch.isfinite(a)
                top = torch.where(finite, a.abs(), 0).max().float()
                nonfinite = n - finite.sum()
        step = max(1, -(-n // cap)) if cap else 1
        m = -(-n // step)
        if self.entries and (self.pending + m > self.LIMIT or self._work.device != a.device):
            self.flush()
        # Copied now (as float32): the model may still change the tensor in place (a residual's +=) before the flush.
        self._buffer(self.pending + m, a.device)[0, self.pending:self.pending + m].view(torch.float32).copy_(a[::step])
        entry = _Entry(targets)
        self.spans.append((self.pending, m))
        self.steps.append(step)
        self.numels.append(n)
        self.tops.append(top)
        self.nonfinite.append(nonfinite)
        self.entries.append(entry)
        self.pending += m
        if self.pending >= self.LIMIT:
            self.flush()
        return entry

    def flush(self) -> None:
        """Bin every queued tensor and add the counts to their histograms: one bincount, read back once."""
        if not self.entries:
            return
        nb, nq, n = Log2Hist._NB, Log2Hist.QMAX + 1, self.pending
        w = self._work[:, :n]
        idx = Log2Hist._fast_index(w[0], w[1:])
        for i, (start, length) in enumerate(self.spans[1:], 1):  # entry i counts into table i
            idx[start:start + length].add_(i * nb)
        bins = torch.bincount(idx, minlength=len(self.entries) * nb).view(len(self.entries), nb)
        lazy = [i for i, v in enumerate(self.tops) if isinstance(v, torch.Tensor)]
        tops, nonfinite = list(self.tops), list(self.nonfinite)
        if lazy:
            read = torch.stack([torch.stack([self.tops[i].double(), torch.as_tensor(self.nonfinite[i]).double()])
                                for i in lazy]).cpu().tolist()
            for i, (m, nf) in zip(lazy, read):
                tops[i], nonfinite[i] = m, int(nf)
        table = bins.cpu().numpy()
        sub_row = Log2Hist._ROW0 * nq  # the row of binade -127, where the fast index puts exponent field 0
        for i, (start, length) in enumerate(self.spans):
            if table[i, sub_row + 1:sub_row + nq].any():  # fp32 subnormals: count this tensor exactly
                bits = w[0, start:start + length] & 0x7FFFFFFF
                table[i] = torch.bincount(Log2Hist._bin_index(bits), minlength=nb).cpu().numpy()
            else:  # what the fast index put at (binade -127, Q 0) are the zeros: row 0
                table[i, 0], table[i, sub_row] = table[i, sub_row], 0
        table *= np.asarray(self.steps, dtype=table.dtype)[:, None]
        for i, entry in enumerate(self.entries):
            entry.result = (table[i], self.numels[i], float(tops[i]), int(nonfinite[i]))
            for h in entry.targets:
                h._add_counts(*entry.result)
        self._reset()


@functools.cache
def _thresholds(fmt: str) -> tuple[tuple[float, bool], ...]:
    """zone_thresholds(fmt), each with whether a value exactly on it rounds up (computed once per format)."""
    f = formats.spec(fmt)
    return tuple((t, bool(formats._round_unbounded(np.array([t]), f)[0] > t)) for t in zone_thresholds(fmt))


# -- findings and the report --------------------------------------------------------------------------------

@dataclass
class Finding:
    """One measured problem or fact: what, where, in which precision, the number, and what to do."""

    kind: str
    module: str  # qualified module name, a parameter name, or "" for the whole model
    precision: str  # "fp16", "bf16" or "fp32"
    value: float
    message: str
    severity: str = "warning"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (inf/NaN values as strings)."""
        d = asdict(self)
        d["value"] = _json_number(self.value)
        return d


def _json_number(x: float) -> float | str:
    """A float JSON can hold: inf and NaN become 'inf', '-inf', 'nan'."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _sort_key(f: Finding) -> tuple:
    """Worst first: errors, then warnings, then information; within one, by kind, then the larger value."""
    v = f.value if math.isfinite(f.value) else 1e300
    return SEVERITIES.index(f.severity), KINDS.index(f.kind), -v


@dataclass
class Report:
    """What examine() measured and advises. Display it in Jupyter, print it, plot it or save it as JSON."""

    findings: list[Finding]
    recommended_precision: str
    recommended_init_scale: float
    fp32_modules: list[str]
    device: str
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)  # per precision: status, islands, loss
    gradients: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)  # per module, in the order they finish
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def warnings(self) -> list[Finding]:
        """The findings that need action (errors and warnings; not the informational ones)."""
        return [f for f in self.findings if f.severity != "info"]

    def kinds(self) -> set[str]:
        """The kinds of finding present."""
        return {f.kind for f in self.findings}

    def find(self, kind: str, precision: str | None = None) -> list[Finding]:
        """The findings of one kind (and precision, if given)."""
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return [f for f in self.findings if f.kind == kind and (precision is None or f.precision == precision)]

    def policy_snippet(self, precision: str | None = None) -> str:
        """Code that applies the fp32 islands for precision (default: the recommended one); empty when there are none."""
        if precision is not None:
            precision = parse_precision(precision)  # 'bf16', torch.bfloat16, ... or ValueError listing the names
        names = self.fp32_modules if precision is None else self.verdicts.get(precision, {}).get("fp32_modules", [])
        if not names:
            return ""
        rules = ", ".join(f"{n!r}: 'fp32'" for n in names)
        return f"from ampcourse.policy import apply_policy\napply_policy(model, {{{rules}}})"

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready Python values."""
        return json.loads(json.dumps({
            "device": self.device, "recommended_precision": self.recommended_precision,
            "recommended_init_scale": self.recommended_init_scale, "fp32_modules": self.fp32_modules,
            "findings": [f.to_dict() for f in self.findings], "advice": self.advice, "notes": self.notes,
            "verdicts": self.verdicts, "gradients": self.gradients, "optimizer": self.optimizer,
            "modules": self.modules}, default=_json_default))

    def to_json(self, path: str | None = None) -> str:
        """The report as JSON text; also written to path when given."""
        if path is not None:
            path = _args.writable_file(path, "path")  # before the work, and naming what is wrong with it
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    def summary(self) -> str:
        """Plain text: the recommendation, then every finding (worst first), advice and notes."""
        lines = [f"AMP doctor on {self.device}: use {self.recommended_precision}"
                 + (f" with fp32 modules {self.fp32_modules}" if self.fp32_modules else "")
                 + (f", GradScaler(init_scale=2**{int(math.log2(self.recommended_init_scale))})"
                    if self.recommended_precision == "fp16" else ", no GradScaler needed")]
        n = {sev: sum(f.severity == sev for f in self.findings) for sev in SEVERITIES}
        lines.append(f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} note(s):")
        lines += [f"  [{f.severity}] {f.kind} ({f.precision}{', ' + f.module if f.module else ''}): {f.message}"
                  for f in self.findings]
        lines += ["advice:"] + [f"  - {a}" for a in self.advice]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        """An HTML summary for Jupyter: recommendation, findings table (worst first), advice, notes."""
        colour = {"error": "#c0392b", "warning": "#d68910", "info": "#2e86c1"}
        rows = "".join(
            f"<tr><td style='color:{colour[f.severity]}'><b>{f.severity}</b></td><td>{html.escape(f.kind)}</td>"
            f"<td>{html.escape(f.precision)}</td><td><code>{html.escape(f.module) or '(model)'}</code></td>"
            f"<td>{html.escape(_fmt_value(f.value))}</td><td>{html.escape(f.message)}</td></tr>" for f in self.findings)
        head = html.escape(self.summary().splitlines()[0])
        advice = "".join(f"<li>{html.escape(a)}</li>" for a in self.advice)
        notes = "".join(f"<p><i>{html.escape(n)}</i></p>" for n in self.notes)
        snippet = f"<pre>{html.escape(self.policy_snippet())}</pre>" if self.fp32_modules else ""
        return (f"<div><h4>{head}</h4><table><tr><th>severity</th><th>kind</th><th>precision</th><th>module</th>"
                f"<th>value</th><th>message</th></tr>{rows}</table><p><b>Advice</b></p><ul>{advice}</ul>{snippet}"
                f"{notes}</div>")

    def plot(self, ax=None):
        """Per module: the log2 range of its outputs (fp32 run) and output gradients against fp16's and bf16's windows."""
        import matplotlib.pyplot as plt

        mods = [m for m in self.modules if m["leaf"] and m["act_max"] > 0]
        if ax is None:
            fig, ax = plt.subplots(figsize=(10, 0.32 * len(mods) + 1.6))
        else:
            fig = ax.figure
        for fmt, colour in (("bf16", "#d5f5e3"), ("fp16", "#d6eaf8")):
            f = formats.spec(fmt)
            lo, hi = math.log2(f.min_subnormal), math.log2(f.max)
            ax.axvspan(max(lo, -60), min(hi, 30), color=colour, alpha=0.6, zorder=0,
                       label=f"{fmt}: 2^{lo:.0f} .. {f.max:.3g}" if fmt == "fp16" else f"{fmt} (wider than shown)")
        ax.axvline(math.log2(formats.spec("fp16").min_normal), color="#2e86c1", lw=0.8, ls=":",
                   label="fp16 smallest normal")
        for i, m in enumerate(mods):
            for key, dy, colour, label in (("act", -0.15, "#1f618d", "activations"), ("grad", 0.15, "#b03a2e", "gradients")):
                lo, hi = m[f"{key}_min"], m[f"{key}_max"]
                if hi > 0:
                    ax.plot([math.log2(lo), math.log2(hi)], [i + dy, i + dy], color=colour, lw=3,
                            label=label if i == 0 else None)
        ax.set_yticks(range(len(mods)), [m["name"] for m in mods], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("log2 |value| (smallest occupied binade to max)")
        ax.set_xlim(-60, 30)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        ax.set_title(f"AMP doctor: value ranges per module ({self.device})")
        fig.tight_layout()
        return fig


def _fmt_value(v: float) -> str:
    """A finding's value in a few characters."""
    return f"{v:.3g}" if math.isfinite(v) else str(v)


def _json_default(obj):
    """JSON fallback for numbers numpy/torch hand back."""
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return _json_number(float(obj))
    return str(obj)


# -- argument checks and calling the model -------------------------------------------------------------------

def _check_inputs(inputs) -> None:
    """TypeError unless inputs is a tensor, a tuple (positional arguments) or a dict (keyword arguments)."""
    if isinstance(inputs, (torch.Tensor, tuple)):
        return
    if isinstance(inputs, Mapping) and all(isinstance(k, str) for k in inputs):
        return
    raise TypeError(f"inputs must be a tensor, a tuple of tensors (positional arguments) or a dict with str keys "
                    f"(keyword arguments), got {type(inputs).__name__}")


def _check_precisions(precisions) -> tuple[str, ...]:
    """('fp16', 'bf16')-like tuple; ValueError for fp32, unknown names, duplicates or an empty sequence."""
    if isinstance(precisions, (str, torch.dtype)):
        precisions = (precisions,)
    if not isinstance(precisions, Sequence) or not precisions:
        raise ValueError(f"precisions must be a non-empty sequence of 'fp16' and/or 'bf16', got {_args.shown(precisions)}")
    out = []
    for p in precisions:
        try:
            name = parse_precision(p)
        except ValueError:
            raise ValueError(f"precisions: unknown precision {_args.shown(p)}; choose from fp16, bf16") from None
        if name == "fp32":
            raise ValueError("precisions lists the low-precision formats to examine ('fp16', 'bf16'); "
                             "fp32 is always run as the reference")
        if name not in out:
            out.append(name)
    return tuple(out)


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (cpu for a model without either)."""
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def _resolve_device(model: nn.Module, device) -> torch.device:
    """The device to examine on: the model's own, which device= (if given) must name."""
    here = _model_device(model)
    if device is None:
        return here
    dev = pick(device, "fp32").device  # validates the name and that CUDA exists
    if dev.type != here.type or (dev.index is not None and here.index is not None and dev.index != here.index):
        raise ValueError(f"device={str(device)!r} but the model is on {here}: move it first "
                         f"(model.to({str(dev)!r})) or leave device=None")
    return here


def _to_device(obj, dev: torch.device):
    """Tensors in a (nested) tuple, list or dict, detached (backward must not reach the caller's) and on dev."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(dev)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, dev) for o in obj)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, dev) for k, v in obj.items()}
    return obj


def _call(model: nn.Module, inputs):
    """model(inputs), model(*inputs) or model(**inputs)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _loss(output, targets, loss_fn: Callable | None) -> torch.Tensor:
    """The scalar loss: loss_fn(output, targets), else the output itself or its .loss / ['loss']."""
    if loss_fn is None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            loss = output
    else:
        loss = loss_fn(output) if targets is None else loss_fn(output, targets)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        what = f"a {tuple(loss.shape)} {loss.dtype} tensor" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must be a one-element floating-point tensor, got {what}: with loss_fn=None the "
                         "model must return a scalar loss or an output with .loss (pass labels in inputs); "
                         "otherwise pass loss_fn=")
    return loss.reshape(())


def _first_tensor(inputs):
    """The first tensor of inputs (for error messages)."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    return next((v for v in values if isinstance(v, torch.Tensor)), inputs)


def _float_tensors(obj) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a module's output (tensor, tuple, list, dict or ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _float_tensors(o)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from _float_tensors(o)


def _is_leaf(module: nn.Module) -> bool:
    """No child modules: its forward is the math the doctor can rerun on its own."""
    return next(module.children(), None) is None


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Up to _SAMPLE evenly spaced values of t, as float32 (the same positions in every pass)."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLE)
    return flat[::step][:_SAMPLE].float()


def _count_nonfinite(t: torch.Tensor) -> int:
    """How many values of t are inf or NaN (the max |x| first: a bool mask only when one is there)."""
    if t.numel() == 0 or math.isfinite(float(_abs_max(t.detach()))):
        return 0
    return int((~torch.isfinite(t)).sum())


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are 0, inf when got is not finite or ref is 0)."""
    got, ref = (t.detach().reshape(-1) for t in (got, ref))
    got, ref = (t.float() if t.dtype == torch.float64 else t for t in (got, ref))  # compared as float32 values
    if got.shape != ref.shape:
        return math.inf
    # In float64 without a float64 copy of ref (the same sums as converting both first, one allocation fewer).
    num = float(torch.linalg.vector_norm(got.double().sub_(ref)))
    den = float(torch.linalg.vector_norm(ref, dtype=torch.float64))
    # An inf/NaN in got makes num inf/NaN, so a finite num means a finite got; only a non-finite ref needs a look.
    if not math.isfinite(num) and (math.isfinite(den) or not bool(torch.isfinite(got).all())):
        return math.inf
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


# -- saving and restoring everything examine() could touch ---------------------------------------------------

@dataclass
class _Snapshot:
    """Gradients, buffers, training flags, the policy and the RNG streams, to restore after examining."""

    grads: dict[int, tuple[torch.nn.Parameter, torch.Tensor | None]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    training: list[tuple[nn.Module, bool]]
    policy: dict[str, str]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    py_rng: object
    np_rng: object

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> _Snapshot:
        """Record the state (gradients by reference: nothing is copied but the buffers)."""
        params = list(model.parameters())
        if optimizer is not None:
            params += [p for g in optimizer.param_groups for p in g["params"]]
        grads = {id(p): (p, p.grad) for p in params}
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(grads, buffers, [(m, m.training) for m in model.modules()], policy_of(model), torch.get_rng_state(),
                   cuda, random.getstate(), np.random.get_state())

    def reset_rng(self) -> None:
        """Put the torch RNG streams back where the caller left them (each pass draws the same dropout masks)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self, model: nn.Module) -> None:
        """Everything back as it was."""
        for p, g in self.grads.values():
            p.grad = g
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for m, mode in self.training:
            m.training = mode
        remove_policy(model)
        if self.policy:
            apply_policy(model, self.policy)
        self.reset_rng()
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)


# -- the passes ------------------------------------------------------------------------------------------------

@dataclass
class _ModuleRecord:
    """What one module did in the reference pass and under each precision."""

    name: str
    leaf: bool
    act: Log2Hist = field(default_factory=Log2Hist)
    grad: Log2Hist = field(default_factory=Log2Hist)
    samples: list[torch.Tensor] = field(default_factory=list)
    dtype: dict[str, str] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)
    local_error: dict[str, float] = field(default_factory=dict)
    output_error: dict[str, float] = field(default_factory=dict)


class _Hooks:
    """Forward hooks on every module for one pass; removed on exit."""

    def __init__(self, model: nn.Module, records: dict[str, _ModuleRecord], order: list[str], precision: str,
                 dev: torch.device, grads: bool = False) -> None:
        self.model, self.records, self.order, self.precision, self.dev = model, records, order, precision, dev
        self.grads = grads
        self.calls: dict[str, int] = {}
        self.counter = _Counter()  # histograms are filled in batches, at the latest when the pass ends
        self.counted: dict[int, tuple] = {}  # id(output tensor) -> (weakref, its queued counts, gradient histograms)
        self.rng_before: dict[int, Any] = {}  # id(module) -> RNG state when it started (nothing stored on the model)
        self.seen: set[str] = set()
        self.busy = False  # True while a module is being rerun in fp32: its own hooks must stay quiet
        self.handles: list = []

    def __enter__(self) -> _Hooks:
        for name, module in self.model.named_modules():
            if name not in self.records:
                self.records[name] = _ModuleRecord(name, _is_leaf(module))
            if self.precision != "fp32" and self._reruns(module):
                self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.counter.flush()

    def _count_grad(self, hists: list[Log2Hist], grad: torch.Tensor) -> None:
        """A tensor hook: histogram one output gradient once, into every module record that output belongs to."""
        self.counter.add(grad, hists, COUNT_CAP)

    def _reruns(self, module: nn.Module) -> bool:
        """Leaf modules whose own error is measured; not dropout (random by design) nor in-place ones."""
        return (_is_leaf(module) and not isinstance(module, nn.modules.dropout._DropoutNd)
                and not getattr(module, "inplace", False))

    def _rng_state(self):
        """The RNG state of the examined device (to rerun a module with the same random draws)."""
        return torch.cuda.get_rng_state(self.dev) if self.dev.type == "cuda" else torch.get_rng_state()

    def _set_rng_state(self, state) -> None:
        """Set the examined device's RNG state."""
        if self.dev.type == "cuda":
            torch.cuda.set_rng_state(state, self.dev)
        else:
            torch.set_rng_state(state)

    def _pre(self, module, args):
        """Remember the RNG state before a leaf runs, so the fp32 rerun draws the same numbers."""
        if not self.busy:
            self.rng_before[id(module)] = self._rng_state()

    def _hook(self, name: str):
        """The forward hook for one module."""
        def hook(module, args, kwargs, out):
            if self.busy:
                return None
            rec = self.records[name]
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            tensors = list(_float_tensors(out))
            if self.precision == "fp32":
                self._reference(name, rec, tensors)
            elif tensors:
                self._under_autocast(module, rec, call, tensors, args, kwargs)
            return None
        return hook

    def _reference(self, name: str, rec: _ModuleRecord, tensors: list[torch.Tensor]) -> None:
        """fp32 pass: histogram of the outputs, a sample of them, and hooks that histogram their gradients."""
        if name not in self.seen:
            self.seen.add(name)
            self.order.append(name)
        for t in tensors:
            # A container often returns its last child's output tensor: count it (and its gradient) once.
            seen = self.counted.get(id(t))
            if seen is None or seen[0]() is not t:
                seen = (weakref.ref(t), self.counter.add(t, [], COUNT_CAP), [])
                self.counted[id(t)] = seen
                if self.grads and t.requires_grad:
                    t.register_hook(functools.partial(self._count_grad, seen[2]))
            seen[1].feed(rec.act)
            seen[2].append(rec.grad)
        if tensors:
            rec.samples.append(_sample(tensors[0]))

    def _under_autocast(self, module, rec: _ModuleRecord, call: int, tensors, args, kwargs) -> None:
        """Autocast pass: output dtype, inf/NaN, error of the final output, and the leaf's own error."""
        p = self.precision
        rec.dtype[p] = str(tensors[0].dtype).removeprefix("torch.")
        bad = sum(_count_nonfinite(t) for t in tensors)
        rec.nonfinite[p] = rec.nonfinite.get(p, 0) + bad
        if call < len(rec.samples):
            err = _rel_error(_sample(tensors[0]), rec.samples[call])
            rec.output_error[p] = max(rec.output_error.get(p, 0.0), err)
        before = self.rng_before.pop(id(module), None)
        if before is None or "_ampcourse_forward" in module.__dict__:
            return  # not a rerun module, or a policy already decides its precision
        if type(module) in _EXACT:
            rec.local_error[p] = max(rec.local_error.get(p, 0.0), 0.0 if bad == 0 else math.inf)
            return
        after = self._rng_state()
        self._set_rng_state(before)
        # Without autocast, in the dtype of the module's own parameters (fp32 normally; bf16 for a pure-bf16 model).
        dtype = next((q.dtype for q in module.parameters(recurse=False) if q.is_floating_point()), torch.float32)
        self.busy = True
        try:
            with torch.autocast(self.dev.type, enabled=False):
                ref = module(*_copy_as(args, dtype), **_copy_as(kwargs, dtype))
        except Exception:  # a module that cannot run outside autocast on these inputs: no local error for it
            return
        finally:
            self.busy = False
            self._set_rng_state(after)
        ref_t = list(_float_tensors(ref))
        if ref_t:
            err = _rel_error(tensors[0], ref_t[0]) if bad == 0 else math.inf
            rec.local_error[p] = max(rec.local_error.get(p, 0.0), err)


def _copy_as(obj, dtype: torch.dtype):
    """Fresh copies in dtype of the floating tensors in obj (a rerun must not write into the real activations)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(dtype, copy=True) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_as(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _copy_as(v, dtype) for k, v in obj.items()}
    return obj


@dataclass
class _Context:
    """What every pass needs: the model, its inputs and loss, the device and the snapshot."""

    model: nn.Module
    inputs: Any
    targets: Any
    loss_fn: Callable | None
    dev: torch.device
    snapshot: _Snapshot
    records: dict[str, _ModuleRecord] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    param_grads: dict[str, Log2Hist] = field(default_factory=dict)
    ref_loss: float = math.nan  # the fp32 loss, once the reference pass has run

    def forward_loss(self) -> torch.Tensor:
        """One forward pass and the loss, with the model's own errors turned into a ValueError about the data."""
        targets = self.targets if isinstance(self.targets, torch.Tensor) else None
        with data_errors(self.model, _first_tensor(self.inputs), targets):
            return _loss(_call(self.model, self.inputs), self.targets, self.loss_fn)


def _reference_pass(ctx: _Context) -> tuple[float, dict[int, torch.Tensor]]:
    """fp32 forward + backward: activation and gradient histograms; returns the loss and the fresh gradients."""
    ctx.snapshot.reset_rng()
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None  # the caller's gradients are in the snapshot; accumulate nothing into them
    with _Hooks(ctx.model, ctx.records, ctx.order, "fp32", ctx.dev, grads=True), torch.autocast(ctx.dev.type, enabled=False):
        loss = ctx.forward_loss()
        if loss.requires_grad:
            loss.backward()
    names = {id(p): n for n, p in ctx.model.named_parameters()}
    fresh = {}
    counter = _Counter()
    for p in params:
        if p.grad is not None:
            counter.add(p.grad, [ctx.param_grads.setdefault(names[id(p)], Log2Hist())], COUNT_CAP)
            fresh[id(p)] = p.grad
    counter.flush()
    return float(loss.detach()), fresh


def _autocast_pass(ctx: _Context, amp: AmpSetup, islands: Sequence[str] = ()) -> tuple[float, dict[str, _ModuleRecord]]:
    """One forward pass under autocast (with fp32 islands if given); returns the loss and per-module records."""
    ctx.snapshot.reset_rng()
    records = {n: _ModuleRecord(n, r.leaf, samples=r.samples) for n, r in ctx.records.items()}
    remove_policy(ctx.model)
    rules = {**ctx.snapshot.policy, **{n: "fp32" for n in islands}}
    if rules:
        apply_policy(ctx.model, rules)
    try:
        with _Hooks(ctx.model, records, [], amp.precision, ctx.dev), torch.no_grad(), amp.autocast():
            loss = ctx.forward_loss()
    finally:
        remove_policy(ctx.model)
    return float(loss.float()), records


# -- turning measurements into findings ------------------------------------------------------------------------

def _first_nonfinite(order: Sequence[str], records: Mapping[str, _ModuleRecord], p: str,
                     ref: Mapping[str, _ModuleRecord]) -> str | None:
    """The first module (in the order modules finish) whose output had inf/NaN under precision p but not in fp32."""
    return next((n for n in order if records[n].nonfinite.get(p, 0) > 0 and not ref[n].act.nonfinite), None)


def _lossy_leaves(order: Sequence[str], records: Mapping[str, _ModuleRecord], p: str) -> list[str]:
    """Leaf modules whose own relative error under precision p exceeds REL_TOL[p] (not counting inf/NaN ones)."""
    return [n for n in order if records[n].leaf and records[n].nonfinite.get(p, 0) == 0
            and records[n].local_error.get(p, 0.0) > REL_TOL[p]]


def _overflowing(order: Sequence[str], ref: Mapping[str, _ModuleRecord], p: str) -> list[str]:
    """Modules whose fp32 outputs exceed precision p's largest value, in the order they finish."""
    top = formats.spec(p).max
    return [n for n in order if ref[n].act.max > top]


def _precision_findings(ctx: _Context, p: str, records: Mapping[str, _ModuleRecord], loss: float,
                        islands: Sequence[str], status: str) -> list[Finding]:
    """Findings from one autocast pass: overflow, inf/NaN, per-module precision loss."""
    out = []
    over = _overflowing(ctx.order, ctx.records, p)
    if over:
        n = over[0]
        r = ctx.records[n]
        share = r.act._share("overflow", 1.0, p)
        more = f" ({len(over) - 1} module(s) after it too)" if len(over) > 1 else ""
        # Clean without an island here: the big values stayed fp32 on this device; an fp16 op reading them overflows.
        stayed = status != "refused" and n not in islands
        out.append(Finding("activation_overflow", n, p, r.act.max,
                           f"{n or 'the model'} outputs values up to {r.act.max:.4g} in fp32 ({share:.2%} of them above "
                           f"{p}'s max {formats.spec(p).max:g}){more}"
                           + (f"; they stayed finite here (output {records[n].dtype.get(p, '?')}), but any {p} op that "
                              "reads them overflows" if stayed else "")
                           + ": keep it and what reads it in fp32, or use bf16", "warning" if stayed else "error"))
    first = _first_nonfinite(ctx.order, records, p, ctx.records)
    if first is not None:
        r = records[first]
        out.append(Finding("nonfinite", first, p, float(r.nonfinite[p]),
                           f"{first or 'the model'} is the first module whose output has inf/NaN under {p} autocast "
                           f"({r.nonfinite[p]} values; finite in fp32): run it in fp32 or use bf16", "error"))
    elif not math.isfinite(loss) and math.isfinite(ctx.ref_loss):
        out.append(Finding("nonfinite", "", p, loss, f"the loss is {loss} under {p} autocast although every module output "
                           "is finite: compute the loss in fp32 (outside autocast, on .float() outputs)", "error"))
    for n in _lossy_leaves(ctx.order, records, p):
        err = records[n].local_error[p]
        sqnr = -20 * math.log10(err) if 0 < err < math.inf else math.inf
        sev = "error" if err > 0.5 else "warning"
        out.append(Finding("precision_loss", n, p, err,
                           f"{n}'s own output under {p} autocast differs from fp32 on the same inputs by {err:.3g} "
                           f"(relative, SQNR {sqnr + 0.0:.1f} dB; tolerance {REL_TOL[p]:.3g}): run it in fp32", sev))
    return out


def _islands_for(ctx: _Context, amp: AmpSetup, records: Mapping[str, _ModuleRecord],
                 loss: float) -> tuple[str, list[str], float]:
    """('clean' | 'islands' | 'refused', fp32 modules, loss): grow fp32 islands until a pass comes back clean."""
    p = amp.precision
    low = str(amp.amp_dtype).removeprefix("torch.")
    # Islands over half of the leaves autocast runs low are fp32 training in disguise: refuse instead.
    limit = min(MAX_ISLANDS, sum(r.leaf and r.dtype.get(p) == low for r in records.values()) // 2)
    loss_ok = lambda v: math.isfinite(v) or not math.isfinite(ctx.ref_loss)  # noqa: E731 (fp32 itself may be NaN)
    islands: list[str] = []
    for _ in range(MAX_ISLANDS + 1):
        bad = _first_nonfinite(ctx.order, records, p, ctx.records)
        new = ([bad] if bad is not None else []) + [n for n in _lossy_leaves(ctx.order, records, p) if n not in islands]
        new = [n for n in dict.fromkeys(new) if n not in islands]
        if not new and loss_ok(loss):
            return ("islands" if islands else "clean"), islands, loss
        if not new or "" in new or len(islands) + len(new) > max(limit, 1):
            return "refused", islands + new, loss
        islands += new
        loss, records = _autocast_pass(ctx, amp, islands)
    return "refused", islands, loss


def _gradient_findings(ctx: _Context, examined: Sequence[str]) -> tuple[list[Finding], dict[str, Any], float]:
    """Loss-scale advice from the fp32 gradients: findings, the numbers behind them, the recommended init_scale."""
    total = Log2Hist.merged([*ctx.param_grads.values(), *(ctx.records[n].grad for n in ctx.order if ctx.records[n].leaf)])
    gmax, nonzero = total.max, total.nonzero
    info: dict[str, Any] = {"max": gmax, "nonzero": nonzero, "nonfinite": total.nonfinite, "margin": GRAD_MARGIN}
    if nonzero == 0:
        return [], info, DEFAULT_SCALE
    fmax = formats.spec("fp16").max
    over = zone_thresholds("fp16")[2]
    scale = 2.0 ** math.floor(math.log2(fmax / (gmax * GRAD_MARGIN)))
    backoffs, s = 0, DEFAULT_SCALE
    while gmax * s >= over:  # what GradScaler(init_scale=2**16) does: skip the step, halve, try again
        s, backoffs = s / 2, backoffs + 1
    flush1, flush_rec = total._share("underflow", 1.0), total._share("underflow", scale)
    flush_default = total._share("underflow", s)  # where the default scaler settles after its backoffs
    info.update(flush_at_1=flush1, recommended_scale=scale, flush_at_recommended=flush_rec,
                flush_at_default=flush_default, default_backoff_steps=backoffs,
                largest_scale_without_overflow=2.0 ** math.floor(math.log2(fmax / gmax)),
                bf16_flush_at_1=total._share("underflow", 1.0, "bf16"),
                params={n: {"max": h.max, "flush_at_1": h._share("underflow", 1.0),
                            "flush_at_recommended": h._share("underflow", scale)} for n, h in ctx.param_grads.items()})
    worst = max(ctx.param_grads.items(), key=lambda kv: kv[1]._share("underflow"), default=None)
    worst_txt = f" (worst parameter: {worst[0]}, {worst[1]._share('underflow'):.0%})" if worst else ""
    k = int(math.log2(scale))
    out = []
    if total.nonfinite or gmax * 1.0 >= over:
        out.append(Finding("gradient_overflow", "", "fp16", gmax,
                           f"gradients reach {gmax:.4g} in fp32 ({total.nonfinite} inf/NaN), beyond fp16's max {fmax:g} "
                           f"at scale 1: fp16 needs a scale below 1 (init_scale=2**{k}) or use bf16", "warning"))
    default_txt = (f"GradScaler's default 2**16 overflows first and needs {backoffs} backoff step(s) (skipped steps) "
                   f"to get below fp16's max" if backoffs else
                   f"GradScaler's default 2**16 does not overflow and leaves {flush_default:.2%} flushed")
    if "fp16" in examined:
        if flush1 > UNDERFLOW_WARN:
            # A warning when fp16 cannot train without loss scaling (most gradients lost) or when the default
            # GradScaler still loses gradients; otherwise a note: the usual GradScaler handles it.
            sev = "warning" if flush1 > 0.5 or flush_default > UNDERFLOW_WARN else "info"
            out.append(Finding("gradient_underflow", "", "fp16", flush1,
                               f"{flush1:.1%} of the nonzero gradients flush to zero in fp16 at scale 1{worst_txt}; "
                               f"GradScaler's default leaves {flush_default:.2%}; at init_scale=2**{k} (max|grad| "
                               f"{gmax:.3g} x scale stays {GRAD_MARGIN:g}x below {fmax:g}) {flush_rec:.2%} do: use "
                               f"torch.amp.GradScaler(device, init_scale=2**{k})", sev))
        if flush_rec > UNDERFLOW_WARN:
            out.append(Finding("gradient_underflow", "", "fp16", flush_rec,
                               f"even at init_scale=2**{k} {flush_rec:.2%} of the nonzero gradients flush to zero: "
                               "the gradients span more binades than fp16 holds; use bf16", "warning"))
        kind = "scaler_needed" if flush1 > 0 or gmax >= over else "no_scaler_needed"
        msg = (f"{flush1:.3%} of the nonzero gradients flush to zero in fp16 at scale 1"
               + (f" and the largest, {gmax:.3g}, overflows it" if gmax >= over else "")
               + ("; use a GradScaler" if kind == "scaler_needed" else "; none flush now, but gradients shrink as "
                  "training converges, so a GradScaler is still the safe default")
               + f": {default_txt}; init_scale=2**{k} leaves {flush_rec:.3%} flushed")
        out.append(Finding(kind, "", "fp16", flush1, msg, "info"))
    if "bf16" in examined:
        bflush = info["bf16_flush_at_1"]
        out.append(Finding("no_scaler_needed" if bflush == 0 else "scaler_needed", "", "bf16", bflush,
                           f"{bflush:.3%} of the nonzero gradients flush to zero in bf16 at scale 1 (bf16 has fp32's "
                           "exponent range)" + ("" if bflush else ": no GradScaler needed"), "info"))
    return out, info, scale


def _optimizer_findings(ctx: _Context, optimizer: torch.optim.Optimizer | None,
                        fresh: Mapping[int, torch.Tensor]) -> tuple[list[Finding], dict[str, Any] | None]:
    """Dtypes of parameters, gradients and state; updates lost to rounding; Adam's eps in the state's dtype."""
    if optimizer is None:
        return [], None
    names = {id(p): n for n, p in ctx.model.named_parameters()}
    dt = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state_dtypes = sorted({dt(v) for p in params for v in optimizer.state.get(p, {}).values()
                           if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0})
    audit = {"class": type(optimizer).__name__,
             "param_dtypes": _tally(dt(p) for p in params),
             "grad_dtypes": _tally(dt(fresh[id(p)]) for p in params if id(p) in fresh),
             "state_dtypes": state_dtypes or sorted({dt(p) for p in params}),
             "fp32_master_weights": all(p.dtype == torch.float32 for p in params)}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if isinstance(eps, (int, float)) and eps > 0:
            for fmt in ("fp16", "bf16"):
                dtype = formats.spec(fmt).torch_dtype
                in_state = [p for p in group["params"] if _state_dtype(optimizer, p) == dtype]
                if in_state and range_counts([eps], 1.0, fmt)["underflow"]:
                    n = names.get(id(in_state[0]), f"param_groups[{gi}]")
                    out.append(Finding("eps_underflow", n, fmt, float(eps),
                                       f"eps={eps:g} rounds to 0 in the {fmt} optimizer state of {len(in_state)} "
                                       f"parameter(s) ({fmt}'s smallest subnormal is "
                                       f"{formats.spec(fmt).min_subnormal:.3g}): "
                                       f"a second moment that underflows divides by zero; keep the state in fp32 "
                                       f"(fp32 parameters + autocast) or raise eps", "warning"))
    lost = _lost_updates(optimizer, fresh)
    if lost is not None:
        share, worst, worst_share, n_params, fmt = lost
        audit["lost_update_share"] = share
        if share > LOST_WARN:
            lrs = sorted({g.get("lr") for g in optimizer.param_groups if "lr" in g})
            out.append(Finding("lost_updates", names.get(worst, ""), fmt, share,
                               f"{share:.1%} of one step's update elements round to no change in {n_params} {fmt} "
                               f"parameter(s) at lr={lrs[0] if len(lrs) == 1 else lrs} (worst "
                               f"{names.get(worst, '?')}: {worst_share:.0%}); the update is below half an ulp: keep "
                               "fp32 master weights (fp32 parameters + autocast) instead of pure low-precision training",
                               "warning"))
    return out, audit


def _tally(items) -> dict[str, int]:
    """{item: count}."""
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _state_dtype(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype of p's optimizer state (its tensors' dtype, else p's own: Adam creates state like the parameter)."""
    for v in optimizer.state.get(p, {}).values():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
            return v.dtype
    return p.dtype


def _lost_updates(optimizer: torch.optim.Optimizer,
                  fresh: Mapping[int, torch.Tensor]) -> tuple[float, int, float, int, str] | None:
    """One step of a fresh copy of the optimizer on copies of the fp16/bf16 parameters: the share that did not move."""
    groups, pairs = [], []
    for g in optimizer.param_groups:
        low = [p for p in g["params"] if p.dtype in (torch.float16, torch.bfloat16) and id(p) in fresh]
        if not low:
            continue
        copies = []
        for p in low:
            c = p.detach().clone().requires_grad_(True)
            c.grad = fresh[id(p)].detach().clone()
            copies.append(c)
            pairs.append((id(p), c, c.detach().clone()))
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": copies})
    if not groups:
        return None
    try:
        type(optimizer)(groups).step()
    except Exception:  # an optimizer we cannot rebuild from its param_groups: no audit rather than a crash
        return None
    moved_total = lost_total = 0
    worst, worst_share = pairs[0][0], -1.0
    for pid, c, before in pairs:
        live = c.grad != 0
        n = int(live.sum())
        lost = int(((c.detach() == before) & live).sum())
        moved_total, lost_total = moved_total + n, lost_total + lost
        if n and lost / n > worst_share:
            worst, worst_share = pid, lost / n
    fmt = "bf16" if any(c.dtype == torch.bfloat16 for _, c, _ in pairs) else "fp16"
    return (lost_total / moved_total if moved_total else 0.0), worst, max(worst_share, 0.0), len(pairs), fmt


def _choose(verdicts: Mapping[str, dict[str, Any]], dev: torch.device) -> str:
    """The precision to recommend: clean beats islands beats refused; then native units; then the device default."""
    rank = {"clean": 0, "islands": 1, "refused": 2, "unsupported": 3}
    default = pick(dev).precision if dev.type in ("cpu", "cuda", "mps") else "bf16"

    def key(p: str) -> tuple:
        v = verdicts[p]
        return rank[v["status"]], not v.get("native", False), p != default, p
    return min(verdicts, key=key)


# -- examine -----------------------------------------------------------------------------------------------------

def examine(model: nn.Module, inputs, targets=None, loss_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, device: str | torch.device | None = None,
            precisions: Sequence[str] = ("fp16", "bf16")) -> Report:
    """Measure the model in fp32 and under autocast in each precision, and advise; leaves every state as it was."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_inputs(inputs)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (e.g. nn.functional.cross_entropy) or None, got {type(loss_fn).__name__}")
    if loss_fn is None and targets is not None:
        raise ValueError("targets were given but loss_fn is None: pass loss_fn=, or put the labels in inputs "
                         "for a model that returns its own loss")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    precs = _check_precisions(precisions)
    dev = _resolve_device(model, device)
    inputs, targets = _to_device(inputs, dev), _to_device(targets, dev)
    snapshot = _Snapshot.take(model, optimizer)
    ctx = _Context(model, inputs, targets, loss_fn, dev, snapshot)
    findings: list[Finding] = []
    verdicts: dict[str, dict[str, Any]] = {}
    try:
        ref_loss, fresh = _reference_pass(ctx)
        ctx.ref_loss = ref_loss
        if not math.isfinite(ref_loss) or any(ctx.records[n].act.nonfinite for n in ctx.order):
            bad = next((n for n in ctx.order if ctx.records[n].act.nonfinite), "")
            findings.append(Finding("nonfinite", bad, "fp32", ref_loss,
                                    f"{bad or 'the loss'} is already inf/NaN in fp32 (loss {ref_loss}): fix the model "
                                    "or its data before looking at mixed precision", "error"))
        opt_findings, audit = _optimizer_findings(ctx, optimizer, fresh)
        for p in list(fresh):
            fresh[p] = None  # drop our gradients before the next passes
        for p, g in snapshot.grads.values():
            p.grad = g
        for p in precs:
            try:
                amp = pick(dev, p)
            except ValueError as err:
                verdicts[p] = {"status": "unsupported", "reason": str(err), "fp32_modules": []}
                continue
            loss, records = _autocast_pass(ctx, amp)
            for n, r in records.items():
                for attr in ("dtype", "nonfinite", "local_error", "output_error"):
                    getattr(ctx.records[n], attr)[p] = getattr(r, attr).get(p, 0 if attr == "nonfinite" else None)
            status, islands, fixed_loss = _islands_for(ctx, amp, records, loss)
            findings += _precision_findings(ctx, p, records, loss, islands, status)
            out_err = ctx.records[""].output_error.get(p) if "" in ctx.records else None
            verdicts[p] = {"status": status, "fp32_modules": islands if status != "refused" else [], "loss": loss,
                           "loss_with_islands": fixed_loss, "tried_fp32_modules": islands, "native": amp.native,
                           "units": amp.units, "output_error": out_err}
    finally:
        snapshot.restore(model)
    grad_findings, grad_info, scale = _gradient_findings(ctx, precs)
    findings += grad_findings + opt_findings
    findings.sort(key=_sort_key)
    supported = {p: v for p, v in verdicts.items() if v["status"] != "unsupported"} or verdicts
    rec = _choose(supported, dev) if supported else precs[0]
    verdicts.setdefault(rec, {"status": "unsupported", "fp32_modules": []})
    report = Report(findings, rec, scale, list(verdicts[rec]["fp32_modules"]), str(dev), verdicts, grad_info, audit,
                    _module_table(ctx, scale), notes=_notes(dev))
    report.advice = _advice(report, ref_loss)
    return report


def _module_table(ctx: _Context, scale: float) -> list[dict[str, Any]]:
    """Per module, in the order they finish: ranges of outputs and output gradients (flushed at 1 and at scale), dtypes,
    errors."""
    rows = []
    for n in ctx.order:
        r = ctx.records[n]
        rows.append({"name": n, "leaf": r.leaf, "act_min": r.act.min, "act_max": r.act.max,
                     "act_fp16_overflow": r.act._share("overflow", 1.0, "fp16"),
                     "act_fp16_subnormal": r.act._share("subnormal", 1.0, "fp16"),
                     "act_fp16_underflow": r.act._share("underflow", 1.0, "fp16"),
                     "grad_min": r.grad.min, "grad_max": r.grad.max,
                     "grad_fp16_underflow": r.grad._share("underflow", 1.0, "fp16"),
                     "grad_fp16_underflow_at_recommended": r.grad._share("underflow", scale, "fp16"),
                     "dtype": dict(r.dtype), "local_error": {k: v for k, v in r.local_error.items() if v is not None},
                     "output_error": {k: v for k, v in r.output_error.items() if v is not None}})
    return rows


def _notes(dev: torch.device) -> list[str]:
    """What the learner should know about where the measurement ran."""
    if dev.type == "cpu":
        return ["Measured with CPU autocast, whose op lists differ from CUDA's (on CPU, layer_norm and softmax of a "
                "low-precision input stay low; CUDA runs them in fp32): run the doctor on the GPU you train on too."]
    return [f"Measured with {dev.type} autocast."]


def _advice(r: Report, ref_loss: float) -> list[str]:
    """One line per recommendation, each citing the measurement behind it."""
    out = []
    v = r.verdicts.get(r.recommended_precision, {})
    others = {p: w["status"] for p, w in r.verdicts.items() if p != r.recommended_precision}
    if not math.isfinite(ref_loss):
        out.append(f"The fp32 run itself gives a loss of {ref_loss}: fix the model or its data first; nothing below "
                   "can be trusted until fp32 is finite.")
    status = v.get("status", "unsupported")
    loss_txt = f"loss {v.get('loss_with_islands', float('nan')):.4g} vs {ref_loss:.4g} in fp32"
    if status in ("refused", "unsupported"):
        out.append(f"No precision examined here ran clean ({dict(others, **{r.recommended_precision: status})}): "
                   f"train in fp32 until the errors above are fixed; the closest is {r.recommended_precision} "
                   f"({loss_txt}).")
    else:
        why = ("no inf/NaN, no overflow and no module beyond the error tolerance" if status == "clean"
               else f"clean once {r.fp32_modules} run in fp32")
        out.append(f"Use {r.recommended_precision} autocast: {why} ({loss_txt})"
                   + (f"; other precisions: {others}" if others else "") + ".")
    if r.fp32_modules:
        rules = ", ".join(f"{n!r}: 'fp32'" for n in r.fp32_modules)
        out.append(f"Keep {r.fp32_modules} in fp32: apply_policy(model, {{{rules}}}) "
                   "(from ampcourse.policy import apply_policy).")
    g = r.gradients
    if "recommended_scale" in g and r.recommended_precision == "fp16":
        k = int(math.log2(g["recommended_scale"]))
        out.append(f"GradScaler: torch.amp.GradScaler({r.device.split(':')[0]!r}, init_scale=2**{k}): max|grad| "
                   f"{g['max']:.3g} x 2**{k} stays {GRAD_MARGIN:g}x below 65504, leaving {g['flush_at_recommended']:.2%} "
                   f"of the gradients flushed (vs {g['flush_at_1']:.2%} at scale 1).")
    elif r.recommended_precision == "bf16":
        out.append("No GradScaler: bf16 has fp32's exponent range"
                   + (f" ({g['bf16_flush_at_1']:.3%} of the gradients flush at scale 1)." if "bf16_flush_at_1" in g
                      else "."))
    for f in r.findings:
        if f.kind in ("lost_updates", "eps_underflow"):
            out.append(f"Optimizer ({f.kind}): {f.message}.")
    return out


# -- command line ---------------------------------------------------------------------------------------------------

class CliError(Exception):
    """A problem with the command line's input, reported as one line."""


def _reference_setup(name: str, batch: int, seed: int):
    """(model, inputs, targets, loss_fn, optimizer) for a reference model of ampcourse.models."""
    from .models import make_task
    task = make_task(name, n=batch, seed=seed)
    x, y = task.data.tensors
    return task.model, x, y, task.loss_fn, torch.optim.AdamW(task.model.parameters(), lr=1e-3)


def _factory_setup(spec: str):
    """Import 'pkg.mod:factory', call it, and check it returned (model, inputs, targets, loss_fn[, optimizer])."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise CliError(f"--model {spec!r}: use a reference model name or 'package.module:factory'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise CliError(f"--model {spec!r}: cannot import {mod_name!r} ({err})") from err
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise CliError(f"--model {spec!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise CliError(f"--model {spec!r}: {attr!r} is not callable")
    try:
        out = factory()
    except Exception as err:  # the learner's code: one line that says where it failed, not a traceback
        raise CliError(f"--model {spec!r}: the factory raised {type(err).__name__}: {err}") from err
    if not isinstance(out, (tuple, list)) or len(out) not in (4, 5):
        got = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else type(out).__name__
        raise CliError(f"--model {spec!r}: the factory must return (model, inputs, targets, loss_fn) "
                       f"or (model, inputs, targets, loss_fn, optimizer), got {got}")
    return (*out, None) if len(out) == 4 else tuple(out)


def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.doctor."""
    from .models import MODELS
    ap = _args.OneLineParser(prog="python -m ampcourse.doctor", description=__doc__.split("\n\n")[0],
                             error_prefix="ampcourse.doctor", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help=f"a reference model ({', '.join(MODELS)}) or 'package.module:factory', a callable returning "
                         "(model, inputs, targets, loss_fn) or (..., optimizer)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    ap.add_argument("--precisions", default="fp16,bf16", help="comma-separated, from fp16 and bf16 (default: both)")
    ap.add_argument("--batch", type=int, default=16, help="batch size for a reference model (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed for a reference model (default 0)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--html", default=None, help="write the report as an HTML page here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor from the command line; 0 on success, 2 with one line on stderr for bad input."""
    from .models import MODELS
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a bad flag (2) whose one line is already on stderr
        return done.code if isinstance(done.code, int) else 2
    try:
        for flag, path in (("--out", args.out), ("--html", args.html)):  # before the work, not after it
            if path is not None:
                _args.writable_file(path, flag)
        if args.model in MODELS:
            if args.batch < 1:
                raise CliError(f"--batch must be >= 1, got {args.batch}")
            _args.seed(args.seed, "--seed")
            try:
                model, inputs, targets, loss_fn, opt = _reference_setup(args.model, args.batch, args.seed)
            except ValueError as err:  # too large a batch for the synthetic data: name the flag
                raise CliError(f"--batch {args.batch}: {err}") from None
        else:
            model, inputs, targets, loss_fn, opt = _factory_setup(args.model)
        if not isinstance(model, nn.Module):
            raise CliError(f"--model {args.model!r}: the first item must be an nn.Module, got {type(model).__name__}")
        dev = pick(args.device, "fp32").device
        model.to(dev)  # the command line owns this model: moving it is fine (examine itself never moves one)
        precisions = [p for p in args.precisions.split(",") if p.strip()]
        report = examine(model, inputs, targets, loss_fn=loss_fn, optimizer=opt, device=dev, precisions=precisions)
        print(report.summary())
        if args.out:
            report.to_json(args.out)
        if args.html:
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(f"<!doctype html><html><head><meta charset='utf-8'><title>AMP doctor</title></head>"
                         f"<body>{report._repr_html_()}</body></html>\n")
    except (CliError, ValueError, TypeError, OSError) as err:
        print(f"ampcourse.doctor: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 (the learner's model can raise anything: one line, not a traceback)
        first = (str(err).splitlines() or [""])[0]
        print(f"ampcourse.doctor: error: examining {args.model!r} failed with {type(err).__name__}: {first} "
              "(call ampcourse.doctor.examine in Python to see the traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
