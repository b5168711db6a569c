"""The command line: ``python -m ampcourse.doctor --model NAME|package.module:factory [--out F --html F]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.nn as nn

from .. import _args
from ..device import pick
from .core import examine

__all__ = ["main", "CliError"]

class CliError(Exception):
    """A problem with the command line's input, reported as one line."""


def _reference_setup(name: str, batch: int, seed: int):
    """(model, inputs, targets, loss_fn, optimizer) for a reference model of ampcourse.models."""
    from ..models import make_task
    task = make_task(name, n=batch, seed=seed)
    x, y = task.data.tensors
    return task.model, x, y, task.loss_fn, torch.optim.AdamW(task.model.parameters(), lr=1e-3)


def _factory_setup(spec: str):
    """Import 'pkg.mod:factory', call it, and check it returned (model, inputs, targets, loss_fn[, optimizer]).

    The contract is shared with trial's --model (``_args.load_factory``); its errors are this CLI's CliError.
    """
    try:
        return _args.load_factory(spec, "--model")
    except ValueError as err:
        raise CliError(str(err)) from err.__cause__


def _writable(named) -> None:
    """Check before the work that each report can be written and no two name one file (_args.output_files: a device
    such as /dev/full gets a probe byte), as one CLI error line."""
    try:
        _args.output_files(named)
    except ValueError as err:
        raise CliError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.doctor."""
    from ..models import MODELS
    ap = _args.OneLineParser(prog="python -m ampcourse.doctor", description=__doc__.split("\n\n")[0],
                             error_prefix="ampcourse.doctor", formatter_class=_args.HelpFormatter)
    ap.add_argument("--model", required=True,
                    help=f"a reference model ({', '.join(MODELS)}) or 'package.module:factory', a callable returning "
                         "(model, inputs, targets, loss_fn) or (..., optimizer)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    ap.add_argument("--policy", default=None, choices=["cuda"],
                    help="cuda: CUDA's autocast lists on a CPU (emulated) (default: the device's own lists)")
    # --precision (train, bench), --batch-size (trial), --global-batch-size (train) too: a learner's guess works
    ap.add_argument("--precisions", "--precision", default="fp16,bf16",
                    help="comma-separated, from fp16 and bf16 (default: both)")
    ap.add_argument("--batch", "--batch-size", "--global-batch-size", dest="batch", type=int, default=16,
                    help="batch size for a reference model (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed for a reference model (default 0)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps that confirm each recipe beside fp32 (default 10); 0: the quick forensic "
                         "pass, whose verdicts say 'unconfirmed'")
    ap.add_argument("--out", default=None, help="write the report as JSON here (default: not written)")
    ap.add_argument("--html", default=None, help="write the report as an HTML page here (default: not written)")
    return ap


#: examine()'s argument names as this command line spells them (batch: the reference model's batch size).
_FLAGS = {name: f"--{name}" for name in ("device", "seed", "steps", "precisions", "policy", "batch")}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor from the command line; 0 on success, 2 with one line on stderr for bad input."""
    from ..models import MODELS
    args = _parser().parse_or_status(argv)
    if isinstance(args, int):  # --help (0), or a bad flag (2) whose one line is already on stderr
        return args
    try:
        if args.steps is not None and args.steps < 0:
            raise CliError(f"--steps must be >= 0 (0: the forensic pass), got {args.steps}")
        _writable([("--out", args.out), ("--html", args.html)])  # before the work, not after it
        if args.model in MODELS:
            if args.batch < 1:
                raise CliError(f"--batch must be >= 1, got {args.batch}")
            _args.seed(args.seed, "--seed")
            try:
                model, inputs, targets, loss_fn, opt = _reference_setup(args.model, args.batch, args.seed)
            except ValueError as err:  # too large a batch for the synthetic data: name the flag
                raise CliError(f"--batch {args.batch}: {err}") from None
        else:
            model, inputs, targets, loss_fn, opt = _factory_setup(args.model)
        if not isinstance(model, nn.Module):
            raise CliError(f"--model {args.model!r}: the first item must be an nn.Module, got {type(model).__name__}")
        dev = pick(args.device, "fp32").device
        model.to(dev)  # the command line owns this model: moving it is fine (examine itself never moves one)
        precisions = [p for p in args.precisions.split(",") if p.strip()]
        steps = {} if args.steps is None else {"steps": args.steps}
        report = examine(model, inputs, targets, loss_fn=loss_fn, optimizer=opt, device=dev, precisions=precisions,
                         policy=args.policy, **steps)
        print(report.summary())
        if args.out:
            report.to_json(args.out)
        if args.html:
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(report.to_html(page=True))
    except (CliError, ValueError, TypeError, OSError) as err:  # examine()'s argument names as this CLI's flags
        print(f"ampcourse.doctor: error: {_args.as_flags(str(err), _FLAGS)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 (the learner's model can raise anything: one line, not a traceback)
        first = _args.first_line(err)
        print(f"ampcourse.doctor: error: examining {args.model!r} failed with {type(err).__name__}: {first} "
              "(call ampcourse.doctor.examine in Python to see the traceback)", file=sys.stderr)
        return 2
    return 0
