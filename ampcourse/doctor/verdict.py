"""The verdict layer: every finding (forward, backward, optimizer, model) turned, in one place, into each precision's
status, the recommendation, the headline and the advice.

A leaf of the doctor beside :mod:`.report` (which it imports): the rules only measure and word findings; what a
learner acts on is derived here, so the headline, the verdicts and the findings under them cannot disagree.

Which findings count against which recipe (:func:`affects`):

* a forward or backward finding counts against the precision it was measured in (``finding.precision``);
* an optimizer or model finding is about the weights and the optimizer state as they are (its ``precision`` is the
  dtype that was measured: fp16 *weights* are not fp16 *autocast*), so it counts against every autocast recipe that
  trains those weights: all of them, until fp32 master weights are part of the recipe;
* an fp32 finding (the reference itself is inf/NaN) is not a precision problem: no precision is judged until fp32
  is fixed;
* a recipe that departed from fp32 when trained (``training_departs``) counts against that precision alone.

A finding says which part of a recipe resolves it (``finding.fix``): ``islands`` (the fp32 modules the verdict
names, checked by a rerun), ``scaler`` (fp16's GradScaler at the recommended scale), ``master_weights`` (fp32
trainable parameters + autocast), ``loss_fp32`` (the loss computed outside autocast) or nothing. A precision whose
error or warning findings are not all resolved by its recipe is never "clean".

    >>> from ampcourse.doctor.verdict import Verdict
    >>> v = Verdict("fp16", "clean")
    >>> v["status"], v.get("fp32_modules"), v.get("reason", "")
    ('clean', [], '')
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .vocab import STATUSES, quoted

__all__ = ["Verdict", "Confirmation", "Decision", "affects", "decide", "headline_of", "refused_model_wide", "FIXES"]

#: What part of a recipe resolves a finding ("" = nothing the doctor can add: fix the code).
FIXES = ("", "islands", "scaler", "master_weights", "loss_fp32", "fp32_first")


class _FieldMapping(Mapping):
    """Read a frozen dataclass as a read-only mapping of its fields (those that are not None), so code written
    for the dict it replaces (``v["status"]``, ``v.get("fp32_modules")``, ``"reason" in v``) keeps working."""

    _ALIASES: dict[str, str] = {}

    def _names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        name = self._ALIASES.get(key, key)
        if not isinstance(name, str) or name not in {f.name for f in fields(self)}:
            raise KeyError(key)
        value = getattr(self, name)
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        inverse = {v: k for k, v in self._ALIASES.items()}
        return iter(inverse.get(n, n) for n in self._names())

    def __len__(self) -> int:
        return len(self._names())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (nested mappings too)."""
        return {k: _plain(v) for k, v in self.items()}


def _lower_first(text: str) -> str:
    """'The model ...' -> 'the model ...' (a finding's message inside a sentence); quoted names keep their case."""
    return text[:1].lower() + text[1:] if text[:1].isalpha() and text[1:2].islower() else text


def _plain(v: Any) -> Any:
    if isinstance(v, _FieldMapping):
        return v.to_dict()
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


@dataclass(frozen=True, eq=False)
class Confirmation(_FieldMapping):
    """Whether a recipe trained like fp32 over ``steps`` steps (:mod:`.confirm`), or why it was not tried.

    ``status``: "confirmed", "departed" (at ``step``, by ``measure``: "loss" or "non-finite"), or "unconfirmed"
    (``steps`` = 0, the forensic pass; or ``reason`` says why it could not be trained).
    """

    status: str
    steps: int = 0
    step: int | None = None
    measure: str | None = None
    gap: float | None = None
    tolerance: float | None = None
    loss: float | None = None
    ref_loss: float | None = None
    skipped: int | None = None
    recipe: str | None = None
    reason: str | None = None
    #: where a departed run breaks: the forensic pass re-run at that run's weights from just before the departure
    #: (:func:`.confirm.locate`): module, op, kind, phase, value, message, and ``weights_step`` (the step whose
    #: weights were examined); None when it did not depart or nothing was named there
    culprit: dict[str, Any] | None = None

    def sentence(self) -> str:
        """'confirmed over 10 steps', 'departs from fp32 at step 4 (loss 61% apart; tolerance 5%)', 'unconfirmed'."""
        if self.status == "confirmed":
            return (f"confirmed over {self.steps} training steps beside fp32 (final loss {self.loss:.4g} against "
                    f"{self.ref_loss:.4g}; tolerance {self.tolerance:.3g})")
        if self.status == "departed":
            what = ("a non-finite loss" if self.measure == "non-finite" else
                    f"loss {self.gap:.1%} apart from fp32's (tolerance {self.tolerance:.1%})")
            where = ""
            if self.culprit:
                c = self.culprit
                where = ((f"; its loss is inf/NaN from step {c['nonfinite_step']}" if "nonfinite_step" in c else "")
                         + f"; examined at that run's weights of step {c['weights_step']}: "
                         f"{_lower_first(c['message']).rstrip('.')}")
            return f"departs from fp32 at step {self.step} of {self.steps} ({what}){where}"
        return "unconfirmed" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True, eq=False)
class Verdict(_FieldMapping):
    """One precision's verdict, derived from every finding that concerns it (see the module docstring).

    ``status`` is one of :data:`~ampcourse.doctor.vocab.STATUSES`: "clean" (nothing to fix: its confirmation by
    training is in ``confirmation``), "islands" (clean once ``fp32_modules`` run in fp32), "refused" (``reason``
    says what is left) or "unsupported" (``reason``: this device cannot run it for this model).
    ``master_weights``: the recipe needs fp32 master weights (the findings against it are about low-precision
    weights or optimizer state). ``blockers``: the error/warning findings left unresolved, as kind@module.
    """

    precision: str
    status: str
    fp32_modules: list[str] = field(default_factory=list)
    tried_fp32_modules: list[str] | None = None
    reason: str | None = None
    measured: str | None = None  # the status the passes alone gave (before the findings and the training)
    blockers: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)  # recipe parts its findings need: "master_weights", "scaler"
    master_weights: bool = False
    scale: float | None = None
    loss: float | None = None
    loss_with_islands: float | None = None
    output_error: float | None = None
    loss_gap: float | None = None
    native: bool | None = None
    units: str | None = None
    raised: dict[str, Any] | None = None
    no_low_precision: bool | None = None
    tolerances: dict[str, float] | None = None
    confirmation: Confirmation | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def confirmed(self) -> bool:
        """Trained beside fp32 without departing."""
        return self.confirmation is not None and self.confirmation.status == "confirmed"

    def line(self) -> str:
        """'fp16: clean (confirmed over 10 steps ...)' for the report's verdict lines."""
        extra = []
        recipe = self.confirmation.recipe if self.confirmation is not None else None
        if self.status in ("clean", "islands") and recipe and "GradScaler(" in recipe:
            # the recipe it is clean with: fp16 trained through a GradScaler ('fp16: clean' alone reads as no scaler)
            extra.append("with " + next(part for part in recipe.split(", ") if part.startswith("GradScaler(")))
        if self.fp32_modules:
            extra.append("fp32 modules " + ", ".join(quoted(n) for n in self.fp32_modules))
        if self.reason:
            extra.append(self.reason)
        if self.status in ("clean", "islands") and self.confirmation is not None:
            extra.append(self.confirmation.sentence())
        elif self.status == "refused" and self.confirmation is not None and self.confirmation.status != "unconfirmed":
            # refused as it is, with what its findings need (a GradScaler, master weights) trained: say how that went,
            # or 'refused' above a recipe training confirmed reads as 'fp16 does not work'
            said = self.confirmation.sentence()
            if self.confirmation.status == "confirmed":
                extra.append(f"with its recipe ({recipe}): {said}" if recipe else said)
            elif said not in (self.reason or ""):
                extra.append(f"its recipe ({recipe}) {said}" if recipe else said)
        if self.tolerances and self.status in ("clean", "islands"):
            extra.append("tolerances " + ", ".join(f"{k} {v:.3g}" for k, v in self.tolerances.items()))
        return f"{self.precision}: {self.status}" + (f" ({'; '.join(extra)})" if extra else "")


def affects(f, precision: str) -> bool:
    """Whether finding f counts against the recipe of precision (see the module docstring)."""
    if f.kind == "training_departs":  # one recipe's training: that recipe's alone
        return f.precision == precision
    if f.precision == "fp32" or f.phase in ("optimizer", "model"):
        return True
    return f.precision == precision


def _blocking(f) -> bool:
    return f.severity in ("error", "warning")


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` derives: the verdicts, the recommendation, the headline and whether fp32 itself fails."""

    verdicts: dict[str, Verdict]
    recommended: str
    fp32_modules: list[str]
    master_weights: bool
    fp32_fails: bool
    headline: str


def _resolved(f, raw: Mapping[str, Any], recipe: set[str]) -> bool:
    """Whether the recipe resolves finding f: an island the verdict names and a rerun checked (every forward and
    backward finding of the first pass, since the pass with islands came back clean), the scaler, master weights."""
    if f.fix == "islands":
        return raw.get("status") == "islands"
    return bool(f.fix) and f.fix in recipe


def _partition(p: str, v: Mapping[str, Any], findings: list, low_trainable: str | None) -> tuple[list, list, list]:
    """(resolved by fp32 master weights, resolved by the GradScaler, left unresolved): precision p's error and
    warning findings (fp32's own aside), split by what part of a recipe resolves them."""
    mine = [f for f in findings if _blocking(f) and affects(f, p) and f.precision != "fp32"]
    # what a recipe component resolves: fp32 master weights (a GradScaler too, when the trainable parameters are
    # fp16: it refuses to unscale fp16 gradients), the GradScaler at the recommended scale
    master = [f for f in mine if f.fix == "master_weights"
              or (f.fix == "scaler" and p == "fp16" and low_trainable == "fp16")]
    scaler = [f for f in mine if f.fix == "scaler" and f not in master]
    left = [f for f in mine if f not in master and f not in scaler and not _resolved(f, v, set())]
    return master, scaler, left


def refused_model_wide(p: str, raw: Mapping[str, Any], verdict: Verdict, findings: list,
                       low_trainable: str | None) -> bool:
    """Whether precision p is refused by model-wide findings alone (no module or parameter named among those no
    recipe resolves) while its passes ran clean or with islands: training its recipe is the only way left to name
    where it breaks (:func:`.confirm.confirm` trains it, to locate a departure, never to recommend it).

    Example::

        >>> from ampcourse.doctor.report import Finding
        >>> f = Finding("gradient_underflow", "", "fp16", 0.02, "msg", "warning", "backward")
        >>> refused_model_wide("fp16", {"status": "clean"}, Verdict("fp16", "refused"), [f], None)
        True
    """
    if verdict.status != "refused" or raw.get("status") not in ("clean", "islands"):
        return False
    if any(f.precision == "fp32" and f.severity == "error" for f in findings):
        return False
    _, _, left = _partition(p, raw, findings, low_trainable)
    return bool(left) and all(not f.module and f.kind != "training_departs" for f in left)


def decide(raw: Mapping[str, Mapping[str, Any]], findings: list, *, device: str, default: str, scale: float,
           low_trainable: str | None, tolerances: Mapping[str, Mapping[str, float]] | None = None,
           confirmations: Mapping[str, Confirmation] | None = None, state_only: bool = False) -> Decision:
    """Each precision's verdict from its passes (``raw``) and every finding, then the recommendation and headline.

    Args:
        raw: per precision, what the passes measured (status, fp32_modules, loss, ...), as core builds it.
        findings: every finding, worst first.
        device: "cpu", "cuda:0" (for the headline).
        default: the precision ampcourse.device.pick() prefers on this device (a tie-break).
        scale: the recommended fp16 init_scale.
        low_trainable: "fp16"/"bf16" when the trainable parameters are in that format (GradScaler cannot unscale
            fp16 gradients; the recipe then needs master weights for a scaler), else None.
        tolerances: per precision, the tolerances its "clean" allows (printed with the verdict).
        confirmations: per precision, the training confirmation of its recipe (None: not tried yet).
        state_only: the weights are fp32 already and only the optimizer's state is low: the recipe keeps the state
            in fp32 (the headline says so instead of "master weights").

    Returns:
        a :class:`Decision`.

    Example::

        d = decide({"bf16": {"status": "clean"}}, [], device="cpu", default="bf16", scale=2.0**16,
                   low_trainable=None)
        d.recommended, d.verdicts["bf16"]["status"], d.headline
    """
    confirmations = confirmations or {}
    fp32_fails = any(f.precision == "fp32" and f.severity == "error" and f.phase in ("forward", "backward")
                     for f in findings)
    verdicts: dict[str, Verdict] = {}
    for p, v in raw.items():
        status = v.get("status", "unsupported")
        reason = v.get("reason")
        master, scaler, left = _partition(p, v, findings, low_trainable)
        needs = (["master_weights"] if master else []) + (["scaler"] if scaler else [])
        blockers = [f"{f.kind}@{f.module or '(model)'}" for f in left + master + scaler]
        tried = list(v.get("tried_fp32_modules") or [])
        if status == "refused" and not reason and (tried or not left):
            # the passes' own refusal: the islands it tried did not make it clean (with none tried, the findings
            # left say why: "no set of islands" would claim a search that named nothing to try)
            reason = ("no set of fp32 islands made it clean" + (f" (tried {', '.join(quoted(n) for n in tried)})"
                                                                 if tried else ""))
        if status == "unsupported":
            pass
        elif fp32_fails:
            status, reason = "refused", ("fp32 itself fails (see the fp32 finding): not a precision problem; fix "
                                         "it first, then examine again")
        elif left:
            worst = left[0]
            status = "refused"
            # a precision_loss of module '' is the model's own top-level code (no island can hold it): say where
            reason = reason or (f"{len(left)} finding(s) no recipe here resolves, first {worst.kind}"
                                + (f" in {quoted(worst.module)}" if worst.module else
                                   " in the model's own code (its forward, outside any submodule)"
                                   if worst.kind == "precision_loss" else ""))
        elif needs:
            first = (master + scaler)[0]
            status = "refused"
            what = {"master_weights": "fp32 master weights", "scaler": f"GradScaler(init_scale=2**{int(math.log2(scale))})"}
            reason = (f"as it is, {first.kind}" + (f" in {quoted(first.module)}" if first.module else "")
                      + f" ({len(master + scaler)} finding(s)): needs " + " and ".join(what[n] for n in needs))
        conf = confirmations.get(p)
        if conf is not None and conf.status == "departed" and status in ("clean", "islands"):
            status, reason = "refused", f"its recipe {conf.sentence()}"
        keep = {k: v.get(k) for k in ("tried_fp32_modules", "scale", "loss", "loss_with_islands", "output_error",
                                       "loss_gap", "native", "units", "raised", "no_low_precision")}
        if keep["tried_fp32_modules"] is not None:
            keep["tried_fp32_modules"] = list(keep["tried_fp32_modules"])
        verdicts[p] = Verdict(p, status, list(v.get("fp32_modules", [])) if status == "islands" or (
            needs and not left and v.get("status") == "islands") else [], reason=reason,
            measured=v.get("status"), blockers=blockers, needs=needs if not left else [],
            master_weights=bool(master) and not left,
            tolerances=dict(tolerances[p]) if tolerances and p in tolerances else None, confirmation=conf, **keep)
    rec = _choose(verdicts, default)
    if rec in verdicts and _rank(verdicts[rec]) >= 2:
        rec = "fp32"  # nothing examined runs clean, even with what its findings need: the headline says train in fp32
    v = verdicts.get(rec)
    fp32_modules = list(v.fp32_modules) if v is not None else []
    master_weights = bool(v is not None and v.master_weights and _rank(v) == 1)
    # (a recipe that needs a GradScaler is fp16's usual one: the headline names its init_scale either way)
    d = Decision(verdicts, rec, fp32_modules, master_weights, fp32_fails, "")
    return Decision(verdicts, rec, fp32_modules, master_weights, fp32_fails,
                    headline_of(d, device, scale, low_trainable, state_only))


def _rank(v: Verdict) -> int:
    """0: runs as recommended; 1: runs once its recipe adds what its findings need (fp32 master weights, a
    GradScaler at the recommended scale) and that recipe did not depart;
    2: refused; 3: unsupported."""
    if v.status in ("clean", "islands"):
        return 0
    departed = v.confirmation is not None and v.confirmation.status == "departed"
    if v.status == "refused" and v.needs and not departed:
        return 1
    return 2 if v.status == "refused" else 3


def _choose(verdicts: Mapping[str, Verdict], default: str) -> str:
    """Runs as it is beats needs master weights beats refused beats unsupported; clean beats islands; native units;
    the device's default; the name."""
    if not verdicts:
        return default

    def key(p: str) -> tuple:
        v = verdicts[p]
        return _rank(v), len(v.fp32_modules), not v.native, p != default, p
    return min(verdicts, key=key)


def headline_of(d: Decision, device: str, scale: float, low_trainable: str | None, state_only: bool = False) -> str:
    """The first line of the report: what to use, derived from the recommended verdict."""
    head = f"AMP doctor on {device}: "
    v = d.verdicts.get(d.recommended)
    if d.fp32_fails:
        return head + "fp32 itself fails (inf/NaN in the fp32 run): fix that first; no precision is judged until then"
    if d.verdicts and all(_rank(w) == 3 for w in d.verdicts.values()):  # nothing to fix in the model: none could run
        return head + ("no low precision could be examined here (each is unsupported, the reason on its line): train "
                       "in fp32 here")
    if v is None or _rank(v) >= 2:
        return head + "no low precision ran clean here: train in fp32 until the findings are fixed"
    p = d.recommended
    islands = f" with fp32 modules {', '.join(quoted(n) for n in v.fp32_modules)}" if v.fp32_modules else ""
    master = _rank(v) == 1 and v.master_weights
    scaler = (f", GradScaler(init_scale=2**{int(math.log2(scale))})" if p == "fp16" and (low_trainable != "fp16"
                                                                                          or master)
              else ", no GradScaler")
    if _rank(v) == 1 and "scaler" in v.needs:
        scaler += " (needed: without it the findings above stand)"
    first = ("use " if not master else "keep the optimizer's state in fp32, then use " if state_only
             else "keep fp32 master weights (fp32 trainable parameters + autocast), then use ")
    conf = v.confirmation
    tail = ("" if conf is None else f" ({conf.sentence()})" if conf.status == "confirmed"
            else " (unconfirmed: steps=0, the forensic pass)" if conf.steps == 0 and not conf.reason
            else f" ({conf.sentence()})")
    # The triage puts bf16 first only where the hardware has units for it: where it has none, say so on this line,
    # which is all many learners read (the advice says what pick() keeps instead).
    slow = f"; correct here, but no faster than fp32 on this device ({v.units})" if v.native is False and v.units else ""
    return head + first + p + islands + scaler + tail + slow
