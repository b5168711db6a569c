"""One rule for numbers passed to any public function: normalise to a Python int/float, or refuse naming the argument.

A caller may hold a number as a Python int or float, a numpy scalar (``np.int64(3)``, ``np.float32(0.1)``),
a 0-d numpy array or a 0-d tensor. Every entry point of ampcourse turns such a value into a plain Python
number here, first thing, so nothing further down (torch's C++ argument parser, ``weights_only`` pickles,
an ``lru_cache`` key, integer arithmetic) ever sees a numpy or tensor scalar. Anything else (bools, text,
complex numbers, several-element arrays, ints too large for a float or for torch's int64) is refused with
an :class:`InputError` (a ``ValueError``) that names the argument, shows the value and says what is allowed, before any work starts.

    >>> from ampcourse import _args
    >>> _args.integer(np.int64(3), "steps", low=1)          # 3, a Python int
    >>> _args.real(torch.tensor(1e-3), "lr", positive=True)  # 0.001, a Python float

The same rule for the rest of what callers pass: names from a fixed list (:func:`choice`, :func:`names`,
whose messages list the allowed names), True/False (:func:`flag`), paths (:func:`as_path`: no bytes, no NUL
byte), output files (:func:`writable_file`, checked by creating them before any work), and command lines
(:class:`OneLineParser` and :func:`cli_error`: one line ``<prog>: error: ...``, exit 2, for argparse's errors
and the program's own alike; :func:`as_flags`: a Python argument name in a message spelled as the CLI's flag;
:class:`HelpFormatter`: every default shown;
:func:`load_factory`: ``--model package.module:factory``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import numbers
import os
import re
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = ["InputError", "INT64_MAX", "INT32_MAX", "SEED_MAX", "shown", "first_line", "scalar", "integer", "real", "seed", "choice", "names", "creatable_dir",
           "flag", "as_path", "writable_file", "output_files", "OneLineParser", "cli_error", "HelpFormatter", "as_flags",
           "load_factory"]



class InputError(ValueError, TypeError):
    """A bad argument to a public entry point: the message names the argument (or the CLI flag) and what is allowed.

    Both a ValueError and a TypeError (the pattern of numpy's AxisError), so callers that catch either keep working:
    ``train(model=42)`` once raised ValueError and ``examine(model=42)`` TypeError. Public as ``ampcourse.InputError``
    (``ampcourse.inputs``, the front door, raises it); defined here, at the bottom of the layers, so every module can.
    """


INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
#: torch.manual_seed and torch.Generator.manual_seed take seeds in 0 .. 2**64 - 1.
SEED_MAX = 2**64 - 1


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), shortened: a 400-digit int in an error message helps nobody."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_line(err: BaseException | str, limit: int | None = None, default: str = "") -> str:
    """The first line of an error's message (torch's span many lines), at most `limit` characters.

    Args:
        err: the exception (or its message).
        limit: cut the line to this many characters (None: the whole line).
        default: what an empty message reads as (e.g. the exception's type name).

    Example:
        >>> first_line(RuntimeError("mat1 and mat2 shapes cannot be multiplied\nmore"))
        'mat1 and mat2 shapes cannot be multiplied'
    """
    line = (str(err).strip().splitlines() or [default])[0]
    return line if limit is None else line[:limit]


def scalar(value: Any) -> Any:
    """A numpy scalar, 0-d array or 0-d tensor as the Python number it holds; anything else unchanged."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.device.type != "meta":
        return value.detach().cpu().item()
    return value


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = INT64_MAX,
            what: str | None = None) -> int:
    """value as a Python int in low..high (an int, numpy integer or 0-d integer tensor); ValueError naming it otherwise."""
    what = what or _int_range(low, high)
    v = scalar(value)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InputError(f"{name} must be {what}, got {shown(value)}")
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        raise InputError(f"{name} must be {what}, got {shown(value)}")
    return v


def _int_range(low: int | None, high: int | None) -> str:
    """'an int >= 1', 'an int in 0..2**63 - 1', ... for an error message."""
    top = {INT64_MAX: "2**63 - 1", INT32_MAX: "2**31 - 1", SEED_MAX: "2**64 - 1"}.get(high, str(high))
    if low is not None and high == INT64_MAX:  # torch's int64 limit: rarely the point, so said last
        return f"an int >= {low} (at most 2**63 - 1)"
    if low is not None and high is not None:
        return f"an int in {low}..{top}"
    if low is not None:
        return f"an int >= {low}"
    return "an int"


def real(value: Any, name: str, *, positive: bool = False, nonnegative: bool = False, finite: bool = True,
         what: str | None = None) -> float:
    """value as a Python float (int, float, numpy scalar or 0-d tensor), optionally finite and > 0 / >= 0."""
    if what is None:
        what = "a finite number" if finite else "a number"
        what += " > 0" if positive else " >= 0" if nonnegative else ""
    v = scalar(value)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InputError(f"{name} must be {what}, got {shown(value)}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond float's range (10**400): no float holds it
        raise InputError(f"{name} must be {what}, got {shown(value)} (too large for a float)") from None
    if (finite and not math.isfinite(f)) or (positive and not f > 0) or (nonnegative and not f >= 0):
        raise InputError(f"{name} must be {what}, got {shown(value)}")
    return f


def seed(value: Any, name: str = "seed") -> int:
    """A seed as a Python int in 0..2**64 - 1, the range torch.manual_seed takes; ValueError naming it otherwise."""
    return integer(value, name, low=0, high=SEED_MAX, what="an int >= 0 and < 2**64 (torch's seed range)")


def choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    """value if it is one of the allowed names (a str); ValueError naming the argument and listing them otherwise."""
    if not isinstance(value, str) or value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}; got {shown(value)}")
    return value


def names(value: Any, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    """A sequence of allowed names as a tuple (one name alone counts as a sequence of one: never iterated letter by letter)."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, (Sequence, set, frozenset)) or not value:
        raise InputError(f"{name} must be a non-empty sequence of names from {', '.join(allowed)}; got {shown(value)}")
    bad = [v for v in value if not isinstance(v, str) or v not in allowed]
    if bad:
        raise InputError(f"{name}: unknown name(s) {shown(bad)}; choose from {', '.join(allowed)}")
    return tuple(value)


def flag(value: Any, name: str) -> bool:
    """value as a bool (True, False, numpy bools, 0-d bool tensors); ValueError naming it otherwise."""
    v = scalar(value)
    if not isinstance(v, bool):
        raise InputError(f"{name} must be True or False, got {shown(value)}")
    return v


def as_path(value: Any, name: str) -> Path:
    """value as a Path (a str or os.PathLike, not bytes) that the OS can take; ValueError naming it otherwise.

    A NUL byte ends a C string: every system call would refuse the path with "embedded null byte",
    an error that names no argument, so it is refused here, first.
    """
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise InputError(f"{name} must be a path (str or pathlib.Path), got {shown(value)}")
    text = os.fspath(value)
    if isinstance(text, bytes):
        raise InputError(f"{name} must be a text path (str or pathlib.Path), got {shown(value)}")
    if "\0" in text:
        raise InputError(f"{name} {shown(text, 300)} contains a NUL byte (\\x00, at character {text.index(chr(0))}), "
                         "which no file name can hold; "
                         "remove it from the path")
    return Path(text)


def writable_file(path: Any, name: str) -> Path:
    """path as a Path whose file can be written, checked by creating it (then removed if it was new).

    Looking at the folder is not enough: /proc/x has a folder, a read-only mount or a full quota says no
    only when a file is opened. An existing file is opened for appending, which changes nothing in it; a device
    such as /dev/full gets one probe byte, since only a write tells whether it takes data.
    """
    if isinstance(path, bool) or not isinstance(path, (str, Path)) or not str(path):
        raise InputError(f"{name} must be a file path (str or pathlib.Path), got {shown(path)}")
    target = as_path(path, name)
    if target.is_dir() or not target.resolve().parent.is_dir():
        raise InputError(f"cannot write {name} {str(path)!r}: "
                         f"{'it is a directory' if target.is_dir() else 'its folder does not exist'}")
    existed = target.exists()
    try:
        with open(target, "a") as fh:
            # fstat, not stat(target): torchrun's ranks probe the same path at once, and another rank's
            # probe may unlink the name between our open and a stat by name (CI saw ENOENT there)
            if existed and not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                # a device (such as /dev/full) opens fine and refuses only data: one probe byte tells
                fh.write("\n")
                fh.flush()
    except OSError as err:
        raise InputError(f"cannot write {name} {str(path)!r}: {err.strerror or err}; choose a file you can write to") from None
    if not existed:
        target.unlink(missing_ok=True)
    return target


def output_files(named: Sequence[tuple[str, Any]]) -> None:
    """The one check of a CLI's output files, before any work: each given one writable, no two the same file.

    Args:
        named: (flag, path) pairs, such as ``[("--out", args.out), ("--html", args.html)]``; a None path is not given.

    Example:
        >>> output_files([("--out", "report.json"), ("--html", "report.json")])
        Traceback (most recent call last):
        InputError: --out and --html name the same file ('report.json'): the second would overwrite the first; give each its own
    """
    given = [(flag, path) for flag, path in named if path is not None]
    for flag, path in given:
        writable_file(path, flag)
    seen: dict[Path, tuple[str, Any]] = {}
    for flag, path in given:
        key = Path(path).resolve()
        if key in seen:
            first, shown_as = seen[key]
            raise InputError(f"{first} and {flag} name the same file ({str(shown_as)!r}): the second would overwrite "
                             "the first; give each its own")
        seen[key] = (flag, path)


def creatable_dir(path: Path, name: str) -> None:
    """Refuse (ValueError naming it) a folder path that cannot be created or written, probing the nearest existing parent.

    Looking is not enough: a link to nothing says "does not exist" yet blocks mkdir, and /proc or a
    read-only mount say no only when a file is made, so a temporary file is made (and removed) there.
    """
    path = as_path(path, name)
    if path.exists() and not path.is_dir():
        raise InputError(f"{name} {str(path)!r} exists and is not a directory; pass a directory path")
    probe = path
    while not probe.exists():  # the nearest existing ancestor must let us create the directory
        if probe.is_symlink():  # a link to nothing: exists() says no, yet mkdir() would meet the name
            raise InputError(f"{name} {str(path)!r} cannot be created: {str(probe)!r} is a symbolic link "
                             f"to {os.readlink(probe)!r}, which does not exist; remove the link or create its target")
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{name} {str(path)!r} cannot be created: {str(probe)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise InputError(f"{name} {str(path)!r} is not writable ({err.strerror or err}); "
                         "choose a directory you can write to") from None


def cli_error(prog: str, message: str, *, code: int = 2, quiet: bool = False) -> NoReturn:
    """End a command line with one line on stderr, '<prog>: error: <message>', and exit status `code`.

    The one error style of the course's command lines (2, as argparse exits for bad arguments). quiet=True
    exits without printing: torchrun workers other than local rank 0 would only repeat rank 0's line.
    """
    if not quiet:
        print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr ('<name>: error: ...') and exit status 2, no usage block."""

    def __init__(self, *args, error_prefix: str, **kwargs):
        self.error_prefix = error_prefix
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Print one line and exit 2 (argparse's own status for bad arguments)."""
        cli_error(self.error_prefix, f"{message} (see --help)")

    def parse_or_status(self, argv: Sequence[str] | None = None) -> argparse.Namespace | int:
        """The parsed arguments, or the exit status a `main()` returns instead of raising: 0 after --help, 2
        after a bad flag (its one line already on stderr). The course's CLIs return a status, never exit.

        Example (inside a CLI's ``main(argv)``)::

            args = _parser().parse_or_status(argv)
            if isinstance(args, int):
                return args
        """
        try:
            return self.parse_args(argv)
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else 2


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help that states every default: ' (default: X)' is appended where the help text does not already say it.

    A default of None or False means "not given", which only the help text can explain ("default: stdout"), so it
    is not appended: tests/test_cli_frontdoor.py checks that every such option's help says its default in words.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        """The help text, with the default appended where it is a value the reader could type."""
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS  # not 0
        shown_default = action.option_strings and not unset
        if shown_default and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


#: Python argument names every CLI spells the same way (a CLI passes its own for the others).
COMMON_FLAGS = {"device": "--device", "seed": "--seed", "steps": "--steps", "lr": "--lr", "size": "--size",
                "precision": "--precision", "precisions": "--precisions", "policy": "--policy"}


def as_flags(message: str, flags: Mapping[str, str] = COMMON_FLAGS, *, bare: Sequence[str] = ()) -> str:
    """message with Python argument names, where they name an argument, spelled as a CLI's flags.

    The API's checks name the Python argument ("steps must be an int >= 1"); a command line has flags. Renamed:
    the opening name ("steps must be ...", "precisions: unknown ..."), ``name=value`` ("resume=True" -> "--resume",
    "precision='fp16'" -> "--precision fp16", "leave device=None" -> "leave --device out", else "no --device"),
    "name / --flag" (a message naming both) and the names in `bare` wherever they stand. The same words elsewhere
    are prose ("the steps of the first run") and stay.

    Args:
        message: the API's one-line error.
        flags: Python argument name -> the CLI's flag (COMMON_FLAGS, or a CLI's own table).
        bare: names replaced wherever they stand as a word (their text is never prose, e.g. "checkpoint_dir").

    Example:
        >>> as_flags("batch_size must be an int >= 1, got 0", {"batch_size": "--batch-size"})
        '--batch-size must be an int >= 1, got 0'
        >>> as_flags("device 'cuda:7' requested but CUDA is not available here; leave device=None for the best available")
        "--device 'cuda:7' requested but CUDA is not available here; leave --device out for the best available"
    """
    head, sep, rest = message.partition(" ")
    key = head.rstrip(":")
    if key in flags:
        message = flags[key] + head[len(key):] + sep + rest
    for name, flag in flags.items():
        message = message.replace(f"{name} / {flag}", flag)

        def spelled(match: re.Match, flag: str = flag) -> str:
            value = match.group(1)
            if value == "None":  # "leave device=None" -> "leave --device out"; "seed=None in ..." -> "no --seed"
                return f"{flag} out" if match.string[:match.start()].endswith("leave ") else f"no {flag}"
            if value == "True":
                return flag
            return f"{flag} {value.strip(chr(39) + chr(34))}"
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}=('[^']*'|\"[^\"]*\"|[\w.+-]+)", spelled, message)
    for name in bare:
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", flags[name], message)
    return message


def load_factory(spec: str, flag: str = "--model") -> tuple[Any, Any, Any, Any, Any]:
    """Import 'package.module:factory', call it, and check it returned (model, inputs, targets, loss_fn[, optimizer]).

    The contract of ``--model`` in the doctor, trial and plan CLIs: the factory builds what your training script
    has. Every failure (no ':', a file path, an import error, a missing or non-callable name, a factory that raises
    or returns the wrong shape) is an InputError naming the flag.

    Args:
        spec: 'package.module:factory' (the factory may be an attribute path, 'mod:Builder.make').
        flag: the flag's name, for the message.

    Returns:
        (model, inputs, targets, loss_fn, optimizer), optimizer None where the factory gave four items.

    Example::

        >>> model, x, y, loss_fn, opt = load_factory("mypkg.models:make")
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise InputError(f"{flag} {spec!r}: use a reference model name or 'package.module:factory'")
    if any(c in mod_name for c in "/\\") or mod_name.startswith(".") or mod_name.endswith(".py"):
        raise InputError(f"{flag} {spec!r}: the part before ':' must be a module name such as 'mypkg.models', "
                         f"not a file path: run from the folder that holds the file (or add it to PYTHONPATH) and "
                         f"write {flag} {os.path.basename(mod_name).removesuffix('.py') or 'module'}:{attr}")
    try:
        module = importlib.import_module(mod_name)
    except (ImportError, TypeError, ValueError) as err:
        raise InputError(f"{flag} {spec!r}: cannot import {mod_name!r} ({err})") from err
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise InputError(f"{flag} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise InputError(f"{flag} {spec!r}: {attr!r} is not callable")
    try:
        out = factory()
    except Exception as err:  # the learner's code: one line that says where it failed, not a traceback
        raise InputError(f"{flag} {spec!r}: the factory raised {type(err).__name__}: {err}") from err
    if not isinstance(out, (tuple, list)) or len(out) not in (4, 5):
        got = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else type(out).__name__
        raise InputError(f"{flag} {spec!r}: the factory must return (model, inputs, targets, loss_fn) "
                         f"or (model, inputs, targets, loss_fn, optimizer), got {got}")
    return (*out, None) if len(out) == 4 else tuple(out)
