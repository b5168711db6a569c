"""The report's vocabulary: finding kinds, severities, phases, verdict statuses, and how a module name is written.

A leaf module: the report (data) and its renderers both read it, so neither imports the other to get it.
"""

from __future__ import annotations

#: Every kind of finding, in the order the report sorts them within one severity. Add a kind here and a rule in
#: rules.RULES that returns Findings of it (see the package docstring).
KINDS = ("raises", "nonfinite", "backward_nonfinite", "activation_overflow", "precision_loss", "output_error", "loss_gap",
         "gradient_error", "gradient_overflow", "gradient_underflow", "layer_gradient_underflow",
         "optimizer_nonfinite", "optimizer_blowup", "lost_updates", "second_moment_underflow", "eps_underflow", "low_precision_model",
         "no_low_precision", "training_departs", "scaler_needed", "no_scaler_needed")
SEVERITIES = ("error", "warning", "info")
#: Where a finding was measured: a forward pass, a backward pass, the optimizer step, or the model as a whole.
PHASES = ("forward", "backward", "optimizer", "model")
#: Verdict statuses: ran with nothing to fix, ran clean once fp32 islands were added, no fix found, could not run.
STATUSES = ("clean", "islands", "refused", "unsupported")


def quoted(name: str) -> str:
    """A module or parameter name as the report writes it: quoted ('0' is a name, not a number); '' is the model."""
    return f"'{name}'" if name else "the model"


def Quoted(name: str) -> str:  # noqa: N802 (the capitalised twin of quoted, for the start of a sentence)
    """quoted(name) at the start of a sentence: "The model" for ''; a quoted name keeps its own letters (str.capitalize
    would lower-case the rest: 'blocks.0.selfAttn' -> 'blocks.0.selfattn')."""
    q = quoted(name)
    return q[:1].upper() + q[1:]
