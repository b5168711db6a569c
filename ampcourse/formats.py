"""Floating-point formats from their bit layout: fp32, fp16, bf16, fp8, and the OCP MX formats below 8 bits (chapters 1 and 9).

Everything here is computed from (exponent bits, mantissa bits, bias); nothing asks torch what a
format can hold. The tests check the results against numpy's float16 (all 65,536 bit patterns)
and against torch's own dtype casts.

Rounding is IEEE 754 round-to-nearest, ties-to-even, applied once to the exact input value.
Note: torch casts float64 to float16/bfloat16 *through float32*, which rounds twice; feed
float32 values when you compare with torch casts.

fp8_e4m3 is OCP's E4M3FN (``torch.float8_e4m3fn``): there is no infinity, the only NaN is the
all-ones pattern ``S.1111.111``, so its largest value is 448. With no infinity, a conversion past the
range has two possible results, and OCP's 8-bit spec (OFP8 v1.0) defines both: *saturating* (+-448) and
non-saturating (NaN). ``quantize`` saturates (as the OCP MX spec's element conversion does): any finite
value or infinity beyond the range becomes +-448, NaN stays NaN. torch's eager CPU cast does the same from torch
2.13 (``TORCH_E4M3_CAST_SATURATES_FROM``; ``torch_e4m3_cast_saturates(device)`` asks the running torch); before
that it gives NaN for values that round past 448. ``float8_e4m3fnuz`` casts still give NaN past 240.
fp8_e5m2 follows the IEEE rules of fp16 (overflow to inf).

The formats of the OCP Microscaling (MX) spec v1.0 (checked against ml_dtypes on every bit pattern):
- fp8_e8m0 (``torch.float8_e8m0fnu``, ml_dtypes ``float8_e8m0fnu``): the MX *scale*. Eight exponent
  bits, no sign, no mantissa, bias 127: the values are the powers of two 2**-127 .. 2**127, and the
  pattern 0xFF is NaN. No zero, no infinity, no subnormals. Rounding is to the nearest power of two
  (a tie, 1.5 * 2**k, goes up); values below 2**-127 clamp to 2**-127; values that round past 2**127,
  infinities, zero, negative numbers and NaN become NaN (ml_dtypes' convention). torch's cast agrees
  on every positive value but differs in two places: it maps 0.0 to 2**-127 and a negative x to the
  result for |x| (the sign is dropped, not turned into NaN). One more difference, from both: they
  round every x strictly between 2**-127 and 2**-126 up to 2**-126 (they work on float32 bits, and that
  binade is float32's subnormal range); here it rounds to the nearest power like every other binade.
  Only scales below 2**-126 are affected.
- fp6_e2m3, fp6_e3m2, fp4_e2m1 (ml_dtypes ``float6_e2m3fn``, ``float6_e3m2fn``, ``float4_e2m1fn``):
  signed, with subnormals, *no* infinity and *no* NaN encoding; every bit pattern is a number (largest
  7.5, 28 and 6). Casts saturate: a finite value or infinity past the range becomes +-max. A NaN has
  nowhere to go: the OCP spec leaves that conversion to the implementation; here quantize returns NaN
  (ml_dtypes returns -0.0, which would hide the NaN) and decompose raises ValueError. torch has no
  fp6 dtype, and its fp4 dtype (``float4_e2m1fn_x2``, two values per byte) has no cast kernel on CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["FormatSpec", "Decomposed", "FORMATS", "AUTOCAST_DTYPES", "mx_elements", "spec", "decompose", "quantize", "ulp", "names",
           "TORCH_E4M3_CAST_SATURATES_FROM", "torch_version", "torch_e4m3_cast_saturates"]


@dataclass(frozen=True)
class FormatSpec:
    """A binary floating-point format described by its bit layout."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True  # False: E4M3FN, whose top exponent holds normal numbers
    saturates: bool = False  # True: casts clamp to +-max instead of overflowing
    has_nan: bool = True  # False: fp6/fp4, where every bit pattern is a finite number
    signed: bool = True  # False: e8m0, which has no sign bit (and no zero)
    has_subnormals: bool = True  # False: e8m0, whose exponent field 0 is the power 2**-bias

    @property
    def bits(self) -> int:
        """Total width in bits (sign + exponent + mantissa)."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """Exponent bias: the stored field minus the bias is the power of two."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Smallest exponent of a normal number (field value 1; field 0 where there are no subnormals)."""
        return 1 - self.bias if self.has_subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Largest exponent of a finite number."""
        top_field = 2**self.exponent_bits - 1
        # IEEE formats keep the top field for inf/NaN; so does e8m0, whose only top pattern is NaN
        reserved = self.has_inf or (self.has_nan and self.mantissa_bits == 0)
        return (top_field - 1 if reserved else top_field) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        p = self.mantissa_bits
        if self.has_inf or not self.has_nan or p == 0:
            frac = 2 - 2.0**-p  # mantissa all ones (1.0 when there is no mantissa)
        else:
            frac = 2 - 2.0 ** (1 - p)  # all ones is NaN, so the largest mantissa ends in ...110
        return math.ldexp(frac, self.emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value, 2**(emin - mantissa_bits) (min_normal if there are none)."""
        if not self.has_subnormals:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1.0 and the next representable value, 2**-mantissa_bits."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Roughly how many significant decimal digits the mantissa holds."""
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with this layout (None for fp6/fp4: torch has no castable dtype for them)."""
        return _TORCH_DTYPES.get(self.name)


FORMATS: dict[str, FormatSpec] = {
    "fp32": FormatSpec("fp32", 8, 23),
    "fp16": FormatSpec("fp16", 5, 10),
    "bf16": FormatSpec("bf16", 8, 7),
    "fp8_e4m3": FormatSpec("fp8_e4m3", 4, 3, has_inf=False, saturates=True),
    "fp8_e5m2": FormatSpec("fp8_e5m2", 5, 2),
    # OCP MX v1.0: the e8m0 block scale and the fp6/fp4 element formats (module docstring: their rules)
    "fp8_e8m0": FormatSpec("fp8_e8m0", 8, 0, has_inf=False, signed=False, has_subnormals=False),
    "fp6_e2m3": FormatSpec("fp6_e2m3", 2, 3, has_inf=False, saturates=True, has_nan=False),
    "fp6_e3m2": FormatSpec("fp6_e3m2", 3, 2, has_inf=False, saturates=True, has_nan=False),
    "fp4_e2m1": FormatSpec("fp4_e2m1", 2, 1, has_inf=False, saturates=True, has_nan=False),
    # TF32: how Ampere+ tensor cores read fp32 matmul inputs when TF32 is allowed (fp32's range, fp16's 10
    # mantissa bits); a compute format, never stored, so names() does not list it (chapter 2 uses it)
    "tf32": FormatSpec("tf32", 8, 10),
}

#: Formats that exist only inside the hardware's arithmetic: spec()/quantize() know them, names() does not list them.
_COMPUTE_ONLY = ("tf32",)

#: The formats training runs in and torch can cast to; names() lists only these unless asked.
_CLASSIC = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e8m0": torch.float8_e8m0fnu,
}

_ALIASES = {
    "float32": "fp32", "float": "fp32", "single": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "tensorfloat32": "tf32",
    "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
    "e8m0": "fp8_e8m0", "float8_e8m0fnu": "fp8_e8m0", "fp8_e8m0fnu": "fp8_e8m0",
    "e2m3": "fp6_e2m3", "float6_e2m3fn": "fp6_e2m3", "fp6_e2m3fn": "fp6_e2m3",
    "e3m2": "fp6_e3m2", "float6_e3m2fn": "fp6_e3m2", "fp6_e3m2fn": "fp6_e3m2",
    "e2m1": "fp4_e2m1", "float4_e2m1fn": "fp4_e2m1", "fp4_e2m1fn": "fp4_e2m1",
}


#: The 16-bit formats torch.autocast runs ops in (fp16 and bf16): what the doctor and the emulator call "low".
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)

#: The first torch whose eager casts to float8_e4m3fn saturate (measured: 2.6 to 2.12.1 give NaN for 500, 1e5
#: and inf; 2.13 and later give 448). quantize saturates on every torch: OFP8's saturating conversion, not the cast.
TORCH_E4M3_CAST_SATURATES_FROM = (2, 13)


def torch_version() -> tuple[int, int]:
    """The running torch's (major, minor), e.g. (2, 13) for '2.13.0+cpu'."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_e4m3_cast_saturates(device: str | torch.device = "cpu") -> bool:
    """Whether this torch's cast to float8_e4m3fn saturates at 448 on `device`, probed by casting 1e6 and inf.

    A probe, not the version: CPU casts saturate from torch 2.13 (``TORCH_E4M3_CAST_SATURATES_FROM``, measured on
    2.6-2.15) and give NaN before; a GPU's cast is its own kernel, so ask with its device. The FNUZ variant
    (``float8_e4m3fnuz``, max 240, no inf) still gives NaN past its range on every torch measured (2.11-2.15, CPU).

    Args:
        device: where to cast (a CUDA device reads one value back once).

    Example:
        >>> torch_e4m3_cast_saturates() == (torch_version() >= TORCH_E4M3_CAST_SATURATES_FROM)  # on a CPU
        True
    """
    return _e4m3_cast_saturates(str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _e4m3_cast_saturates(device: str) -> bool:
    big = torch.tensor([1e6, math.inf], device=device).to(torch.float8_e4m3fn).float().tolist()
    return big == [448.0, 448.0]


def names(narrow: bool = False) -> list[str]:
    """The canonical format names, widest first; narrow=True adds e8m0, fp6 and fp4 (OCP MX)."""
    return [n for n in FORMATS if n not in _COMPUTE_ONLY] if narrow else list(_CLASSIC)


def mx_elements() -> tuple[str, ...]:
    """The signed formats of at most 8 bits (fp8, fp6, fp4): the elements an MX block or a scaled tensor can hold.

    Read from the registry each call, so a format added to ``FORMATS`` is an element everywhere (chapter 9's
    outlier explorer, exercise 9.1). The scale format e8m0 is unsigned and not an element.

    Example:
        >>> "fp8_e4m3" in mx_elements(), "fp8_e8m0" in mx_elements()
        (True, False)
    """
    return tuple(n for n, f in FORMATS.items() if f.signed and f.bits <= 8)


def spec(fmt: str | torch.dtype | FormatSpec) -> FormatSpec:
    """Look up a format by name ('fp16', 'bf16', ...), alias ('half') or torch dtype."""
    if isinstance(fmt, FormatSpec):
        return fmt
    if isinstance(fmt, torch.dtype):
        for name, dtype in _TORCH_DTYPES.items():
            if dtype == fmt:
                return FORMATS[name]
        raise ValueError(f"unsupported dtype {fmt}; valid dtypes: {', '.join(map(str, _TORCH_DTYPES.values()))}")
    if isinstance(fmt, str):
        key = fmt.strip().lower().removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"unknown format {fmt!r}; valid names: {', '.join(FORMATS)} (or a torch dtype)")


def _real(x, name: str = "x") -> float:
    """x as a Python float: a real number or a one-element tensor/array; ValueError naming it otherwise."""
    if isinstance(x, (str, bytes)) or isinstance(x, complex) or getattr(x, "is_complex", lambda: False)():
        raise ValueError(f"{name} must be a real number (a float, an int or a one-element tensor), got {x!r}")
    try:
        return float(x)
    except OverflowError:  # an int like 10**400: no float (of any format here) holds it
        raise ValueError(f"{name} must be a real number within float64's range (|x| < 1.8e308), "
                         f"got an int of {len(str(abs(int(x))))} digits") from None
    except (TypeError, ValueError, RuntimeError):  # None, lists, tensors with several elements, ...
        raise ValueError(f"{name} must be a real number (a float, an int or a one-element tensor), got {x!r}") from None


def _real_array(values, name: str = "values") -> np.ndarray:
    """values (a number, a sequence, an array or a tensor of real numbers) as float64 numpy; ValueError otherwise."""
    if isinstance(values, torch.Tensor):
        if values.is_complex():
            raise ValueError(f"{name} must be real numbers; got a complex tensor ({values.dtype}): "
                             "a floating-point format stores real values only")
        return values.detach().cpu().to(torch.float64).numpy()
    try:
        with np.errstate(invalid="ignore"):  # signalling NaNs in float32 input warn on conversion
            arr = np.asarray(values)
            if arr.dtype.kind in "cUSV" or (arr.dtype.kind == "O" and not all(map(_is_real, arr.flat))):
                # numpy would read None as NaN and "1.5" as 1.5: neither is a number a format can store
                raise TypeError("not real numbers")
            return arr.astype(np.float64)
    except (TypeError, ValueError, OverflowError):  # OverflowError: ints beyond float64 (10**400)
        shown = repr(values) if len(repr(values)) <= 60 else repr(values)[:57] + "..."
        raise ValueError(f"{name} must be real numbers (a float, a sequence, an array or a tensor), got {shown}") from None


def _is_real(v) -> bool:
    """Whether one element of an object array reads as a real number (None, text and complex numbers do not)."""
    if v is None or isinstance(v, (str, bytes, complex, np.complexfloating)):
        return False
    try:
        float(v)  # ints, floats, Fractions, Decimals, one-element real tensors
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _round_unbounded(a: np.ndarray, f: FormatSpec) -> np.ndarray:
    """Round non-negative finite float64 values to f's precision, ignoring the top of the range."""
    _, e2 = np.frexp(a)  # a = m * 2**e2 with m in [0.5, 1), so the leading bit is 2**(e2-1)
    exp = np.maximum(e2.astype(np.int64) - 1, f.emin)  # below emin the spacing stays fixed: subnormals
    step_exp = exp - f.mantissa_bits  # spacing of representable values around a
    # a / 2**step_exp is exact (a power-of-two scaling); np.rint rounds half to even.
    return np.ldexp(np.rint(np.ldexp(a, -step_exp)), step_exp)


def _quantize_unsigned(x: np.ndarray, f: FormatSpec) -> np.ndarray:
    """Round to an unsigned, zero-less format (e8m0): nearest power, tiny -> smallest, the rest NaN."""
    ok = np.isfinite(x) & (x > 0)  # zero, negatives, inf and NaN have no encoding but NaN
    out = _round_unbounded(np.where(ok, x, 1.0), f)
    out = np.maximum(out, f.min_normal)  # there is no zero to underflow to
    return np.where(ok & (out <= f.max), out, np.nan)


#: Integers up to this magnitude are exact in float64 (53 significant bits); beyond it, converting first rounds.
_EXACT_INT = 2**53


def _round_int(n: int, f: FormatSpec) -> float | int:
    """A Python int rounded once to f's precision (nearest, ties to even), exactly, as a float64.

    Why: float(n) rounds to float64's 53 bits first, and a second rounding to f can then land on the wrong
    side of a tie (2**60 + 2**36 + 1 becomes 2**60 + 2**36, a tie in fp32 that goes to 2**60; torch's cast
    gives 2**60 + 2**37). f keeps at most 24 significant bits, so the result is exact in float64.
    """
    a = abs(n)
    drop = a.bit_length() - (f.mantissa_bits + 1)  # low bits below f's precision
    if drop > 0:
        q, r = divmod(a, 1 << drop)
        half = 1 << (drop - 1)
        q += r > half or (r == half and q & 1)  # round half to even, on the integer itself
        a = q << drop
    if a.bit_length() > 1024:  # beyond float64: left as it is, for _real_array's "within float64's range" error
        return n
    return math.copysign(float(a), n)


def _exact_ints(values) -> list | None:
    """values as a flat list of Python ints and floats when it holds an integer beyond 2**53, else None."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            return None
        values = values.detach().cpu().numpy()
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        return [int(values)] if abs(int(values)) > _EXACT_INT else None
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.tolist() if np.abs(values.astype(object)).max(initial=0) > _EXACT_INT else None
    if isinstance(values, (list, tuple)) and any(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                 and abs(int(v)) > _EXACT_INT for v in values):
        return list(values)
    return None


def _prerounded(values, f: FormatSpec):
    """values with every integer beyond 2**53 already rounded to f exactly (see _round_int); others unchanged."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):  # a scalar stays a scalar
        return _round_int(int(values), f) if abs(int(values)) > _EXACT_INT else values
    ints = _exact_ints(values)
    if ints is None:
        return values
    flat = [_round_int(int(v), f) if isinstance(v, (int, np.integer)) and not isinstance(v, bool)
            and abs(int(v)) > _EXACT_INT else v for v in np.asarray(ints, dtype=object).ravel().tolist()]
    return np.asarray(flat, dtype=object).reshape(np.shape(np.asarray(ints, dtype=object)))  # _real_array converts


def quantize(values, fmt: str | torch.dtype | FormatSpec) -> np.ndarray:
    """Round values to fmt (nearest, ties to even) and return them as float64 numpy.

    Integers (Python, numpy or torch) beyond 2**53 are rounded once, from their exact value, as torch's
    cast does; every other value is read as float64 first.

    Args:
        values: a real number, a (nested) sequence of them, a numpy array or a tensor. Anything else (None, a
            string, a sequence holding one) is a ValueError, not a silent NaN.
        fmt: a format name, alias, torch dtype or FormatSpec.

    Example:
        >>> quantize([1.0001, 70000.0], "fp16").tolist()
        [1.0, inf]
    """
    f = spec(fmt)
    x = _real_array(_prerounded(values, f) if f.signed else values)
    if not f.signed:
        return _quantize_unsigned(x, f)
    a = np.abs(x)
    finite = np.isfinite(a)
    out = np.where(finite, _round_unbounded(np.where(finite, a, 0.0), f), a)
    too_big = out > f.max  # includes +inf inputs
    if f.saturates:
        out = np.where(too_big, f.max, out)
    else:
        out = np.where(too_big, np.inf if f.has_inf else np.nan, out)
    return np.copysign(out, x)  # keeps -0.0 and the sign of NaN-free values


@dataclass(frozen=True)
class Decomposed:
    """A value rounded to a format, split into its sign, exponent and mantissa fields."""

    fmt: str
    x: float
    sign: int
    exponent: int  # biased field value
    mantissa: int  # field value as an integer
    value: float
    kind: str  # "zero", "subnormal", "normal", "inf" or "nan"
    overflow: bool  # rounding pushed a finite x past the largest finite value
    underflow: bool  # a non-zero x rounded to zero
    rel_error: float  # |value - x| / |x| (0 for x == 0, nan when not finite)

    @property
    def bits(self) -> str:
        """The fields as a bit string 'S EEEEE MMMMMMMMMM'."""
        f = spec(self.fmt)
        fields = [f"{self.sign}"] if f.signed else []
        fields.append(f"{self.exponent:0{f.exponent_bits}b}")
        if f.mantissa_bits:
            fields.append(f"{self.mantissa:0{f.mantissa_bits}b}")
        return " ".join(fields)

    @property
    def power(self) -> int | None:
        """The unbiased power of two of a finite non-zero value."""
        if self.kind == "normal":
            return self.exponent - spec(self.fmt).bias
        if self.kind == "subnormal":
            return spec(self.fmt).emin
        return None


def decompose(x: float, fmt: str | torch.dtype | FormatSpec) -> Decomposed:
    """Round x to fmt and return its fields, its kind and what the rounding did."""
    f = spec(fmt)
    exact = _prerounded(x, f) if f.signed and isinstance(x, (int, np.integer)) else x  # big ints: round once
    x = _real(x)
    value = float(quantize(np.array([_real(exact)]), f)[0])
    if math.isnan(value) and not f.has_nan:
        raise ValueError(f"x is {x!r}, which {f.name} cannot encode: it has no NaN "
                         "(quantize returns NaN for it; pass a finite number or an infinity)")
    sign = 1 if f.signed and math.copysign(1.0, value) < 0 else 0
    top = 2**f.exponent_bits - 1
    p = f.mantissa_bits
    a = abs(value)
    if math.isnan(value):
        kind, exponent, mantissa = "nan", top, (2**p - 1 if not f.has_inf else 2 ** (p - 1))
    elif math.isinf(value):
        kind, exponent, mantissa = "inf", top, 0
    elif a == 0.0:
        kind, exponent, mantissa = "zero", 0, 0
    elif a < f.min_normal and f.has_subnormals:
        kind, exponent, mantissa = "subnormal", 0, int(a / f.min_subnormal)
    else:
        e = math.frexp(a)[1] - 1
        kind, exponent, mantissa = "normal", e + f.bias, int(math.ldexp(a, p - e)) - 2**p
    overflow = math.isfinite(x) and float(_round_unbounded(np.array([abs(x)]), f)[0]) > f.max
    if not f.signed:  # e8m0: rounding past 2**127 gives NaN; there is no zero to underflow to
        overflow = math.isfinite(x) and x > 0 and float(_round_unbounded(np.array([x]), f)[0]) > f.max
    underflow = x != 0.0 and math.isfinite(x) and value == 0.0
    if not math.isfinite(x) or not math.isfinite(value):
        rel_error = 0.0 if (math.isinf(x) and value == x) else math.nan
    else:
        rel_error = 0.0 if x == 0.0 else abs(value - x) / abs(x)
    return Decomposed(f.name, x, sign, exponent, mantissa, value, kind, overflow, underflow, rel_error)


def ulp(x: float, fmt: str | torch.dtype | FormatSpec) -> float:
    """The spacing of fmt's values at x: the gap from |x| *rounded to fmt* up to the next representable magnitude.

    x is rounded first, so a value that rounds up to a power of two (2047.9 is 2048 in fp16) gets the spacing of
    the binade above it. At fmt's largest finite value, where no larger value exists (torch.nextafter gives inf
    in a format with inf), the result is the spacing of that value's binade, the gap down to its neighbour
    below; a value that rounds to inf or NaN gives NaN.

    Args:
        x: a real number (a float, an int or a one-element tensor).
        fmt: a format name, alias, torch dtype or FormatSpec.

    Example:
        >>> ulp(1.0, "fp16"), ulp(2047.9, "fp16"), ulp(65504.0, "fp16")
        (0.0009765625, 2.0, 32.0)
    """
    f = spec(fmt)
    a = abs(float(quantize(np.array([_real(x)]), f)[0]))
    if not math.isfinite(a):
        return math.nan
    e = max(math.frexp(a)[1] - 1, f.emin) if a > 0 else f.emin
    return math.ldexp(1.0, e - f.mantissa_bits)
