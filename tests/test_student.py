"""Learner copies (`make student`): solutions stubbed, nothing else changed, and the checkers bite.

The execution test runs each learner copy cell by cell in one kernel. After a stubbed solution its
checker cell must fail; then the chapter's own solution and checker are run in the same kernel and
must pass, so the rest of the notebook runs on the state the full chapter would have.
"""

import copy
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_student  # noqa: E402
from make_student import STUB, SolutionMarkerError, exercise_cells, is_solution, learner_copy, stub_source  # noqa: E402

CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
NUMBERED = [p for p in CHAPTERS if int(p.name[:2]) > 0]  # 00 is the index, not a chapter
WITH_EXERCISES = [p for p in CHAPTERS if exercise_cells(nbformat.read(p, as_version=4))]
MIN_EXERCISES = 2
# What a checker cell may raise when the learner has not written the solution yet.
STUB_FAILURES = {"ExerciseError", "NameError", "NotImplementedError"}


def read(path: Path) -> nbformat.NotebookNode:
    """A notebook as nbformat v4."""
    return nbformat.read(path, as_version=4)


def error_name(cell: nbformat.NotebookNode) -> str | None:
    """The exception a code cell raised (None if it ran cleanly)."""
    return next((o.ename for o in cell.get("outputs", []) if o.output_type == "error"), None)


def stdout(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell printed to stdout."""
    return "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """Learner copies of every chapter, made by the command line tool as `make student` runs it."""
    out = tmp_path_factory.mktemp("student")
    run = subprocess.run([sys.executable, str(ROOT / "tools/make_student.py"), "-o", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return out


# --- the stubbing rule --------------------------------------------------------------------------

def test_stub_keeps_the_def_line_and_docstring_and_uses_the_region_indentation():
    src = 'def f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n'
    assert stub_source(src) == f'def f(x):\n    """Doc."""\n    {STUB}\n'


def test_stub_at_top_level_and_for_several_regions():
    src = "a = 1\n### BEGIN SOLUTION\nN = 3\n### END SOLUTION\nb = 2\n  ### BEGIN SOLUTION\n  M = 4\n  ### END SOLUTION"
    assert stub_source(src) == f"a = 1\n{STUB}\nb = 2\n  {STUB}"


@pytest.mark.parametrize("bad", [
    "### BEGIN SOLUTION\nx = 1\n",                                   # no END
    "x = 1\n### END SOLUTION\n",                                     # END first
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n",    # nested
    "x = 1\n",                                                       # tagged but unmarked
])
def test_unpaired_markers_are_an_error(bad):
    with pytest.raises(SolutionMarkerError):
        stub_source(bad)


def test_cli_reports_a_broken_solution_cell(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1", metadata={"tags": ["solution"]})]
    nbformat.write(nb, tmp_path / "bad.ipynb")
    assert make_student.main([str(tmp_path / "bad.ipynb"), "-o", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out" / "bad.ipynb").exists()


# --- learner copies of the real chapters --------------------------------------------------------

def test_every_chapter_gets_a_learner_copy(student_dir):
    assert sorted(p.name for p in student_dir.glob("*.ipynb")) == sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_learner_copy_changes_only_solutions_and_outputs(path, student_dir):
    full, learner = read(path), read(student_dir / path.name)
    assert learner.metadata == full.metadata
    assert (learner.nbformat, learner.nbformat_minor) == (full.nbformat, full.nbformat_minor)
    assert len(learner.cells) == len(full.cells)
    for i, (a, b) in enumerate(zip(full.cells, learner.cells)):
        assert b.cell_type == a.cell_type and b.metadata == a.metadata, f"cell {i}"
        if a.cell_type == "code":
            assert b.outputs == [] and b.execution_count is None, f"cell {i} keeps outputs"
        if is_solution(a):
            assert b.source == stub_source(a.source) and "SOLUTION" not in b.source, f"cell {i}"
        else:
            assert b.source == a.source, f"cell {i} changed"
            rest = lambda c: {k: v for k, v in c.items() if k not in ("outputs", "execution_count")}  # noqa: E731
            assert rest(b) == rest(a), f"cell {i} changed"


@pytest.mark.parametrize("path", NUMBERED, ids=lambda p: p.name)
def test_chapter_has_auto_checked_exercises(path):
    pairs = exercise_cells(read(path))
    assert len(pairs) >= MIN_EXERCISES, (
        f"{path.name} has {len(pairs)} auto-checked exercises, needs {MIN_EXERCISES}: a code cell tagged "
        "'solution' (### BEGIN/END SOLUTION) followed by a cell calling exercises.check_...")


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_stored_checker_outputs_pass(path):
    nb = read(path)
    for _, checker in exercise_cells(nb):
        cell = nb.cells[checker]
        assert error_name(cell) is None and "✅" in stdout(cell), f"{path.name} cell {checker}: {cell.outputs}"


def learner_copy_problems(full: nbformat.NotebookNode, learner: nbformat.NotebookNode, cwd: Path) -> list[str]:
    """Run a learner copy cell by cell; list checkers that accept a stub and cells that break."""
    checker_of = {c: s for s, c in exercise_cells(full)}
    problems = []
    client = NotebookClient(learner, timeout=300, kernel_name="python3", allow_errors=True,
                            record_timing=False, resources={"metadata": {"path": str(cwd)}})
    with client.setup_kernel():
        for i, cell in enumerate(learner.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, i)
            err = error_name(cell)
            if i in checker_of:
                if err not in STUB_FAILURES:
                    problems.append(f"cell {i}: checker accepted the stub (raised {err}): {stdout(cell)!r}")
                # the chapter's own solution and checker, in the same kernel: they must pass
                solution, checker = copy.deepcopy(full.cells[checker_of[i]]), copy.deepcopy(full.cells[i])
                client.execute_cell(solution, checker_of[i])
                client.execute_cell(checker, i)
                if error_name(solution) or error_name(checker) or "✅" not in stdout(checker):
                    problems.append(f"cell {i}: with the chapter's solution the checker does not pass: {checker.outputs}")
            elif is_solution(cell):
                if err not in (None, "NotImplementedError"):
                    problems.append(f"cell {i}: stubbed solution raised {err}")
            elif err is not None and "raises-exception" not in cell.metadata.get("tags", []):
                problems.append(f"cell {i}: raised {err} in the learner copy")
    return problems


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_learner_copy_checkers_fail_until_solved(path, student_dir):
    # cwd = chapters/ as under nbval, so relative paths in a chapter mean the same thing
    problems = learner_copy_problems(read(path), read(student_dir / path.name), path.parent)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_learner_copy_problems_are_reported(tmp_path):
    """The execution check can fail: a checker passing on a stub, a chapter solution that is wrong."""
    code, tagged = nbformat.v4.new_code_cell, {"tags": ["solution"]}
    full = nbformat.v4.new_notebook()
    full.cells = [
        code("from ampcourse import exercises\nx = 1e-6  # leaks into the exercise below"),
        code("### BEGIN SOLUTION\nx = 2.0**-20\n### END SOLUTION", metadata=tagged),
        code("exercises.check_subnormal_example(x)"),
        code("### BEGIN SOLUTION\nN = 255  # wrong: 256 is exact too\n### END SOLUTION", metadata=tagged),
        code("exercises.check_largest_exact_integer(N, 'bf16')"),
        code("print(N + 1)"),  # needs the solution's state: runs after the chapter's solution is restored
    ]
    problems = learner_copy_problems(full, learner_copy(full), tmp_path)
    assert [p.split(":")[0] for p in problems] == ["cell 2", "cell 4"], problems
    assert "accepted the stub" in problems[0] and "does not pass" in problems[1]
