"""Files the chapters read that live outside the package in a checkout, found in a checkout or an installed wheel.

In the repository, `examples/ddp_amp.py` (chapter 7 prints and runs it; the README points learners to it) and
`benchmarks/gpu/report.json` (chapter 2 shows the recorded GPU run) sit beside the package. A wheel holds only the
package, so Colab's `pip install --no-deps "git+..."` lost them; setup.py copies each file in SHIPPED into the wheel as
`ampcourse/_shipped/<its checkout path>`, and `path()` finds it in either place. Standard library only: setup.py reads
SHIPPED from this file without importing ampcourse (and so without torch).

Example::

    >>> path("examples/ddp_amp.py").name
    'ddp_amp.py'
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["SHIPPED", "path", "checkout_root"]

#: Checkout paths (relative to the repository root) copied into the wheel; one that does not exist when the wheel is
#: built (no GPU report recorded yet) is left out, and path() then gives None.
SHIPPED = ("examples/ddp_amp.py", "benchmarks/gpu/report.json")
#: Where the wheel keeps them, inside the package.
WHEEL_DIR = "_shipped"


def checkout_root() -> Path | None:
    """The repository this package is imported from, or None for an installed copy (site-packages).

    A checkout is recognised by its pyproject.toml naming this project beside the package, not by a folder name:
    other wheels install top-level `examples/` or `benchmarks/` folders into site-packages too."""
    root = Path(__file__).resolve().parents[1]
    project = root / "pyproject.toml"
    try:
        if project.is_file() and 'name = "ampcourse"' in project.read_text(errors="replace"):
            return root
    except OSError:
        pass
    return None


def path(name: str) -> Path | None:
    """The file `name` (one of SHIPPED): the checkout's own when this package runs from a checkout, else the wheel's
    copy; None when neither has it (e.g. no GPU report recorded when the wheel was built).

    Args:
        name: a checkout path from SHIPPED, e.g. "examples/ddp_amp.py".

    Example::

        >>> "torchrun" in path("examples/ddp_amp.py").read_text()
        True
    """
    if name not in SHIPPED:
        raise ValueError(f"name must be one of {', '.join(SHIPPED)}, got {name!r}")
    root = checkout_root()
    if root is not None:
        found = root / name
        return found if found.is_file() else None
    copy = importlib.resources.files("ampcourse").joinpath(WHEEL_DIR, *name.split("/"))
    return Path(str(copy)) if copy.is_file() else None
