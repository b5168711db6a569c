"""``python -m ampcourse <tool> [args]``: one front door to the course's command-line tools.

    python -m ampcourse --help                       # the tools, one line each
    python -m ampcourse train --model mlp --steps 200
    python -m ampcourse doctor --model transformer --steps 0

Each tool's own ``python -m ampcourse.<tool>`` works as before; this runs the same ``main`` with the same
arguments and exits with its status (0, or 2 with one line on stderr for bad input). An unknown tool is one
line ``ampcourse: error: ...`` naming the tools, and exit status 2, as in every other CLI of the course.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ampcourse import _args

PROG = "ampcourse"

#: tool -> (module whose main(argv) runs it, what it does in one line).
TOOLS: dict[str, tuple[str, str]] = {
    "train": ("ampcourse.train.cli", "train a reference model with AMP (one process or under torchrun); JSON summary"),
    "doctor": ("ampcourse.doctor.cli", "examine a model under fp16/bf16: where inf/NaN start, what to change"),
    "trial": ("ampcourse.trial.cli", "train fp32 and AMP side by side: drift per layer, the first departure"),
    "plan": ("ampcourse.plan.cli", "predict what AMP buys on a GPU, counted on a CPU (memory, time per recipe)"),
    "widgets": ("ampcourse.widgets.cli", "time the chapters' widget explorers (--bench)"),
    "bench": ("ampcourse.bench", "measure matmul, train-step time and saved bytes, fp32 against AMP, here"),
}


def usage() -> str:
    """The text of ``python -m ampcourse --help``: how to call it, then each tool and what it does.

    Example::

        >>> print(usage().splitlines()[0])
        usage: python -m ampcourse <tool> [args]   (python -m ampcourse <tool> --help: the tool's flags)
    """
    width = max(map(len, TOOLS))
    lines = ["usage: python -m ampcourse <tool> [args]   (python -m ampcourse <tool> --help: the tool's flags)", "",
             "tools:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m ampcourse <tool> [args]``: the tool's own main with the rest of the arguments.

    Args:
        argv: the arguments after ``python -m ampcourse`` (default: sys.argv[1:]).

    Returns:
        the tool's exit status; 0 after --help; 2 (one line on stderr) for a missing or unknown tool.

    Example::

        >>> main(["train", "--steps", "2", "--no-progress"])   # as python -m ampcourse.train --steps 2 --no-progress
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    names = ", ".join(TOOLS)
    if not argv:
        _args.cli_error(PROG, f"name a tool: python -m ampcourse <tool> [args], with <tool> one of {names} "
                              "(python -m ampcourse --help)")
    tool, rest = argv[0], argv[1:]
    if tool not in TOOLS:
        _args.cli_error(PROG, f"unknown tool {_args.shown(tool)}; choose one of {names} (python -m ampcourse --help)")
    return importlib.import_module(TOOLS[tool][0]).main(rest)


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["train"]:  # a torchrun worker ends as python -m ampcourse.train's does
        from ampcourse.distributed import exit_worker
        exit_worker(code)
    sys.exit(code)
