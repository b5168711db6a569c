"""Make learner copies of the chapters: solutions stubbed out, outputs cleared (nbgrader convention).

    python tools/make_student.py                      # chapters/*.ipynb -> workspace/ (what `make lab` runs)
    python tools/make_student.py -o /tmp/s chapters/01_precision_basics.ipynb

workspace/ is the learner's own folder (git ignores it): a copy that exists is never overwritten, so
edits and outputs survive `git pull` and a second `make lab`; a chapter added later is copied in.
Delete a copy to get a fresh one; `--overwrite` replaces them all.

In a cell tagged ``solution``, every region from a ``### BEGIN SOLUTION`` line to the next
``### END SOLUTION`` line (both included) becomes a stub at the BEGIN line's indentation: inside a
function, ``raise NotImplementedError("your code here")`` (the ``def`` line and docstring stay); outside
one (at the top level, or in a top-level ``for``/``with``/``if``/``try`` block), ``name = ...  # your
code here`` for each name the region binds (inside those blocks too) and the checker cell uses, so the
cell runs and the checker prints its verdict instead of a NameError stopping "Run All".

A learner copy must never contain a solution, so the rule is strict: a marker is a comment line holding
only ``BEGIN SOLUTION`` or ``END SOLUTION`` after one or more ``#`` (``### BEGIN SOLUTION``, ``#### BEGIN
SOLUTION``, ``# BEGIN SOLUTION``, ``###BEGIN SOLUTION``: the spellings nbgrader accepts), with any line
ending (LF, CRLF, CR). Anything else that looks like one (``### BEGIN SOLUTION (part 2)``, ``# begin
solution``, a marker inside a string) is an error, as are unpaired markers, markers in a cell not tagged
``solution``, in a markdown or raw cell, and cell tags that are not a list of strings: the solution would
otherwise reach the learner verbatim. Learner copies are never written over the notebooks they are made
from (``-o chapters``), with or without ``--overwrite``.

Every code cell loses its outputs and execution count, except in a notebook without exercises (the
index), which is for reading and keeps its stored tables; ``language_info`` becomes this interpreter's
kernel's and the kernelspec the course's (``nbtool.KERNELSPEC``), so the copy opens unmodified in the learner's JupyterLab. Cells are added: a note at the top
(whose copy it is, where the full chapter with solutions is, how to get a fresh copy), after the last
cell ``exercises.summary([...])`` with the checkers the notebook calls (before the chapter's closing
navigation cell, ``nbtool.py nav``, if it has one), and at the very end a link to the next chapter unless
that navigation cell already gives it. Nothing else changes: markdown, tags and the other metadata stay as they are, so a
learner copy differs from its chapter only where a learner has work to do.

A copy that exists but cannot be read (empty, corrupt JSON) is kept, as every existing copy is, and
named in a warning. A folder that cannot be written, or an ``-o`` that is a file, is a one-line error.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nbtool import KERNELSPEC, NAV_END, kernel_language_info  # noqa: E402
from nbtool import notebook_title as chapter_title  # noqa: E402  (one reader of a chapter's title)

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / "workspace"
SOLUTION_TAG = "solution"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'
ANSWER_STUB = "{name} = ...  # your code here"
TOP_STUB = "# your code here"  # a top-level region that defines nothing the checker reads
NOTE_TAG, SUMMARY_TAG, NEXT_TAG = "learner-note", "learner-summary", "learner-next"  # the cells a learner copy adds
# A marker: one or more '#', optional blanks, BEGIN/END SOLUTION, nothing else on the line (nbgrader's spellings).
_BEGIN_LINE = re.compile(r"^([ \t]*)#+[ \t]*BEGIN SOLUTION[ \t]*$")
_END_LINE = re.compile(r"^[ \t]*#+[ \t]*END SOLUTION[ \t]*$")
# What looks like a marker: BEGIN/END and SOLUTION in any case and spacing, anywhere on a line (nbgrader
# itself takes any line that contains "BEGIN SOLUTION"). A line this matches and the two above do not is an error.
_MARKER_LIKE = re.compile(r"(?i)\b(?:begin|end)[ \t_-]*solution")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # CRLF and CR line endings too: a marker line ending in \r is a marker
_CHECKER_CALL = re.compile(r"\bexercises\.(check_\w+)\s*\(")


class SolutionMarkerError(ValueError):
    """A solution cell whose markers do not pair up or are not understood, or markers where no solution can be."""


class WorkspaceError(OSError):
    """The learner copies cannot be written where asked (a file, a read-only folder, the chapters themselves)."""


def source_lines(source: str) -> list[str]:
    """A cell's lines, whatever its line endings (LF, CRLF, CR)."""
    return _LINE_BREAK.split(source)


def marker_kind(line: str) -> str | None:
    """'begin' or 'end' for a marker line, 'unclear' for a line that looks like one but is not, None otherwise."""
    if _BEGIN_LINE.match(line):
        return "begin"
    if _END_LINE.match(line):
        return "end"
    return "unclear" if _MARKER_LIKE.search(line) else None


def _unclear(n: int, line: str) -> SolutionMarkerError:
    """The error for a line that looks like a marker but is not one."""
    return SolutionMarkerError(f"line {n}: {line.strip()[:80]!r} looks like a solution marker but is not one: write "
                               f"{BEGIN!r} / {END!r} alone on the line (else the solution reaches the learner as is)")


def has_markers(source: str) -> bool:
    """Whether a cell's text holds a BEGIN or END SOLUTION marker, or a line that looks like one."""
    return any(marker_kind(line) for line in source_lines(source))


def cell_tags(cell: nbformat.NotebookNode) -> list[str]:
    """A cell's tags; missing or null: none. Anything but a list of strings is an error (a tag could hide a solution)."""
    tags = cell.get("metadata", {}).get("tags")
    if tags is None:
        return []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise SolutionMarkerError(f"cell tags must be a list of strings, got {tags!r}")
    return tags


def is_solution(cell: nbformat.NotebookNode) -> bool:
    """Whether a cell holds an exercise solution (code cell tagged `solution`)."""
    return cell.cell_type == "code" and SOLUTION_TAG in cell_tags(cell)


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


class _Bindings(ast.NodeVisitor):
    """Names a block binds in its own scope, in order: assignments, for/with/except targets, walrus, def, class,
    import, also inside if/for/while/with/try/match blocks; not inside functions, classes or comprehensions."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def _targets(self, *nodes: ast.AST | None) -> None:
        for node in nodes:
            if node is not None:
                self.names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(*node.targets)
        self.visit(node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._targets(node.target)
        self.visit(node.value)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self._targets(node.target)
        for child in [*node.body, *node.orelse]:
            self.visit(child)

    visit_AsyncFor = visit_For

    def visit_withitem(self, node: ast.withitem) -> None:
        self._targets(node.optional_vars)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.names.append(node.name)
        for child in node.body:
            self.visit(child)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name:
            self.names.append(node.name)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.names.append(node.name)  # its body is another scope

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]

    visit_ImportFrom = visit_Import

    def visit_Lambda(self, node: ast.Lambda) -> None:  # its own scope
        pass

    def visit_ListComp(self, node: ast.AST) -> None:  # its own scope (a walrus inside binds outside: rare, left out)
        pass

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp


def defined_names(code: str) -> list[str]:
    """Names a top-level block of code binds, in order, also inside for/with/if/try blocks (not inside a def).

    Example:
        >>> defined_names("for i in range(3):\n    N = i\nwith open('f') as fh:\n    text = fh.read()")
        ['i', 'N', 'fh', 'text']
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    found = _Bindings()
    for node in tree.body:
        found.visit(node)
    return list(dict.fromkeys(found.names))


def used_names(code: str) -> set[str]:
    """Names a piece of code reads."""
    try:
        return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    except SyntaxError:
        return set()


def _top_level_stub(region: list[str], indent: str, wanted: set[str] | None) -> list[str]:
    """`name = ...` for each name the region binds that the checker reads (all of them if wanted is None).

    With none, a comment; in an indented block (a top-level for/if/with body) `pass`, so the block is not empty.
    """
    names = [n for n in defined_names("\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                                                for line in region))
             if wanted is None or n in wanted]
    empty = f"pass  {TOP_STUB}" if indent else TOP_STUB
    return [indent + ANSWER_STUB.format(name=n) for n in names] or [indent + empty]


def function_lines(source: str) -> set[int] | None:
    """Line numbers (1-based) inside a def's body, or None if the code does not parse (IPython magics)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node.end_lineno:
            inside.update(range(node.lineno + 1, node.end_lineno + 1))
    return inside


def stub_source(source: str, checker_source: str | None = None) -> str:
    """Replace each BEGIN..END SOLUTION region with a stub at its indentation (see the module docstring).

    checker_source: the checker cell's code; outside a function only the names it reads get an `...`
    stub (None: every name the region binds). Lines end in LF in the result, whatever they ended in.
    """
    wanted = None if checker_source is None else used_names(checker_source)
    lines = source_lines(source)
    in_def = function_lines("\n".join(lines))
    out: list[str] = []
    region: list[str] = []
    indent: str | None = None  # set while inside a region
    begin_line = 0
    stubs = 0
    for n, line in enumerate(lines, start=1):
        kind = marker_kind(line)
        if kind == "unclear":
            raise _unclear(n, line)
        if kind == "begin":
            if indent is not None:
                raise SolutionMarkerError(f"line {n}: {BEGIN} inside another solution region")
            indent, region, begin_line = _BEGIN_LINE.match(line).group(1), [], n
        elif kind == "end":
            if indent is None:
                raise SolutionMarkerError(f"line {n}: {END} without a {BEGIN} before it")
            # Inside a def the stub raises when called (the checker reports it); outside one a raise
            # would end the cell in error and stop "Run All", so the answer's names get `...`.
            inside = begin_line in in_def if in_def is not None else bool(indent)  # unparsable: by indentation
            out += [indent + STUB] if inside else _top_level_stub(region, indent, wanted)
            indent, stubs = None, stubs + 1
        elif indent is None:
            out.append(line)
        else:
            region.append(line)
    if indent is not None:
        raise SolutionMarkerError(f"{BEGIN} without a matching {END}")
    if not stubs:
        raise SolutionMarkerError(f"a cell tagged {SOLUTION_TAG!r} has no {BEGIN} ... {END} region")
    return "\n".join(out)


FRESH_COPY = "For a fresh copy, delete this file and run `make student` (it takes seconds; the lab can stay open)."


def note_cell(name: str, has_exercises: bool = True) -> nbformat.NotebookNode:
    """The markdown cell at the top of a learner copy: whose copy it is, where the solutions are, how to start afresh."""
    full = f"[`chapters/{name}`](../chapters/{name})"
    where = (f"The exercises' solutions are in the full chapter, {full} (read-only in JupyterLab)." if has_exercises
             else f"The original is {full} (read-only in JupyterLab).")
    return nbformat.v4.new_markdown_cell(
        f"**Your copy** (in `workspace/`, which git ignores: your edits and outputs stay yours, and "
        f"`make lab` never overwrites them). {where} {FRESH_COPY}",
        metadata={"tags": [NOTE_TAG]})


def next_chapter_markdown(name: str, title: str) -> str:
    """The closing line that links a chapter to the next one (the same line fits a full chapter's last cell)."""
    return f"**Next:** [{title or name}]({name})"


def next_cell(name: str, title: str) -> nbformat.NotebookNode:
    """The markdown cell at the end of a learner copy: a link to the next chapter's copy (same folder)."""
    return nbformat.v4.new_markdown_cell(next_chapter_markdown(name, title), metadata={"tags": [NEXT_TAG]})


def next_chapters(notebooks: list[Path]) -> dict[Path, tuple[str, str]]:
    """{notebook: (file name, title) of the one after it} among the numbered notebooks of each one's folder."""
    out: dict[Path, tuple[str, str]] = {}
    for path in notebooks:
        siblings = sorted(path.parent.glob("[0-9][0-9]_*.ipynb"))
        if path in siblings and siblings.index(path) + 1 < len(siblings):
            nxt = siblings[siblings.index(path) + 1]
            try:
                title = chapter_title(nbformat.read(nxt, as_version=4))
            except Exception:  # noqa: BLE001 (an unreadable neighbour: link by its file name)
                title = ""
            out[path] = (nxt.name, title)
    return out


def summary_cell(checkers: list[str]) -> nbformat.NotebookNode:
    """The code cell at the end of a learner copy: which of its exercises pass."""
    listed = ", ".join(f'"{c}"' for c in checkers)
    return nbformat.v4.new_code_cell(
        "# Your progress: which exercises of this notebook pass (after Run All, or after you rerun a checker).\n"
        f"from ampcourse import exercises\nexercises.summary([{listed}])",
        metadata={"tags": [SUMMARY_TAG]})


def learner_copy(nb: nbformat.NotebookNode, name: str | None = None,
                 next_chapter: tuple[str, str] | None = None) -> nbformat.NotebookNode:
    """A copy of a chapter with solutions stubbed, outputs cleared, a note on top (if named), a summary cell and a
    link to the next chapter (next_chapter: its file name and title)."""
    for i, cell in enumerate(nb.cells):  # tags first: every rule below reads them
        try:
            cell_tags(cell)
        except SolutionMarkerError as err:
            raise SolutionMarkerError(f"cell {i}: {err}") from None
    copy = nbformat.from_dict(nb)  # deep copy: the chapter itself is left alone
    checker_of = dict(exercise_cells(nb))
    has_exercises = any(is_solution(c) for c in nb.cells)
    checkers: list[str] = []
    for i, cell in enumerate(copy.cells):
        try:
            solution = is_solution(cell)
        except SolutionMarkerError as err:
            raise SolutionMarkerError(f"cell {i}: {err}") from None
        if cell.cell_type != "code":
            if has_markers(cell.source):
                raise SolutionMarkerError(f"cell {i}: a solution marker in a {cell.cell_type} cell: only a code cell "
                                          f"tagged {SOLUTION_TAG!r} is stubbed, so this text would reach the learner as is")
            continue
        if not solution and has_markers(cell.source):
            raise SolutionMarkerError(f"cell {i}: {BEGIN}/{END} markers in a cell not tagged {SOLUTION_TAG!r}: "
                                      f"tag it {SOLUTION_TAG!r} (or remove the markers), else the solution is copied as is")
        if has_exercises:  # a notebook without exercises (the index) keeps its tables: it is for reading
            cell.outputs, cell.execution_count = [], None
        if is_solution(cell):
            check_src = copy.cells[checker_of[i]].source if i in checker_of else None
            try:
                cell.source = stub_source(cell.source, check_src)
            except SolutionMarkerError as err:
                raise SolutionMarkerError(f"cell {i}: {err}") from None
        if i in checker_of.values():
            checkers += [c for c in checker_calls(cell) if c not in checkers]
    # A chapter that ends with its navigation cell (`nbtool.py nav`: the next chapter and the index) keeps it last,
    # after the summary, and needs no link of its own; one without gets the next-chapter link below.
    nav_end = bool(copy.cells) and NAV_END in cell_tags(copy.cells[-1])
    if checkers:
        copy.cells.insert(len(copy.cells) - nav_end, summary_cell(checkers))
    # JupyterLab marks a notebook modified on open unless its language_info is exactly what the
    # kernel reports: this interpreter's, the one `make lab` (and Binder) run the kernel with.
    copy.metadata["language_info"] = kernel_language_info()
    copy.metadata["kernelspec"] = dict(KERNELSPEC)  # the course's kernel, as `make lab` installs it
    if next_chapter is not None and not nav_end:
        copy.cells.append(next_cell(*next_chapter))
    if name is not None:  # under the title, if the notebook starts with one
        title = bool(copy.cells) and copy.cells[0].cell_type == "markdown" and copy.cells[0].source.startswith("# ")
        copy.cells.insert(1 if title else 0, note_cell(name, has_exercises))
    if (copy.nbformat, copy.nbformat_minor) < (4, 5):  # cell ids arrived in 4.5: an added cell's id is invalid here
        for cell in copy.cells:
            cell.pop("id", None)
    return copy


WORKSPACE_README = """\
# Your workspace

Learner copies of the chapters: the exercises' solutions are replaced by stubs, outputs are cleared,
and the last cell sums up which exercises pass. Edit and run them freely: git ignores this folder,
and `make lab` never overwrites a copy that exists (a chapter added later is copied in).

The full chapters, with solutions and stored outputs, are in `../chapters/` (read-only in the course's
JupyterLab: a Run All there is never saved). To start a chapter afresh, delete its copy here and run
`make student` (seconds; the lab can stay open).
"""


def unreadable(path: Path) -> str | None:
    """Why a learner copy cannot be opened as a notebook (empty, not JSON, not a notebook), or None if it can."""
    try:
        if path.stat().st_size == 0:
            return "empty file"
        nbformat.read(path, as_version=4)
    except Exception as err:  # noqa: BLE001 (any reason it cannot be read is the answer)
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120] if str(err).strip() else ''}"
    return None


def _writable_dir(outdir: Path) -> None:
    """Make outdir (or say in one line why it cannot be the workspace)."""
    if outdir.exists() and not outdir.is_dir():
        raise WorkspaceError(f"{outdir} is a file, not a folder: give -o a folder for the learner copies")
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WorkspaceError(f"cannot create {outdir}: {err.strerror or err}; give -o a folder you can write") from None
    if not os.access(outdir, os.W_OK | os.X_OK):
        raise WorkspaceError(f"cannot write in {outdir} (read-only); make it writable or give -o another folder")


def _not_over_the_sources(notebooks: list[Path], outdir: Path) -> None:
    """WorkspaceError if a learner copy would land on a notebook it is made from (``-o chapters``), or in chapters/.

    With ``--overwrite`` that replaced the full chapter (its solutions) by its learner copy and exited 0; without
    it nothing was written and the command still said it kept "your" copies. Either way the folder is wrong.
    """
    out = outdir.resolve()
    folders = {p.resolve().parent for p in notebooks} | {(ROOT / "chapters").resolve()}
    if out in folders:
        raise WorkspaceError(f"-o {outdir} is the folder of the full chapters: learner copies there would replace the "
                             "chapters they are made from; give -o another folder (workspace/ is the default)")


def make_student(notebooks: list[Path], outdir: Path, overwrite: bool = False,
                 warnings: list[str] | None = None) -> list[Path]:
    """Write a learner copy of each notebook into outdir (same names), keeping existing copies; return those written.

    warnings: if given, gets one line for each existing copy that cannot be read (kept, as every existing copy).
    """
    _not_over_the_sources(notebooks, outdir)
    _writable_dir(outdir)
    nexts = next_chapters(notebooks)
    written = []
    try:
        readme = outdir / "README.md"
        if not readme.exists():
            readme.write_text(WORKSPACE_README)
        for path in notebooks:
            target = outdir / path.name
            if target.exists() and not overwrite:  # the learner's work: never replaced
                why = unreadable(target)
                if why and warnings is not None:
                    warnings.append(f"{target} is unreadable ({why}); kept as it is. Delete it and run "
                                    "`make student` for a fresh copy")
                continue
            try:
                copy = learner_copy(nbformat.read(path, as_version=4), name=path.name, next_chapter=nexts.get(path))
            except SolutionMarkerError as err:
                raise SolutionMarkerError(f"{path}: {err}") from None
            tmp = target.with_name(f".{target.name}.tmp")  # a crash mid-write leaves no half copy behind
            try:
                nbformat.write(copy, tmp)
                tmp.replace(target)
            finally:
                tmp.unlink(missing_ok=True)
            written.append(target)
    except PermissionError as err:
        raise WorkspaceError(f"cannot write {err.filename or outdir}: permission denied; make {outdir} writable "
                             "or give -o another folder") from None
    except OSError as err:
        if isinstance(err, WorkspaceError):
            raise
        raise WorkspaceError(f"cannot write {err.filename or outdir}: {err.strerror or err}") from None
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line: write learner copies."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: chapters/*.ipynb")
    ap.add_argument("-o", "--outdir", type=Path, default=WORKSPACE)
    ap.add_argument("--overwrite", action="store_true", help="replace existing copies (their edits are lost)")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    if not notebooks:
        print("no notebooks found in chapters/", file=sys.stderr)
        return 1
    warnings: list[str] = []
    try:
        written = make_student(notebooks, args.outdir, overwrite=args.overwrite, warnings=warnings)
    except (SolutionMarkerError, WorkspaceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    kept = len(notebooks) - len(written)
    if kept:
        print(f"{args.outdir}: kept {kept} existing learner cop{'y' if kept == 1 else 'ies'} (yours; delete one for a fresh copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
