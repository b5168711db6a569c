"""Make learner copies of the chapters: solutions stubbed out, outputs cleared (nbgrader convention).

    python tools/make_student.py                      # chapters/*.ipynb -> student/
    python tools/make_student.py -o /tmp/s chapters/01_precision_basics.ipynb

In a cell tagged ``solution``, every region from a ``### BEGIN SOLUTION`` line to the next
``### END SOLUTION`` line (both included) becomes ``raise NotImplementedError("your code here")`` at
the BEGIN line's indentation; the rest of the cell (a ``def`` line, its docstring) stays. Every code
cell loses its outputs and execution count. Nothing else changes: markdown, tags and notebook metadata
are kept as they are, so a learner copy differs from its chapter only where a learner has work to do.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_TAG = "solution"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'
_BEGIN_LINE = re.compile(r"^([ \t]*)### BEGIN SOLUTION[ \t]*$")
_END_LINE = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
_CHECKER_CALL = re.compile(r"\bexercises\.(check_\w+)\s*\(")


class SolutionMarkerError(ValueError):
    """A solution cell whose BEGIN/END markers do not pair up."""


def is_solution(cell: nbformat.NotebookNode) -> bool:
    """Whether a cell holds an exercise solution (code cell tagged `solution`)."""
    return cell.cell_type == "code" and SOLUTION_TAG in cell.metadata.get("tags", [])


def checker_calls(cell: nbformat.NotebookNode) -> list[str]:
    """The `exercises.check_*` functions a code cell calls."""
    return _CHECKER_CALL.findall(cell.source) if cell.cell_type == "code" else []


def exercise_cells(nb: nbformat.NotebookNode) -> list[tuple[int, int]]:
    """(solution cell, checker cell) index pairs: a solution cell whose next code cell calls a checker."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if not is_solution(cell):
            continue
        nxt = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"), None)
        if nxt is not None and checker_calls(nb.cells[nxt]):
            pairs.append((i, nxt))
    return pairs


def stub_source(source: str) -> str:
    """Replace each BEGIN..END SOLUTION region with a NotImplementedError stub at its indentation."""
    out: list[str] = []
    indent: str | None = None  # set while inside a region
    for n, line in enumerate(source.split("\n"), start=1):
        begin, end = _BEGIN_LINE.match(line), _END_LINE.match(line)
        if begin:
            if indent is not None:
                raise SolutionMarkerError(f"line {n}: {BEGIN} inside another solution region")
            indent = begin.group(1)
            out.append(indent + STUB)
        elif end:
            if indent is None:
                raise SolutionMarkerError(f"line {n}: {END} without a {BEGIN} before it")
            indent = None
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise SolutionMarkerError(f"{BEGIN} without a matching {END}")
    if STUB not in "\n".join(out):
        raise SolutionMarkerError(f"a cell tagged {SOLUTION_TAG!r} has no {BEGIN} ... {END} region")
    return "\n".join(out)


def learner_copy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of a chapter with solutions stubbed and every output and execution count cleared."""
    copy = nbformat.from_dict(nb)  # deep copy: the chapter itself is left alone
    for i, cell in enumerate(copy.cells):
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        if is_solution(cell):
            try:
                cell.source = stub_source(cell.source)
            except SolutionMarkerError as err:
                raise SolutionMarkerError(f"cell {i}: {err}") from None
    return copy


def make_student(notebooks: list[Path], outdir: Path) -> list[Path]:
    """Write a learner copy of each notebook into outdir (same file names); return their paths."""
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        try:
            copy = learner_copy(nbformat.read(path, as_version=4))
        except SolutionMarkerError as err:
            raise SolutionMarkerError(f"{path}: {err}") from None
        target = outdir / path.name
        nbformat.write(copy, target)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line: write learner copies."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: chapters/*.ipynb")
    ap.add_argument("-o", "--outdir", type=Path, default=ROOT / "student")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    if not notebooks:
        print("no notebooks found in chapters/", file=sys.stderr)
        return 1
    try:
        written = make_student(notebooks, args.outdir)
    except SolutionMarkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
