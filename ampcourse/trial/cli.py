"""``python -m ampcourse.trial`` (chapter 10): a trial from a shell; its summary on stdout, ``--out`` JSON, ``--plot``.

Every error is one line ``ampcourse.trial: error: ...`` on stderr and exit status 2; the output files are checked
before any step runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.nn as nn

from .. import _args, models
from .result import PRECISIONS
from .runs import trial

__all__ = ["main"]

def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.trial."""
    about = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package's first paragraph says what it does
    ap = _args.OneLineParser(prog="python -m ampcourse.trial", description=about,
                             error_prefix="ampcourse.trial", formatter_class=_args.HelpFormatter)
    ap.add_argument("--model", required=True,
                    help=f"a reference model ({', '.join(models.MODELS)}) or 'package.module:factory', a callable "
                         "returning (model, inputs, targets, loss_fn) or (..., optimizer), as the doctor takes")
    # --precision too: train's and bench's spelling, so a learner's guess works
    ap.add_argument("--precisions", "--precision", default="bf16",
                    help=f"comma-separated, from {', '.join(PRECISIONS)} (default bf16)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    # --batch (doctor, plan) and --global-batch-size (train) too
    ap.add_argument("--batch-size", "--batch", "--global-batch-size", dest="batch_size", type=int, default=None,
                    help=f"samples per step (default {_BATCH}, or all of a factory's inputs if fewer)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="relative gap that counts as a departure (0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and dropout (default 0)")
    ap.add_argument("--size", default="tiny", help=f"reference model size: {', '.join(models.SIZES)} (default tiny)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    ap.add_argument("--policy", default=None, choices=["cuda"],
                    help="cuda: CUDA's autocast lists on a CPU (emulated) (default: the device's own lists)")
    ap.add_argument("--out", default=None, help="write the trial as JSON here (default: not written)")
    ap.add_argument("--plot", default=None, help="save the plot (PNG) here (default: not drawn)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar on stderr (shown by default)")
    return ap


#: trial()'s batch size when --batch-size is not given (its own default for tensor data).
_BATCH = 32

#: trial()'s argument names as this command line spells them: its checks name the Python argument.
_FLAGS = {**_args.COMMON_FLAGS, "batch_size": "--batch-size", "tolerance": "--tolerance"}


def _factory_run(spec: str, batch_size: int | None) -> dict:
    """trial()'s arguments for --model 'package.module:factory' (the doctor's contract, _args.load_factory)."""
    model, inputs, targets, loss_fn, opt = _args.load_factory(spec, "--model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: the first item must be an nn.Module, got {type(model).__name__}")
    kw = {"model_factory": lambda: model, "data": (inputs, targets), "loss_fn": loss_fn,  # trial deep-copies it
          "batch_size": batch_size if batch_size is not None else min(_BATCH, len(inputs))}
    if opt is not None:  # the factory's optimizer, rebuilt for each run's copy with the same settings
        kw["optimizer_factory"] = lambda params: type(opt)(params, **opt.defaults)
    return kw


def _check_plot_format(path: str) -> None:
    """ValueError unless matplotlib can save a figure in the format `path`'s suffix names (no suffix: PNG)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        return
    from matplotlib.figure import Figure
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"--plot {path!r}: matplotlib cannot write .{suffix} files; "
                         f"end the name with one of {', '.join('.' + f for f in sorted(formats))} (e.g. trial.png)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run a trial from the command line; 0 on success, 2 with one line on stderr for bad input."""
    args = _parser().parse_or_status(argv)
    if isinstance(args, int):  # --help (0), or a bad flag (2) whose one line is already on stderr
        return args
    try:
        _args.output_files([("--out", args.out), ("--plot", args.plot)])  # before the work, not after it
        if args.plot is not None:
            _check_plot_format(args.plot)  # an unknown suffix fails now, not after every step has run
        if args.model in models.MODELS:
            run = {"model_factory": args.model, "size": args.size,
                   "batch_size": _BATCH if args.batch_size is None else args.batch_size}
        elif ":" in args.model:
            run = _factory_run(args.model, args.batch_size)
        else:
            raise ValueError(f"--model must be one of {', '.join(models.MODELS)} or 'package.module:factory', "
                             f"got {args.model!r}")
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        t = trial(precisions=precisions, steps=args.steps, lr=args.lr, tolerance=args.tolerance, seed=args.seed,
                  device=args.device, policy=args.policy, progress=args.progress, **run)
        print(t.summary())
        if args.out:
            t.to_json(args.out)
        if args.plot:
            import matplotlib
            matplotlib.use("Agg")
            t.plot().savefig(args.plot)
    except (ValueError, TypeError, OSError) as err:
        print(f"ampcourse.trial: error: {_args.as_flags(_args.first_line(err), _FLAGS)}", file=sys.stderr)
        return 2
    return 0
