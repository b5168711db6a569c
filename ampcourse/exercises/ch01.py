"""Chapter 1 exercises: ulp, exact integers, subnormals."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import formats
from ._core import call_learner, failed, passed, same_float

__all__ = ["check_fp16_ulp", "check_largest_exact_integer", "check_subnormal_example"]


def check_fp16_ulp(fp16_ulp: Callable[[float], float], xs: Iterable[float] | None = None) -> None:
    """Exercise 1.1: fp16_ulp(x) returns the gap from |x| (rounded to fp16) to the next fp16 value up."""
    title = "Exercise 1.1 (fp16 ulp)"
    if xs is None:
        xs = [1.0, 1.5, 2.0, 3.0, 1000.0, 1024.0, 65504.0, 0.1, -7.0, 6.1e-5, 2.0**-14, 2.0**-20, 2.0**-24, 0.0]
    for x in xs:
        want = formats.ulp(x, "fp16")
        got = call_learner(title, fp16_ulp, x)
        try:
            ok = same_float(float(got), want)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            hint = ("below 2**-14 fp16 is subnormal: the spacing stays 2**-24" if abs(x) < 2.0**-14 else
                    "the spacing is 2**(e - 10), where 2**e <= |x| < 2**(e+1)")
            failed(title, f"fp16_ulp({x!r}) == {want!r}", got, hint)
    passed(title, "Your ulp matches on normals, subnormals and zero.")


def check_largest_exact_integer(n: Any, fmt: str = "bf16") -> None:
    """Exercise 1.2: the largest N such that every integer 0..N is exactly representable in fmt."""
    f = formats.spec(fmt)
    title = f"Exercise 1.2 (largest exact integer in {f.name})"
    want = 2 ** (f.mantissa_bits + 1)
    if not isinstance(n, int) or isinstance(n, bool):
        failed(title, "an int", repr(n), "answer with a whole number such as 100")
    if n != want:
        # Hint at the idea, never at the answer: no integer near 2**(p + 1) is named (N + 1 for N = want - 1 would be it)
        p = f.mantissa_bits
        hint = (f"every integer up to {n} is exact in {f.name}, and so are some beyond it: try a bigger number" if n < want else
                f"not every integer up to {n} survives in {f.name}: with {p} stored mantissa bits (+1 implicit), "
                "find the power of two above which the spacing between neighbours becomes 2")
        failed(title, "the N where N + 1 is the first integer that rounds", n, hint)
    passed(title, f"With {f.mantissa_bits} stored mantissa bits (+1 implicit), integers are exact up to 2**{f.mantissa_bits + 1}.")


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
