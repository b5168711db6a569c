"""The command line: ``python -m ampcourse.plan --model NAME|package.module:factory --gpu KEY [--out F]``.

    python -m ampcourse.plan --model gpt2 --gpu h100-sxm --batch 16 --seq 1024
    python -m ampcourse.plan --model mypkg.models:make --gpu a100-sxm4-80gb --precisions fp32,bf16

A factory is a callable with no arguments returning ``(model, inputs)`` (the model returns its own loss) or
``(model, inputs, loss_fn, targets)``. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence

import torch.nn as nn

from .. import _args
from .capture import NeedsRealValues
from .core import PRECISIONS, plan
from .gpus import GPUS
from .zoo import MAX_SEQ, ZOO, build

__all__ = ["main"]

_PROG = "ampcourse.plan"


class _CliError(Exception):
    """A problem with the command line's input, reported as one line."""


def _factory(spec: str):
    """Import 'pkg.mod:factory', call it, and return (model, inputs, loss_fn, targets)."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise _CliError(f"--model {spec!r}: use one of {', '.join(ZOO)} or 'package.module:factory'")
    if any(c in mod_name for c in "/\\") or mod_name.endswith(".py"):
        raise _CliError(f"--model {spec!r}: the part before ':' must be a module name, not a file path "
                        f"(write --model {os.path.basename(mod_name).removesuffix('.py')}:{attr})")
    try:
        module = importlib.import_module(mod_name)
    except (ImportError, TypeError, ValueError) as err:
        raise _CliError(f"--model {spec!r}: cannot import {mod_name!r} ({err})") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _CliError(f"--model {spec!r}: {mod_name!r} has no callable {attr!r}")
    try:
        out = factory()
    except Exception as err:  # the learner's code: one line, not a traceback
        raise _CliError(f"--model {spec!r}: the factory raised {type(err).__name__}: {err}") from err
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 4) or not isinstance(out[0], nn.Module):
        raise _CliError(f"--model {spec!r}: the factory must return (model, inputs) or (model, inputs, loss_fn, "
                        "targets) with an nn.Module first")
    return (*out, None, None) if len(out) == 2 else tuple(out)


def _parser() -> argparse.ArgumentParser:
    """The command line of python -m ampcourse.plan."""
    ap = _args.OneLineParser(prog="python -m ampcourse.plan", description=__doc__.split("\n\n")[0],
                             error_prefix=_PROG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help=f"one of {', '.join(ZOO)}, or 'package.module:factory' returning (model, inputs[, loss_fn, "
                         "targets])")
    ap.add_argument("--gpu", default="a100-sxm4-80gb", help=f"one of {', '.join(GPUS)} (default a100-sxm4-80gb)")
    # the other tools' names for the same things are aliases (python -m ampcourse train/trial/doctor take them too)
    ap.add_argument("--precisions", "--precision", dest="precisions", default=",".join(PRECISIONS),
                    help="comma-separated (default fp32,tf32,bf16,fp16)")
    ap.add_argument("--batch", "--batch-size", "--global-batch-size", dest="batch", type=int, default=16,
                    help="batch size of a named model (default 16)")
    ap.add_argument("--seq", type=int, default=None,
                    help=f"sequence length of a named language model (default 1024; {', '.join(MAX_SEQ)}: "
                         f"{max(MAX_SEQ.values())}, their most positions)")
    ap.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--top", type=int, default=12, help="op groups shown per precision (default 12)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Plan from the command line; 0 on success, 2 with one line on stderr for bad input."""
    args = _parser().parse_or_status(argv)
    if isinstance(args, int):  # --help (0), or a bad flag (2) whose one line is already on stderr
        return args
    try:
        if args.out is not None:
            try:
                _args.writable_file(args.out, "--out")
            except ValueError as err:
                raise _CliError(str(err)) from None
        if args.gpu not in GPUS:
            raise _CliError(f"--gpu {args.gpu!r}: choose one of {', '.join(GPUS)}")
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        bad = [p for p in precisions if p not in PRECISIONS]
        if bad or not precisions or len(set(precisions)) != len(precisions):
            raise _CliError(f"--precisions {args.precisions!r}: distinct names from {', '.join(PRECISIONS)}")
        for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--accum-steps", args.accum_steps),
                            ("--top", args.top)):
            if value is not None and value < 1:
                raise _CliError(f"{flag} must be >= 1, got {value}")
        limit = MAX_SEQ.get(args.model)
        if limit is not None and args.seq is not None and args.seq > limit:
            raise _CliError(f"--seq {args.seq}: {args.model} has {limit} positions (max_position_embeddings); "
                            f"pass --seq {limit} or less")
        if args.seq is None:
            args.seq = 1024 if limit is None else limit
            if limit is not None:  # said, so that a learner comparing with --model gpt2 knows the lengths differ
                print(f"--model {args.model}: --seq {limit} (its most positions; the default 1024 is beyond them)")
        if args.model in ZOO:
            try:
                setup = build(args.model, batch=args.batch, seq=args.seq)
            except ValueError as err:
                raise _CliError(f"--model {args.model}: {err}") from None
            model, inputs, loss_fn, targets = setup.model, setup.inputs, setup.loss_fn, setup.targets
        else:
            model, inputs, loss_fn, targets = _factory(args.model)
        try:
            report = plan(model, inputs, gpu=args.gpu, precisions=precisions, loss_fn=loss_fn, targets=targets,
                          accum_steps=args.accum_steps)
        except NeedsRealValues as err:
            raise _CliError(f"--model {args.model}: cannot be planned on meta tensors: {err}") from None
        except ValueError as err:
            raise _CliError(f"--model {args.model}: {err}") from None
    except _CliError as err:
        try:
            _args.cli_error(_PROG, str(err))
        except SystemExit as done:
            return done.code
    print(report.summary())
    for p in precisions:
        print()
        print(report.table(p, top=args.top))
    if args.out:
        report.to_json(args.out)
    return 0
