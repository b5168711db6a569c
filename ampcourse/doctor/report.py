"""The doctor's report as data: findings (one shape for every rule) and the verdict per precision.

Renderers (text, HTML, plot) live in :mod:`ampcourse.doctor.render`; this module holds no formatting beyond JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import _args
from ..device import parse_precision
from .verdict import _plain
from .vocab import KINDS, PHASES, SEVERITIES, STATUSES, quoted  # noqa: F401 (re-exported)

__all__ = ["Finding", "Report", "KINDS", "SEVERITIES", "PHASES"]

@dataclass
class Finding:
    """One measured problem or fact: what, where (module, phase, op), in which precision, the number, what to do.

    ``module`` is a qualified module name ("" = the whole model; for code written inline in a non-leaf module's
    forward, that module, and the message says "(inline in forward)"), or a parameter name for optimizer and
    gradient findings. ``op`` is the aten op (such as "aten::mul") when the finding is about one op, else "".
    """

    kind: str
    module: str
    precision: str  # "fp16", "bf16" or "fp32"
    value: float
    message: str
    severity: str = "warning"
    phase: str = "forward"
    op: str = ""
    #: what part of a recipe resolves it (:data:`ampcourse.doctor.verdict.FIXES`): "islands", "scaler",
    #: "master_weights", "loss_fp32", "fp32_first" or "" (the code must change)
    fix: str = ""

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
    """What examine() measured and advises. Display it in Jupyter, print it, plot it or save it as JSON.

    ``verdicts[p]`` is a :class:`~ampcourse.doctor.verdict.Verdict` (also a mapping: ``verdicts[p]["status"]``),
    derived from every finding by :func:`ampcourse.doctor.verdict.decide`; its status is one of "clean", "islands"
    (clean once ``fp32_modules`` run in fp32), "refused" and "unsupported" (with ``"reason"``); its
    ``confirmation`` says whether the recipe trained like fp32. ``headline`` is the first line; ``advice`` a list of
    sentences; ``master_weights`` whether the recommendation needs fp32 master weights.
    """

    findings: list[Finding]
    recommended_precision: str
    recommended_init_scale: float
    fp32_modules: list[str]
    device: str
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)  # per precision: status, islands, loss
    gradients: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    modules: list[dict[str, Any]] = field(default_factory=list)  # per module call, in the order they finish
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    headline: str = ""
    master_weights: bool = False
    steps: int = 0  # training steps each recipe was confirmed over (0: the forensic pass)
    confirmation: dict[str, Any] = field(default_factory=dict)  # how the recipes were trained (optimizer, steps, ...)
    policy: str | None = None  # whose autocast lists it measured under: "cpu", "cuda", "cuda (emulated on cpu)"

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

    def is_clean(self, precision: str) -> bool:
        """True only when precision's verdict is "clean": the model as it is ran, and no error or warning concerns it
        (its own, the optimizer's and the model's, fp32's): the verdicts are derived from the findings
        (:func:`ampcourse.doctor.verdict.decide`). "islands" is not clean: the model needs its fp32 modules first.

        Args:
            precision: "fp16" or "bf16" (or the torch dtype).

        Example::

            >>> report.is_clean("bf16")
            True
        """
        p = parse_precision(precision)
        v = self.verdicts.get(p)
        return v is not None and v.get("status") == "clean"

    def policy_snippet(self, precision: str | None = None) -> str:
        """Code that applies the fp32 islands for precision (default: the recommended one), with ampcourse.policy and
        in plain PyTorch; when there are none, a comment that says why."""
        p = self.recommended_precision if precision is None else parse_precision(precision)
        v = self.verdicts.get(p, {})
        names = self.fp32_modules if precision is None else v.get("fp32_modules", [])
        if not names:
            status = v.get("status", "not examined")
            why = {"clean": f"{p} ran clean: no module needs fp32",
                   "refused": f"no set of fp32 islands made {p} clean (see the findings)",
                   "unsupported": f"{p} could not run here ({v.get('reason', '')})"}.get(status, f"{p}: {status}")
            return f"# no fp32 islands: {why}"
        rules = ", ".join(f"{n!r}: 'fp32'" for n in names)
        lines = [f"# fp32 islands for {p} autocast, with ampcourse.policy:",
                 "from ampcourse.policy import apply_policy",
                 f"apply_policy(model, {{{rules}}})",
                 "# or in plain PyTorch: run each island's forward outside autocast on fp32 inputs",
                 "import functools, itertools, torch",
                 "def fp32_forward(module, forward, *args, **kwargs):",
                 "    cast = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t",
                 "    # the device from the island's own parameters (keyword-only calls have no args to read it from)",
                 "    t = next(itertools.chain(module.parameters(), module.buffers(),",
                 "                             (a for a in (*args, *kwargs.values()) if torch.is_tensor(a))), None)",
                 "    with torch.autocast(device_type=t.device.type if t is not None else 'cpu', enabled=False):",
                 "        return forward(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})",
                 f"for name in {list(names)!r}:",
                 "    m = model.get_submodule(name)",
                 "    m.forward = functools.partial(fp32_forward, m, m.forward)"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready Python values."""
        return json.loads(json.dumps({
            "device": self.device, "policy": self.policy, "recommended_precision": self.recommended_precision,
            "recommended_init_scale": self.recommended_init_scale, "fp32_modules": self.fp32_modules,
            "findings": [f.to_dict() for f in self.findings], "advice": self.advice, "notes": self.notes,
            "headline": self.headline, "master_weights": self.master_weights, "steps": self.steps,
            "confirmation": self.confirmation,
            "verdicts": {p: _plain(v) for p, v in self.verdicts.items()}, "gradients": self.gradients,
            "optimizer": _plain(self.optimizer), "modules": self.modules}, default=_json_default))

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
        from .render import text
        return text(self)

    def __repr__(self) -> str:
        return self.summary()

    def to_html(self, page: bool = False) -> str:
        """The report as HTML: the fragment Jupyter shows (``page=False``), or a whole page to save (``page=True``).

        Args:
            page: wrap the fragment in an HTML document (what ``--html report.html`` writes).

        Example:
            >>> open("report.html", "w").write(report.to_html(page=True))
        """
        from .render import html_page
        body = html_page(self)
        if not page:
            return body
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>AMP doctor</title></head>"
                f"<body>{body}</body></html>\n")

    def _repr_html_(self) -> str:
        """An HTML summary for Jupyter."""
        return self.to_html()

    def plot(self, ax=None):
        """Per module: the log2 range of its outputs (fp32 run) and output gradients against fp16's and bf16's windows."""
        from .render import plot
        return plot(self, ax)


def _json_default(obj):
    """JSON fallback for numbers numpy/torch hand back."""
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return _json_number(float(obj))
    return str(obj)
