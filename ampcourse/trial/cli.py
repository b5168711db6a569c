"""``python -m ampcourse.trial`` (chapter 10): a trial from a shell; its summary on stdout, ``--out`` JSON, ``--plot``.

Every error is one line ``ampcourse.trial: error: ...`` on stderr and exit status 2; the output files are checked
before any step runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .. import _args, models
from .result import PRECISIONS
from .runs import trial

__all__ = ["main"]

def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.trial."""
    about = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package's first paragraph says what it does
    ap = _args.OneLineParser(prog="python -m ampcourse.trial", description=about,
                             error_prefix="ampcourse.trial", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"a reference model: {', '.join(models.MODELS)}")
    ap.add_argument("--precisions", default="bf16",
                    help=f"comma-separated, from {', '.join(PRECISIONS)} (default bf16)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    ap.add_argument("--tolerance", type=float, default=0.1, help="relative gap that counts as a departure (0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the model, the batches and dropout (default 0)")
    ap.add_argument("--size", default="tiny", help=f"reference model size: {', '.join(models.SIZES)} (default tiny)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    ap.add_argument("--policy", default=None, choices=["cuda"], help="cuda: CUDA's autocast lists on a CPU (emulated)")
    ap.add_argument("--out", default=None, help="write the trial as JSON here")
    ap.add_argument("--plot", default=None, help="save the plot (PNG) here")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar on stderr (shown by default)")
    return ap


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
        if args.model not in models.MODELS:
            raise ValueError(f"--model must be one of {', '.join(models.MODELS)}, got {args.model!r}")
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        t = trial(args.model, precisions=precisions, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                  tolerance=args.tolerance, seed=args.seed, size=args.size, device=args.device,
                  policy=args.policy, progress=args.progress)
        print(t.summary())
        if args.out:
            t.to_json(args.out)
        if args.plot:
            import matplotlib
            matplotlib.use("Agg")
            t.plot().savefig(args.plot)
    except (ValueError, TypeError, OSError) as err:
        print(f"ampcourse.trial: error: {_args.first_line(err)}", file=sys.stderr)
        return 2
    return 0
