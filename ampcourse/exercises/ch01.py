"""Chapter 1 exercises: ulp, exact integers, subnormals."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from .. import formats
from ._core import call_learner, failed, passed, same_float

__all__ = ["check_fp16_ulp", "check_largest_exact_integer", "check_subnormal_example", "largest_exact_integer"]


def check_fp16_ulp(fp16_ulp: Callable[[float], float], xs: Iterable[float] | None = None) -> None:
    """Exercise 1.1: fp16_ulp(x) returns the gap from |x| (rounded to fp16) to the next fp16 value up.

    At fp16's largest finite value no larger fp16 value exists (``torch.nextafter`` gives inf there); the
    convention, ``formats.ulp``'s, is the gap to the value just below it (the spacing of its binade).

    Args:
        fp16_ulp: the learner's function of one float.
        xs: the values to test it on (default: normals, values that round up into the next binade, fp16's
            largest value, subnormals and zero).

    Example:
        >>> check_fp16_ulp(lambda x: formats.ulp(x, "fp16"))  # doctest: +ELLIPSIS
        ✅ Exercise 1.1 (fp16 ulp): correct. ...
    """
    title = "Exercise 1.1 (fp16 ulp)"
    top = formats.spec("fp16").max
    if xs is None:
        # 2047.9 and 0.99999 round *up* to a power of two in fp16: a solution that skips rounding |x| first
        # takes the spacing of the binade below and fails there (both lie within 2**-11 relative of the power)
        xs = [1.0, 1.5, 2.0, 3.0, 1000.0, 1024.0, 2047.9, 0.99999, top, 0.1, -7.0, 6.1e-5, 2.0**-14, 2.0**-20,
              2.0**-24, 0.0]
    for x in xs:
        want = formats.ulp(x, "fp16")
        got = call_learner(title, fp16_ulp, x)
        try:
            ok = same_float(float(got), want)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            stored = float(formats.quantize([abs(x)], "fp16")[0])
            if abs(stored) == top and math.isinf(_as_float(got)):
                hint = ("fp16 has no larger value here (torch.nextafter gives inf): answer the gap to the fp16 value "
                        "just below it, the spacing of its binade")
            elif math.isfinite(stored) and stored > 0 and math.frexp(stored)[1] != math.frexp(abs(x))[1]:
                hint = (f"round |x| to fp16 first (torch.tensor(x, dtype=torch.float16)): {abs(x)!r} is stored as "
                        f"{stored!r}, in the binade above, whose spacing is what counts")
            elif abs(x) < 2.0**-14:
                hint = "below 2**-14 fp16 is subnormal: the spacing stays 2**-24"
            else:
                hint = "the spacing is 2**(e - 10), where 2**e <= |x rounded to fp16| < 2**(e+1)"
            failed(title, f"fp16_ulp({x!r}) == {want!r}", got, hint)
    passed(title, "Your ulp matches on normals, values that round up to a power of two, subnormals and zero.")


def _as_float(v: Any) -> float:
    """v as a float, or nan when it is not a number (for choosing a hint only)."""
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return math.nan


def largest_exact_integer(fmt: str = "bf16") -> int:
    """The largest N such that every integer 0..N is exactly representable in fmt.

    Two limits, whichever comes first: the mantissa (p stored bits hold every integer up to 2**(p + 1); from
    there the spacing is 2) and the range (a format whose largest value is below 2**(p + 1), such as fp6_e2m3,
    stops at the largest integer it holds, the next one saturating or overflowing).

    Args:
        fmt: a signed format of ``formats.FORMATS`` (or an alias or torch dtype).

    Raises:
        ValueError: for a format without zero (fp8_e8m0), where no N has every integer 0..N exact.

    Example:
        >>> largest_exact_integer("bf16"), largest_exact_integer("fp6_e2m3")
        (256, 7)
    """
    f = formats.spec(fmt)
    if not f.signed:  # e8m0: powers of two only, and no zero
        raise ValueError(f"{f.name} has no zero (its values are powers of two), so no N has every integer 0..N "
                         "exact; ask about a signed format such as bf16, fp16 or fp8_e4m3")
    by_mantissa = 2 ** (f.mantissa_bits + 1)
    # every integer below 2**(p + 1) is exact wherever the range reaches (1 is a normal number in every signed format)
    return by_mantissa if by_mantissa <= f.max else math.floor(f.max)


def check_largest_exact_integer(n: Any, fmt: str = "bf16") -> None:
    """Exercise 1.2: the largest N such that every integer 0..N is exactly representable in fmt.

    Args:
        n: the learner's answer: an int, or anything ``operator.index`` reads as one (np.int64, an integer tensor
            of one element), not a bool or a float.
        fmt: the format asked about (a format without zero, fp8_e8m0, is a ValueError: the question has no answer).

    Example:
        >>> check_largest_exact_integer(256, "bf16")  # doctest: +ELLIPSIS
        ✅ Exercise 1.2 (largest exact integer in bf16): correct. ...
    """
    f = formats.spec(fmt)
    title = f"Exercise 1.2 (largest exact integer in {f.name})"
    want = largest_exact_integer(f)
    p = f.mantissa_bits
    by_range = want < 2 ** (p + 1)  # the range ends before the mantissa runs out
    try:
        # what operator.index accepts is a whole number (np.argmin gives np.int64); floats and bools are not
        value = None if isinstance(n, bool) or getattr(n, "dtype", None) in _BOOLS else operator.index(n)
    except (TypeError, ValueError, RuntimeError):
        value = None
    if value is None:
        failed(title, "an int", repr(n), "answer with a whole number such as 100 (int(...) of a float that holds one)")
    if value != want:
        # Hint at the idea, never at the answer: no integer near the answer is named (N + 1 for N = want - 1 would be it)
        if value < want:
            hint = f"every integer up to {value} is exact in {f.name}, and so are some beyond it: try a bigger number"
        elif by_range:
            hint = (f"{f.name}'s range ends before its mantissa runs out: not every integer up to {value} fits "
                    f"below its largest value, formats.spec({f.name!r}).max")
        else:
            hint = (f"not every integer up to {value} survives in {f.name}: with {p} stored mantissa bits (+1 implicit), "
                    "find the power of two above which the spacing between neighbours becomes 2")
        failed(title, "the N where N + 1 is the first integer that rounds", n, hint)
    if by_range:
        detail = (f"{f.name}'s largest value, {f.max:g}, comes before its {p} mantissa bits run out: every integer "
                  f"up to {want} is exact, and the next one is past the range.")
    else:
        detail = f"With {p} stored mantissa bits (+1 implicit), integers are exact up to 2**{p + 1}."
    passed(title, detail)


#: numpy's and torch's booleans, which operator.index reads as 0 and 1 (a torch.bool tensor does): not an answer.
_BOOLS = (np.bool_, torch.bool)


def check_subnormal_example(x: Any) -> None:
    """Exercise 1.3: a value that fp16 stores as a subnormal while bf16 stores it as a normal number."""
    title = "Exercise 1.3 (subnormal in fp16, normal in bf16)"
    try:
        x = float(x)
    except (TypeError, ValueError):
        failed(title, "a float", repr(x), "answer with a number such as 1e-3")
    h, b = formats.decompose(x, "fp16"), formats.decompose(x, "bf16")
    if h.kind != "subnormal" or b.kind != "normal":
        failed(title, "fp16 kind 'subnormal' and bf16 kind 'normal'", f"fp16 {h.kind!r}, bf16 {b.kind!r}",
               "fp16 subnormals lie between 2**-24 and 2**-14 (about 6e-8 to 6.1e-5)")
    passed(title, f"fp16 keeps {h.value:.3g} with only {h.mantissa.bit_length()} significant bits; bf16 keeps {b.value:.3g}.")
