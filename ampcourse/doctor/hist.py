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
        self._min: float | None = None  # min, since the last add
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

    #: _fast_index's layout: value i of a flush lands at 14 * e + 150 - Q (e its exponent field, 0..255), so a table
    #: row of 14 bins per exponent, Q reversed, starting at bin _I0; each queued entry gets its own _K bins.
    _I0 = 137
    _K = 256 * (QMAX + 1)

    @classmethod
    def _fast_index(cls, bits: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        """The bin of each |x| (float32 bits as int32, sign cleared) in 7 cheap in-place ops written into the rows r1
        and r2 (no compares, no where, no allocation); returns r2: 14 * e + 150 - Q, e the exponent field.

        Q = 1 + leading ones of the fraction (capped at QMAX), 0 for a power of two, read off the float32 exponent of
        c = fraction ^ 0x7FFFFF, whose bit length is 23 - leading ones: Q = 150 - (bits(float(c + 0.75)) >> 23),
        capped. The 0.75 is exact for every c below 2**22 and rounds (to even) into c + 1 above, which moves the
        exponent only for c = 2**23 - 1: a power of two (fraction 0) gets Q 0 with no test of its own.
        Zeros and fp32 subnormals (exponent field 0) land at e 0: zeros at Q 0, subnormals at Q >= 1, which
        _Counter.flush() checks on the host (an fp32 subnormal is rare: it then recounts with _bin_index).
        """
        torch.bitwise_and(bits, 0x7FFFFF, out=r1).bitwise_xor_(0x7FFFFF)  # c: the fraction's complement
        torch.add(r1, 0.75, out=r2.view(torch.float32))  # float32 arithmetic: c exact (< 2**24), then one rounding
        r2.bitwise_right_shift_(23).clamp_(min=150 - cls.QMAX)  # 150 - Q
        return r2.add_(torch.bitwise_right_shift(bits, 23, out=r1), alpha=cls.QMAX + 1)

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
        self._frozen, self._cum, self._counts, self._min = None, None, {}, None

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
        if self._min is None:  # kept until the next add (the module table asks for it per module)
            nz = np.flatnonzero(self._values()[0].sum(1))
            self._min = math.ldexp(1.0, int(nz[0]) + self.LO) if nz.size else 0.0
        return self._min

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
    """Histogram counting, batched: each queued tensor's |x| float32 bits (or COUNT_CAP of them) go into one reusable
    buffer as it is queued (its sign cleared in the same pass as the copy) with one int32 max; flush() bins the buffer
    in a few in-place integer ops and one bincount, read back once with the queued maxima (on CUDA: two host syncs per
    flush, not one per tensor). A tensor's max and its inf/NaN count come from those bits (every value is there) or,
    for a capped tensor, from the tensor itself.

    Per-tensor small ops, host reads (a sync on CUDA) and fresh allocations (page faults on a CPU), not the counting
    itself, dominated the doctor's time on small models (benchmarks/README.md, "AMP doctor cost"). At most LIMIT
    values wait: memory stays bounded (three rows of LIMIT int32, 3 MiB; fewer, longer flushes measured faster in
    the doctor's passes than L2-sized ones, whose fixed cost per flush then dominates).
    """

    LIMIT = 2**18
    _NONFINITE = 0x7F800000  # |x| bits at or above it: inf or NaN

    def __init__(self) -> None:
        self._work: torch.Tensor | None = None  # 3 x size int32: the |x| bits, then two scratch rows for flush()
        self._reset()

    def _reset(self) -> None:
        """Nothing queued."""
        self.spans: list[tuple[int, int]] = []  # (offset, length) of each entry's values in the buffer
        self.steps: list[int] = []  # each binned value stands for this many
        self.numels: list[int] = []
        #: max |finite x| (a float, or a 0-dim tensor not read yet); for an uncapped entry, the max of its bits (a
        #: 0-dim int32 tensor), finished at the flush
        self.tops: list[float | torch.Tensor] = []
        self.nonfinite: list[int | torch.Tensor | None] = []  # None: read off the entry's bins (every value counted)
        self.entries: list[_Entry] = []
        self.pending = 0

    def _buffer(self, size: int, dev: torch.device) -> torch.Tensor:
        """The work buffer, at least size values per row, on dev (kept between flushes: no fresh pages each time)."""
        if self._work is None or self._work.shape[1] < size or self._work.device != dev:
            self._work = torch.empty(3, max(size, self.LIMIT), dtype=torch.int32, device=dev)
        return self._work

    def add(self, t: torch.Tensor, targets: list[Log2Hist], cap: int | None = None) -> _Entry | None:
        """Queue a floating-point tensor (None for anything else) for the histograms in targets."""
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return None
        a = t.detach().reshape(-1)
        if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            a = a.float()  # float64 is counted as float32 (out-of-range values become inf); fp16/bf16 widen exactly
        n = a.numel()
        step = max(1, -(-n // cap)) if cap else 1
        m = -(-n // step)
        if self.entries and (self.pending + m > self.LIMIT or self._work.device != a.device):
            self.flush()
        # Copied now: the model may still change the tensor in place (a residual's +=) before the flush.
        row = self._buffer(self.pending + m, a.device)[0, self.pending:self.pending + m]
        part = a[::step] if step > 1 else a
        if part.dtype == torch.float32:
            torch.bitwise_and(part.view(torch.int32), 0x7FFFFFFF, out=row)
        else:
            row.view(torch.float32).copy_(part)
            row.bitwise_and_(0x7FFFFFFF)
        if n == 0:
            top, nonfinite = 0.0, 0
        elif step == 1:  # every value is in the buffer: the max of the bits, the inf/NaN count from the bins
            top, nonfinite = row.max(), None
        else:
            top = _abs_max(a)  # inf or NaN if any value is
            if a.device.type == "cpu" and math.isfinite(top := float(top)):  # all finite (a read-back is free on a CPU)
                nonfinite = 0
            else:  # an inf/NaN may be there: the largest finite value and the count need a second look
                finite = torch.isfinite(a)
                top = torch.where(finite, a.abs(), 0).max().float()
                nonfinite = n - finite.sum()
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
        nq, n, e = Log2Hist.QMAX + 1, self.pending, len(self.entries)
        w = self._work[:, :n]
        idx = Log2Hist._fast_index(w[0], w[1], w[2])
        k = Log2Hist._K
        for i, (start, length) in enumerate(self.spans[1:], 1):  # entry i counts into bins i * _K onwards
            if length:
                idx[start:start + length].add_(i * k)
        bins = torch.bincount(idx, minlength=e * k + Log2Hist._I0)
        tops, nonfinite = list(self.tops), list(self.nonfinite)
        mine = [i for i, v in enumerate(nonfinite) if v is None]  # uncapped: the max of their bits, read at once
        if mine:
            for i, m in zip(mine, torch.stack([self.tops[i] for i in mine]).cpu().tolist()):
                tops[i] = m
        lazy = [i for i, v in enumerate(self.tops) if isinstance(v, torch.Tensor) and nonfinite[i] is not None]
        if lazy:  # capped, off a CPU: the max and inf/NaN count taken when queued, read now
            read = torch.stack([torch.stack([self.tops[i].double(), torch.as_tensor(self.nonfinite[i]).double()])
                                for i in lazy]).cpu().tolist()
            for i, (m, nf) in zip(lazy, read):
                tops[i], nonfinite[i] = m, int(nf)
        # bins 14 * exponent + 150 - Q: per entry a (256 exponents x 14 Q) block, Q reversed; rows ROW0.. of the table
        got = bins[Log2Hist._I0:Log2Hist._I0 + e * k].cpu().numpy().reshape(e, 256, nq)[:, :, ::-1]
        table = np.zeros((e, Log2Hist._ROWS, nq), np.int64)
        r0 = Log2Hist._ROW0
        table[:, r0:] = got
        sub = table[:, r0, 1:].any(axis=1)  # exponent field 0 beyond Q 0: fp32 subnormals
        for i in np.flatnonzero(sub):  # count this tensor exactly
            start, length = self.spans[i]
            table[i] = torch.bincount(Log2Hist._bin_index(w[0, start:start + length]),
                                      minlength=Log2Hist._NB).cpu().numpy().reshape(Log2Hist._ROWS, nq)
        plain = ~sub if sub.any() else slice(None)
        table[plain, 0, 0] = table[plain, r0, 0]  # otherwise what landed at (exponent 0, Q 0) are the zeros: row 0
        table[plain, r0, 0] = 0
        if mine:  # uncapped: every value is counted, and tops[i] is the max of its bits
            for i, nf in zip(mine, table[mine, -1].sum(axis=1).tolist()):
                nonfinite[i], top = nf, tops[i]
                if top >= self._NONFINITE:  # the largest finite value, without the infs/NaNs
                    start, length = self.spans[i]
                    s = w[0, start:start + length]
                    top = int(torch.where(s < self._NONFINITE, s, 0).max())
                tops[i] = float(np.array(top, np.int32).view(np.float32))
        if any(st > 1 for st in self.steps):
            table *= np.asarray(self.steps, dtype=table.dtype)[:, None, None]
        for i, entry in enumerate(self.entries):
            entry.result = (table[i].reshape(-1), self.numels[i], float(tops[i]), int(nonfinite[i]))
            for h in entry.targets:
                h._add_counts(*entry.result)
        self._reset()


@functools.cache
def _thresholds(fmt: str) -> tuple[tuple[float, bool], ...]:
    """zone_thresholds(fmt), each with whether a value exactly on it rounds up (computed once per format)."""
    f = formats.spec(fmt)
    return tuple((t, bool(formats._round_unbounded(np.array([t]), f)[0] > t)) for t in zone_thresholds(fmt))

