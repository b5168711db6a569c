"""What autocast does to each op, measured live on this torch build and device (never typed in).

    >>> from ampcourse.autocast_ops import op_table, format_table
    >>> rows = op_table("cpu", torch.bfloat16)
    >>> print(format_table(rows))
    >>> {r.op: r.category for r in rows}["linear"]
    'lower'

Each op runs three times under ``torch.amp.autocast(device_type, dtype)``: with fp32 inputs, with
low-precision inputs, and (for ops with several floating-point inputs) with mixed inputs. The output
dtypes decide the category:

- ``lower``: fp32 inputs come out in the low-precision dtype (autocast casts them down: matmuls, convs);
- ``fp32``: low-precision inputs come out in fp32 (autocast casts them up: losses, reductions);
- ``promote``: mixed inputs run in the widest input type (autocast's promote list, or ordinary type
  promotion);
- ``unchanged``: the output follows the input dtype (autocast leaves the op alone).

The lists differ per device: on CPU, ``softmax`` and ``layer_norm`` of a bf16 input stay bf16, while
CUDA autocast runs them in fp32. Generate the table on the device you train on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _args

__all__ = ["CATEGORIES", "Probe", "OpRow", "OpSpec", "OPS", "op_table", "format_table", "differences"]

CATEGORIES = {
    "lower": "runs in the low-precision dtype (fp32 inputs are cast down)",
    "fp32": "runs in fp32 (low-precision inputs are cast up)",
    "promote": "runs in the widest input dtype (mixed inputs: fp32)",
    "unchanged": "autocast leaves it alone: output dtype = input dtype",
    "unsupported": "raised an error for this dtype on this device",
}


@dataclass(frozen=True)
class OpSpec:
    """An op to probe: its floating-point input shapes and how to call it."""

    name: str
    shapes: tuple[tuple[int, ...], ...]  # one shape per floating-point input
    call: Callable[..., torch.Tensor]  # call(*float_inputs) -> tensor


def _target(n: int, classes: int, device: torch.device) -> torch.Tensor:
    """Class indices 0, 1, 2, ... (mod classes): deterministic integer targets."""
    return torch.arange(n, device=device) % classes


def _specs() -> tuple[OpSpec, ...]:
    """The ops in the table: matmul-like, pointwise, normalisations, reductions, losses, multi-input."""
    sdpa = F.scaled_dot_product_attention
    return (
        OpSpec("linear", ((4, 8), (3, 8), (3,)), F.linear),
        OpSpec("matmul (@)", ((4, 8), (8, 3)), torch.matmul),
        OpSpec("bmm", ((2, 4, 8), (2, 8, 3)), torch.bmm),
        OpSpec("addmm", ((4, 3), (4, 8), (8, 3)), torch.addmm),
        OpSpec("conv2d", ((1, 2, 6, 6), (3, 2, 3, 3)), F.conv2d),
        OpSpec("scaled_dot_product_attention", ((1, 2, 4, 8),) * 3, sdpa),
        OpSpec("relu", ((4, 8),), F.relu),
        OpSpec("gelu", ((4, 8),), F.gelu),
        OpSpec("max_pool2d", ((1, 2, 6, 6),), lambda x: F.max_pool2d(x, 2)),
        OpSpec("exp", ((4, 8),), torch.exp),
        OpSpec("log", ((4, 8),), torch.log),
        OpSpec("pow", ((4, 8),), lambda x: torch.pow(x, 2)),
        OpSpec("sum", ((4, 8),), torch.sum),
        OpSpec("cumsum", ((4, 8),), lambda x: torch.cumsum(x, 1)),
        OpSpec("softmax", ((4, 8),), lambda x: F.softmax(x, dim=-1)),
        OpSpec("log_softmax", ((4, 8),), lambda x: F.log_softmax(x, dim=-1)),
        OpSpec("layer_norm", ((4, 8), (8,), (8,)), lambda x, w, b: F.layer_norm(x, (8,), w, b)),
        OpSpec("group_norm", ((4, 8), (8,), (8,)), lambda x, w, b: F.group_norm(x, 2, w, b)),
        OpSpec("cross_entropy", ((4, 8),), lambda x: F.cross_entropy(x, _target(4, 8, x.device))),
        OpSpec("nll_loss", ((4, 8),), lambda x: F.nll_loss(x, _target(4, 8, x.device))),
        OpSpec("mse_loss", ((4, 8), (4, 8)), F.mse_loss),
        OpSpec("binary_cross_entropy_with_logits", ((4, 8), (4, 8)), F.binary_cross_entropy_with_logits),
        OpSpec("add (a + b)", ((4, 8), (4, 8)), torch.add),
        OpSpec("mul (a * b)", ((4, 8), (4, 8)), torch.mul),
        OpSpec("cat", ((4, 8), (4, 8)), lambda a, b: torch.cat([a, b])),
        OpSpec("addcmul", ((4, 8), (4, 8), (4, 8)), torch.addcmul),
        OpSpec("dot", ((8,), (8,)), torch.dot),
    )


#: The probed ops, in table order.
OPS: tuple[OpSpec, ...] = _specs()


@dataclass(frozen=True)
class Probe:
    """One run of an op under autocast: the input dtypes and what came out."""

    inputs: tuple[str, ...]
    output: str  # a dtype name ('bfloat16', 'float32', ...) or 'error: <message>'

    @property
    def failed(self) -> bool:
        """True when the op raised."""
        return self.output.startswith("error")


@dataclass(frozen=True)
class OpRow:
    """What autocast did to one op: the probes and the category they imply."""

    op: str
    category: str  # a key of CATEGORIES
    from_fp32: Probe  # all floating-point inputs fp32
    from_low: Probe  # all floating-point inputs in the autocast dtype
    from_mixed: Probe | None  # first input low precision, the rest fp32 (ops with 2+ float inputs)

    @property
    def decisive(self) -> Probe:
        """The probe that shows the category: fp32 in for 'lower', mixed in for 'promote', else low in."""
        if self.category == "lower":
            return self.from_fp32
        if self.category == "promote" and self.from_mixed is not None:
            return self.from_mixed
        return self.from_low

    @property
    def inputs(self) -> tuple[str, ...]:
        """Input dtypes of the decisive probe."""
        return self.decisive.inputs

    @property
    def output(self) -> str:
        """Output dtype of the decisive probe."""
        return self.decisive.output


def _name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def _probe(spec: OpSpec, dtypes: Sequence[torch.dtype], device: torch.device, amp_dtype: torch.dtype) -> Probe:
    """Run spec under autocast with inputs of the given dtypes and record the output dtype."""
    gen = torch.Generator().manual_seed(0)
    # positive inputs keep log/pow/bce well defined; built outside autocast in the probe's dtypes
    inputs = [(torch.rand(shape, generator=gen) + 0.5).to(device=device, dtype=dt) for shape, dt in zip(spec.shapes, dtypes)]
    try:
        with torch.amp.autocast(device_type=device.type, dtype=amp_dtype):
            out = spec.call(*inputs)
        result = _name(out.dtype)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        result = "error: " + str(err).strip().splitlines()[0][:80]
    return Probe(tuple(_name(d) for d in dtypes), result)


def _categorise(low: str, fp32: Probe, lowp: Probe, mixed: Probe | None) -> str:
    """The category implied by the three probes (see the module docstring)."""
    if fp32.failed or lowp.failed:
        return "unsupported"
    if fp32.output == low:
        return "lower"
    if lowp.output == "float32":
        return "fp32"
    if mixed is not None and mixed.output == "float32":
        return "promote"
    return "unchanged"


def _check_args(device_type: str, dtype: torch.dtype) -> torch.device:
    """Validate the device type and autocast dtype; return the device to probe on."""
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast dtype must be torch.float16 or torch.bfloat16, got {_args.shown(dtype)}")
    if isinstance(device_type, torch.device):  # a device, as torch.autocast's callers often hold one: its type
        device_type = device_type.type
    if not isinstance(device_type, str) or device_type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(f"unknown device_type {_args.shown(device_type)}; use 'cpu', 'cuda', 'mps' or 'xpu'")
    if device_type != "cpu":
        backend = getattr(torch, device_type, None) if device_type != "mps" else torch.backends.mps
        if backend is None or not backend.is_available():
            raise ValueError(f"device_type {device_type!r} is not available here; use 'cpu'")
    return torch.device(device_type)


def op_table(device_type: str, dtype: torch.dtype, ops: Sequence[OpSpec] = OPS) -> list[OpRow]:
    """Run each op under torch.amp.autocast(device_type, dtype) and classify what autocast did to it."""
    device = _check_args(device_type, dtype)
    if isinstance(ops, OpSpec) or not isinstance(ops, Sequence) or not all(isinstance(o, OpSpec) for o in ops):
        raise ValueError(f"ops must be a sequence of OpSpec (default: autocast_ops.OPS), got {_args.shown(ops)}")
    low = _name(dtype)
    rows = []
    for spec in ops:
        n = len(spec.shapes)
        fp32 = _probe(spec, [torch.float32] * n, device, dtype)
        lowp = _probe(spec, [dtype] * n, device, dtype)
        mixed = _probe(spec, [dtype] + [torch.float32] * (n - 1), device, dtype) if n > 1 else None
        rows.append(OpRow(spec.name, _categorise(low, fp32, lowp, mixed), fp32, lowp, mixed))
    return rows


def _short(output: str) -> str:
    """'bfloat16' -> 'bf16', 'float32' -> 'fp32', errors -> 'error'."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(output, "error" if output.startswith("error") else output)


def _check_rows(rows, name: str) -> None:
    """ValueError unless rows is a sequence of OpRow (what op_table returns)."""
    if isinstance(rows, (str, OpRow)) or not isinstance(rows, Sequence) or not all(isinstance(r, OpRow) for r in rows):
        raise ValueError(f"{name} must be a list of OpRow, as op_table() returns, got {_args.shown(rows)}")


def format_table(rows: Sequence[OpRow]) -> str:
    """A plain-text table: op, output dtype for fp32 / low / mixed inputs, category."""
    _check_rows(rows, "rows")
    low = _short(rows[0].from_low.inputs[0]) if rows else "low"
    head = f"{'op':34} {'fp32 in':>8} {low + ' in':>8} {'mixed in':>9}  category"
    lines = [head, "-" * len(head)]
    for r in rows:
        mixed = _short(r.from_mixed.output) if r.from_mixed is not None else "-"
        lines.append(f"{r.op:34} {_short(r.from_fp32.output):>8} {_short(r.from_low.output):>8} {mixed:>9}  {r.category}")
    return "\n".join(lines)


def differences(a: Sequence[OpRow], b: Sequence[OpRow]) -> list[tuple[str, str, str]]:
    """Ops whose category differs between two tables: (op, category in a, category in b)."""
    _check_rows(a, "a")
    _check_rows(b, "b")
    cats_b = {r.op: r.category for r in b}
    return [(r.op, r.category, cats_b[r.op]) for r in a if r.op in cats_b and cats_b[r.op] != r.category]
