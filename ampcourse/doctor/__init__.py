"""The AMP doctor: measure how a model behaves in fp16 and bf16, forward, backward and through one optimizer step,
and advise what to do about it.

    >>> from ampcourse.doctor import examine
    >>> report = examine(model, inputs, targets, loss_fn=nn.functional.cross_entropy, optimizer=opt)
    >>> report                        # in Jupyter: HTML, worst findings first, each citing its number
    >>> report.is_clean("fp16"), report.verdicts["bf16"]["status"], report.advice
    >>> print(report.policy_snippet())  # the fp32 islands, with ampcourse.policy and in plain PyTorch
    >>> report.plot(); report.to_json("doctor.json")

From a shell, on a reference model or on a factory of your own that returns
``(model, inputs, targets, loss_fn)`` (optionally a fifth item, the optimizer)::

    python -m ampcourse.doctor --model transformer
    python -m ampcourse.doctor --model mypkg.mymodule:make --device cuda --out report.json --html report.html

What it runs (parameters, buffers, ``.grad``, training flags, the optimizer, the inputs and the torch, CUDA, Python
and NumPy RNG streams are left as they were, bit for bit; every pass starts from cloned inputs and the same RNG
states; gradients on, inference mode and the caller's autocast off, whatever the caller's context):

1. the fp32 reference, forward + backward (on an fp32 copy when the model is already fp16/bf16): per module, log2
   histograms of its outputs and their gradients; every aten op is watched (:mod:`.capture`), so an op written
   inline in a non-leaf module's ``forward`` is seen and attributed to that module;
2. per precision, one forward + backward of the model as it is under ``torch.autocast`` (fp16's backward through a
   real ``torch.amp.GradScaler`` at the recommended scale): the first op whose finite inputs give inf/NaN, in
   forward or in backward (a custom ``autograd.Function``'s backward included), each module's own error (what its
   children do not explain: a leaf rerun in fp32 on the same inputs; a non-leaf module that runs fp16/bf16 compute
   ops inline, and only such a one, rerun twice more, under autocast with its children exact and in fp32, so a
   finite loss in its inline code is pinned on it, "(inline in forward)", with the op where it appears; a call
   handed a stateful object such as a KV cache is rerun on a copy of that object as the call found it, and where
   no copy can be made the report's notes say whose own error was not measured), the output, loss and gradient
   errors against fp32 (each parameter's own gradient too, however small its share: with nothing wrong in forward,
   the modules whose call made a custom ``autograd.Function`` are tried as fp32 islands, since their backward is
   the one code no forward measure sees), and per parameter the share of its gradient that came back zero;
   a pass that raises where fp32 ran (a constant fp16 cannot hold, a dtype check) is an error finding, ``raises``,
   naming the op and module, and that module is tried in fp32 (a missing kernel on this device is ``unsupported``);
3. fp32 islands (:func:`ampcourse.policy.apply_policy`) for the modules named, checked by rerunning both passes;
4. an optimizer audit (:mod:`.audit`): a copy of the optimizer as it is takes two steps (its state stored in its
   own dtype between them, as a fused optimizer stores it); inf/NaN weights, blow-ups and lost updates as separate
   outcomes against fp32 master weights, Adam's second moment underflowing, the loss after the steps;
5. the verdict layer (:mod:`.verdict`): one function turns every finding into each precision's status, the
   recommendation, the headline and the advice. A precision with an error or warning left is never "clean"; an
   optimizer or model finding counts against every recipe that trains those weights; an fp32 failure blames no
   precision; what a recipe needs (fp32 islands, a GradScaler, fp32 master weights) is said;
6. confirmation by training (:mod:`.confirm`): each recipe the verdicts could recommend trains ``steps`` steps
   (default 10) beside one fp32 reference on copies, with :func:`ampcourse.trial.trial`; one that departs
   (inf/NaN, or a loss gap beyond max(5%, fp32's own step-to-step noise)) is a ``training_departs`` finding and is
   not recommended. ``steps=0`` is the forensic pass: its verdicts say "unconfirmed".

How to read a report (``print(report)``)::

    AMP doctor on cpu: use bf16, no GradScaler (confirmed over 10 training steps beside fp32 ...)
      fp16: refused (1 finding(s) no recipe here resolves, first nonfinite in 'block')   <- the verdict per precision
      bf16: clean (confirmed over 10 training steps ...; tolerances module 0.0625, output 0.25, ...)
    2 error(s), 0 warning(s), 3 note(s):
      [error] nonfinite (fp16, forward, 'block', aten::mul): 'block' (inline in forward): aten::mul turns finite
              inputs (max |x| 412) into inf/NaN under fp16 autocast (output float16); in fp32 it reaches 1.7e+05 ...
    advice:
      - Use bf16 autocast: ...

Each finding says what (``kind``), where (``module``: a quoted qualified name, '' for the whole model; ``phase``:
forward, backward, optimizer or model; ``op``: the aten op), in which precision, the number it rests on
(``value``), what to do, and which part of a recipe fixes it (``fix``). ``report.is_clean(p)`` is True only when
p's verdict is "clean": it ran, and no error or warning concerns it.

Adding a finding kind: add its name to :data:`KINDS` (``vocab.py``, the report's vocabulary; the order is the sort order within one
severity), then write a rule in ``rules.py`` with the one shape every rule has, ``def my_rule(ev: Evidence) ->
list[Finding]``, reading what the passes measured (``ev.passes[p]``, ``ev.ctx``, ``ev.audit``), and append it to
``rules.RULES``. If the rule needs a measurement no pass takes yet, add it to ``capture.py`` (a module hook or the
op watcher) and store it on the pass's result. Add a test that plants the problem and one that shows a healthy model
does not trip it.

Layout: :mod:`.hist` (histograms), :mod:`.capture` (hooks, op dispatch, the passes), :mod:`.audit` (optimizer),
:mod:`.rules` (findings), :mod:`.verdict` (verdicts, headline), :mod:`.confirm` (training), :mod:`.report` (data),
:mod:`.render` (text, HTML, plot), :mod:`.cli` (command line), :mod:`.core` (examine).
"""

from __future__ import annotations

from .capture import _EXACT, OpEvent
from .capture import rel_error as _rel_error
from .cli import main
from .core import examine
from .hist import COUNT_CAP, Log2Hist, _Counter
from .report import KINDS, PHASES, SEVERITIES, Finding, Report
from .rules import GRAD_MARGIN, GRAD_TOL, LOSS_TOL, OUTPUT_TOL, REL_TOL
from .verdict import Confirmation, Verdict, decide

__all__ = ["examine", "Report", "Finding", "Log2Hist", "KINDS", "SEVERITIES", "REL_TOL", "main", "PHASES",
           "OUTPUT_TOL", "LOSS_TOL", "GRAD_TOL", "OpEvent", "Verdict", "Confirmation", "decide"]
