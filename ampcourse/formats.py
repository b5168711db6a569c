"""Floating-point formats from their bit layout: fp32, fp16, bf16 and two fp8 variants.

Everything here is computed from (exponent bits, mantissa bits, bias); nothing asks torch what a
format can hold. The tests check the results against numpy's float16 (all 65,536 bit patterns)
and against torch's own dtype casts.

Rounding is IEEE 754 round-to-nearest, ties-to-even, applied once to the exact input value.
Note: torch casts float64 to float16/bfloat16 *through float32*, which rounds twice; feed
float32 values when you compare with torch casts.

fp8_e4m3 is OCP's E4M3FN (``torch.float8_e4m3fn``): there is no infinity, the only NaN is the
all-ones pattern ``S.1111.111``, so its largest value is 448; casts *saturate*: any finite value
or infinity beyond the range becomes +-448 (torch's cast does the same), NaN stays NaN.
fp8_e5m2 follows the IEEE rules of fp16 (overflow to inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["FormatSpec", "Decomposed", "FORMATS", "spec", "decompose", "quantize", "ulp", "names"]


@dataclass(frozen=True)
class FormatSpec:
    """A binary floating-point format described by its bit layout."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True  # False: E4M3FN, whose top exponent holds normal numbers
    saturates: bool = False  # True: casts clamp to +-max instead of overflowing

    @property
    def bits(self) -> int:
        """Total width in bits (sign + exponent + mantissa)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """Exponent bias: the stored field minus the bias is the power of two."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Smallest exponent of a normal number (field value 1)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Largest exponent of a finite number."""
        top_field = 2**self.exponent_bits - 1
        return (top_field - 1 if self.has_inf else top_field) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        p = self.mantissa_bits
        if self.has_inf:
            frac = 2 - 2.0**-p  # mantissa all ones
        else:
            frac = 2 - 2.0 ** (1 - p)  # all ones is NaN, so the largest mantissa ends in ...110
        return math.ldexp(frac, self.emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value, 2**(emin - mantissa_bits)."""
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
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype with this layout."""
        return _TORCH_DTYPES[self.name]


FORMATS: dict[str, FormatSpec] = {
    "fp32": FormatSpec("fp32", 8, 23),
    "fp16": FormatSpec("fp16", 5, 10),
    "bf16": FormatSpec("bf16", 8, 7),
    "fp8_e4m3": FormatSpec("fp8_e4m3", 4, 3, has_inf=False, saturates=True),
    "fp8_e5m2": FormatSpec("fp8_e5m2", 5, 2),
}

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

_ALIASES = {
    "float32": "fp32", "float": "fp32", "single": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}


def names() -> list[str]:
    """The canonical format names, widest first."""
    return list(FORMATS)


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
            if arr.dtype.kind == "c":
                raise TypeError("complex")
            return arr.astype(np.float64)
    except (TypeError, ValueError, OverflowError):  # OverflowError: ints beyond float64 (10**400)
        shown = repr(values) if len(repr(values)) <= 60 else repr(values)[:57] + "..."
        raise ValueError(f"{name} must be real numbers (a float, a sequence, an array or a tensor), got {shown}") from None


def _round_unbounded(a: np.ndarray, f: FormatSpec) -> np.ndarray:
    """Round non-negative finite float64 values to f's precision, ignoring the top of the range."""
    _, e2 = np.frexp(a)  # a = m * 2**e2 with m in [0.5, 1), so the leading bit is 2**(e2-1)
    exp = np.maximum(e2.astype(np.int64) - 1, f.emin)  # below emin the spacing stays fixed: subnormals
    step_exp = exp - f.mantissa_bits  # spacing of representable values around a
    # a / 2**step_exp is exact (a power-of-two scaling); np.rint rounds half to even.
    return np.ldexp(np.rint(np.ldexp(a, -step_exp)), step_exp)


def quantize(values, fmt: str | torch.dtype | FormatSpec) -> np.ndarray:
    """Round values to fmt (nearest, ties to even) and return them as float64 numpy."""
    f = spec(fmt)
    x = _real_array(values)
    a = np.abs(x)
    finite = np.isfinite(a)
    out = np.where(finite, _round_unbounded(np.where(finite, a, 0.0), f), a)
    too_big = out > f.max  # includes +inf inputs
    if f.saturates:
        out = np.where(too_big, f.max, out)
    else:
        out = np.where(too_big, np.inf, out)
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
        return f"{self.sign} {self.exponent:0{f.exponent_bits}b} {self.mantissa:0{f.mantissa_bits}b}"

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
    x = _real(x)
    value = float(quantize(np.array([x]), f)[0])
    sign = 1 if math.copysign(1.0, value) < 0 else 0
    top = 2**f.exponent_bits - 1
    p = f.mantissa_bits
    a = abs(value)
    if math.isnan(value):
        kind, exponent, mantissa = "nan", top, (2**p - 1 if not f.has_inf else 2 ** (p - 1))
    elif math.isinf(value):
        kind, exponent, mantissa = "inf", top, 0
    elif a == 0.0:
        kind, exponent, mantissa = "zero", 0, 0
    elif a < f.min_normal:
        kind, exponent, mantissa = "subnormal", 0, int(a / f.min_subnormal)
    else:
        e = math.frexp(a)[1] - 1
        kind, exponent, mantissa = "normal", e + f.bias, int(math.ldexp(a, p - e)) - 2**p
    overflow = math.isfinite(x) and float(_round_unbounded(np.array([abs(x)]), f)[0]) > f.max
    underflow = x != 0.0 and math.isfinite(x) and value == 0.0
    if not math.isfinite(x) or not math.isfinite(value):
        rel_error = 0.0 if (math.isinf(x) and value == x) else math.nan
    else:
        rel_error = 0.0 if x == 0.0 else abs(value - x) / abs(x)
    return Decomposed(f.name, x, sign, exponent, mantissa, value, kind, overflow, underflow, rel_error)


def ulp(x: float, fmt: str | torch.dtype | FormatSpec) -> float:
    """Spacing between |x| rounded to fmt and the next larger representable magnitude."""
    f = spec(fmt)
    a = abs(float(quantize(np.array([_real(x)]), f)[0]))
    if not math.isfinite(a):
        return math.nan
    e = max(math.frexp(a)[1] - 1, f.emin) if a > 0 else f.emin
    return math.ldexp(1.0, e - f.mantissa_bits)
