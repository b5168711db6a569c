"""Run a course CLI's ``main(argv)`` in-process: its exit status and what it wrote on stderr (shared by the CLI tests)."""
from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from typing import Callable, Sequence


def run_cli(main: Callable[[Sequence[str]], int | None], argv: list[str]) -> tuple[int | None, str]:
    """(exit status, stderr) of main(argv), stdout discarded; a SystemExit counts as its code.

    Example:
        >>> from ampcourse.trial import main
        >>> code, err = run_cli(main, ["--steps", "0"])
    """
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    return code, err.getvalue()
