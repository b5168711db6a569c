"""Log2 histograms of tensors: a tensor's range, never a copy of its values (the doctor's only record of a tensor).

Example::

    >>> h = Log2Hist(); h.add(torch.randn(1000))
    >>> h.counts(2.0**16, "fp16")      # equals ampcourse.scaling.range_counts(values, 2**16, "fp16")
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import _args, formats
from ..scaling import RANGE_CATEGORIES, zone_thresholds

__all__ = ["Log2Hist", "COUNT_CAP"]

#: Values histogrammed per tensor at most (evenly spaced; max and inf/NaN counts use every value): the
#: counting, not the model, dominated examine()'s time on large activations (benchmarks/README.md).
COUNT_CAP = 2**16

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

