"""The AMP doctor: how a model behaves in fp16 and bf16, forward, backward and through an optimizer step, and what
to do about it.

    >>> from ampcourse.doctor import examine
    >>> report = examine(model, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=opt)
    >>> report.recommended_precision, report.is_clean("fp16"), report.advice
    >>> print(report.policy_snippet())  # the fp32 islands it recommends

From a shell: ``python -m ampcourse.doctor --model transformer`` (or ``--model mypkg.mod:make`` for a factory of
your own; ``--steps 0`` for the forensic pass alone).

What it runs: an fp32 reference, then per precision one forward + backward under autocast with every module call
and every aten op watched (inf/NaN origins, each module's own error, gradients against fp32), fp32 islands where a
precision is not clean, an audit of the optimizer's step, verdicts from all the findings, and by default a
confirmation that trains each candidate recipe ``steps`` steps beside fp32. The model, its optimizer, the inputs
and every RNG stream are left as they were.

Where each concern lives:

- :mod:`.core`: ``examine()`` itself; :mod:`.cli`: the command line;
- :mod:`.calls`: argument checks and calling the model; :mod:`.snapshot`: saving and restoring its state;
- :mod:`.watch`: what a pass records (module hooks, the op watcher, the reruns); :mod:`.hist`: log2 histograms;
- :mod:`.passes`: the reference, autocast and gradient passes;
- :mod:`.audit`: the optimizer; :mod:`.scales`: the loss-scale numbers; :mod:`.rules`: findings;
  :mod:`.verdict`: verdicts and the headline;
  :mod:`.confirm`: training the recipes;
- :mod:`.report`, :mod:`.vocab`: the report's data and words; :mod:`.render`: text, HTML, plot.

Adding a finding kind: name it in ``vocab.KINDS``, write a rule ``def my_rule(ev: Evidence) -> list[Finding]`` in
``rules.py`` and append it to ``rules.RULES``; a measurement no pass takes yet goes in ``watch.py``. Test the
planted problem, and a healthy model that does not trip it.
"""

from __future__ import annotations

from .calls import rel_error as _rel_error
from .cli import main
from .core import examine
from .hist import COUNT_CAP, Log2Hist, _Counter
from .report import KINDS, PHASES, SEVERITIES, Finding, Report
from .rules import GRAD_MARGIN, GRAD_TOL, LOSS_TOL, OUTPUT_TOL, REL_TOL
from .verdict import Confirmation, Verdict, decide
from .watch import _EXACT, OpEvent

__all__ = ["examine", "Report", "Finding", "Log2Hist", "KINDS", "SEVERITIES", "REL_TOL", "main", "PHASES",
           "OUTPUT_TOL", "LOSS_TOL", "GRAD_TOL", "OpEvent", "Verdict", "Confirmation", "decide"]
