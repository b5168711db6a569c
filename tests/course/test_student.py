"""Learner copies (`make student`, `make lab`): solutions stubbed, nothing else changed, the checkers bite,
and "Run All" reaches the end.

The execution test runs each learner copy top to bottom as JupyterLab's Run All does (a cell ending in
error stops it, unless tagged raises-exception): every checker must print its verdict without an error,
and the summary cell must list every exercise as not done. That the same checkers pass with the
chapter's own solutions is what nbval proves on the chapters (their stored checker outputs show ✅).
"""

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import make_student  # tools/ (tests/conftest.py puts it on sys.path)
from make_student import (NEXT_TAG, NOTE_TAG, STUB, SUMMARY_TAG, SolutionMarkerError, exercise_cells,
                          is_solution, learner_copy, stub_source)
from nbtool import NAV_END

pytestmark = pytest.mark.starts_first  # minutes in one module: pytest-xdist starts it first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
NUMBERED = [p for p in CHAPTERS if int(p.name[:2]) > 0]  # 00 is the index, not a chapter
WITH_EXERCISES = [p for p in CHAPTERS if exercise_cells(nbformat.read(p, as_version=4))]
MIN_EXERCISES = 2


def read(path: Path) -> nbformat.NotebookNode:
    """A notebook as nbformat v4."""
    return nbformat.read(path, as_version=4)


def error_name(cell: nbformat.NotebookNode) -> str | None:
    """The exception a code cell raised (None if it ran cleanly)."""
    return next((o.ename for o in cell.get("outputs", []) if o.output_type == "error"), None)


def stdout(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell printed to stdout."""
    return "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")


def added(cell: nbformat.NotebookNode) -> bool:
    """Whether a cell is one a learner copy adds (the note on top, the summary and the next-chapter link at the end)."""
    return bool({NOTE_TAG, SUMMARY_TAG, NEXT_TAG} & set(cell.metadata.get("tags", [])))


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


def test_stub_at_top_level_binds_the_answer_to_ellipsis_and_for_several_regions():
    # a top-level raise would stop Run All; `N = ...` lets the checker give its verdict instead
    src = ("a = 1\n### BEGIN SOLUTION\nints = range(9)\nN = 3\n### END SOLUTION\nb = 2\n"
           "def f():\n  ### BEGIN SOLUTION\n  M = 4\n  ### END SOLUTION")
    assert stub_source(src, "check(N)") == f"a = 1\nN = ...  # your code here\nb = 2\ndef f():\n  {STUB}"
    assert stub_source(src).split("\n")[1:3] == ["ints = ...  # your code here", "N = ...  # your code here"]


def test_top_level_stub_names_classes_and_keeps_helpers_hidden():
    src = "### BEGIN SOLUTION\nclass Square:\n    pass\nhelper = 1\n### END SOLUTION"
    assert stub_source(src, "exercises.check_square_function(Square)") == "Square = ...  # your code here"
    assert stub_source("### BEGIN SOLUTION\nprint(1)\n### END SOLUTION", "check()") == "# your code here"


@pytest.mark.parametrize("bad", [
    "### BEGIN SOLUTION\nx = 1\n",                                   # no END
    "x = 1\n### END SOLUTION\n",                                     # END first
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n",    # nested
    "x = 1\n",                                                       # tagged but unmarked
])
def test_unpaired_markers_are_an_error(bad):
    with pytest.raises(SolutionMarkerError):
        stub_source(bad)


@pytest.mark.parametrize("source", [
    "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n",  # balanced: would leak
    "### BEGIN SOLUTION\nx = 1\n",                                                   # unbalanced
    "x = 1\n  ### END SOLUTION",
])
def test_markers_in_a_cell_without_the_solution_tag_are_an_error(source, tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T"), nbformat.v4.new_code_cell(source, metadata={"tags": ["other"]})]
    with pytest.raises(SolutionMarkerError, match="not tagged 'solution'"):
        learner_copy(nb)
    nbformat.write(nb, tmp_path / "leaky.ipynb")
    assert make_student.main([str(tmp_path / "leaky.ipynb"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "leaky.ipynb: cell 1" in err
    assert not (tmp_path / "out" / "leaky.ipynb").exists()


def test_an_output_that_is_a_file_or_read_only_is_a_one_line_error(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert make_student.main([str(CHAPTERS[1]), "-o", str(a_file)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is a file" in err and "Traceback" not in err
    assert a_file.read_text() == "mine"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: a read-only folder is writable anyway")
        assert make_student.main([str(CHAPTERS[1]), "-o", str(locked)]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "read-only" in err
        assert make_student.main([str(CHAPTERS[1]), "-o", str(locked / "sub")]) == 1
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    finally:
        locked.chmod(0o755)


def test_a_read_only_workspace_as_root_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """The same refusal where the OS says so at write time (root passes os.access, a read-only mount does not)."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ws" / "README.md"))
    monkeypatch.setattr(Path, "write_text", refuse)
    assert make_student.main([str(CHAPTERS[1]), "-o", str(tmp_path / "ws")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "permission denied" in err


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"cells": 3}'])
def test_an_unreadable_learner_copy_is_kept_and_named(content, tmp_path, capsys):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / CHAPTERS[1].name).write_bytes(content)
    assert make_student.main([str(CHAPTERS[1]), "-o", str(ws)]) == 0
    assert (ws / CHAPTERS[1].name).read_bytes() == content  # kept: it may be the learner's work
    err = capsys.readouterr().err
    assert f"{CHAPTERS[1].name} is unreadable" in err and "make student" in err


def test_make_student_takes_a_workspace_path_with_a_space(tmp_path):
    venv = Path(sys.prefix)
    ws = tmp_path / "my work space"
    # -o: the venv is already built (do not let make rebuild it); VENV: this interpreter's environment
    run = subprocess.run(["make", "-s", "-o", f"{venv}/.ampcourse-installed", "student", f"VENV={venv}",
                          f"WORKSPACE={ws}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in ws.glob("*.ipynb")) == sorted(p.name for p in CHAPTERS)


def test_next_chapter_links_follow_the_chapter_order(student_dir):
    for path, nxt in zip(CHAPTERS, CHAPTERS[1:]):
        cell = read(student_dir / path.name).cells[-1]
        title = make_student.chapter_title(read(nxt))
        if NAV_END in cell.metadata.get("tags", []):  # the chapter's own closing link (`nbtool.py nav`) stays last
            assert f"[{title}]({nxt.name})" in cell.source, path.name
        else:
            assert title and cell.source == f"**Next:** [{title}]({nxt.name})"


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
    assert learner.metadata.language_info == make_student.kernel_language_info()  # opens unmodified in JupyterLab
    assert learner.metadata.kernelspec == make_student.KERNELSPEC  # the course's kernel, as `make lab` installs it
    assert {k: v for k, v in learner.metadata.items() if k not in ("language_info", "kernelspec")} == {
        k: v for k, v in full.metadata.items() if k not in ("language_info", "kernelspec")}
    assert (learner.nbformat, learner.nbformat_minor) == (full.nbformat, full.nbformat_minor)
    notes = [c for c in learner.cells if NOTE_TAG in c.metadata.get("tags", [])]
    assert len(notes) == 1 and f"../chapters/{path.name}" in notes[0].source  # the solutions stay one click away
    assert "make student" in notes[0].source and "make lab" not in notes[0].source.split("never overwrites")[-1]
    assert ("solutions" in notes[0].source) == bool(exercise_cells(full))  # the index has none to point to
    summaries = [i for i, c in enumerate(learner.cells) if SUMMARY_TAG in c.metadata.get("tags", [])]
    nexts = [i for i, c in enumerate(learner.cells) if NEXT_TAG in c.metadata.get("tags", [])]
    last = len(learner.cells) - 1
    nav = NAV_END in learner.cells[-1].metadata.get("tags", [])  # the chapter's closing links, kept last
    assert nexts == ([] if path == CHAPTERS[-1] or nav else [last])  # every chapter but the last links to the next
    assert summaries == ([last - len(nexts) - nav] if exercise_cells(full) else [])
    kept = [c for c in learner.cells if not added(c)]
    assert len(kept) == len(full.cells)
    checker_of = dict(exercise_cells(full))
    for i, (a, b) in enumerate(zip(full.cells, kept)):
        assert b.cell_type == a.cell_type and b.metadata == a.metadata, f"cell {i}"
        if a.cell_type == "code" and exercise_cells(full):
            assert b.outputs == [] and b.execution_count is None, f"cell {i} keeps outputs"
        elif a.cell_type == "code":  # the index: for reading, its tables shipped as stored
            assert b.outputs == a.outputs, f"cell {i} lost its outputs"
        if is_solution(a):
            check = full.cells[checker_of[i]].source if i in checker_of else None
            assert b.source == stub_source(a.source, check) and "SOLUTION" not in b.source, f"cell {i}"
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
    """Run a learner copy top to bottom as Run All does; list what stops it and checkers that accept a stub."""
    checkers = {i for i, c in enumerate(learner.cells) if c.cell_type == "code" and make_student.checker_calls(c)
                and not added(c)}
    n_exercises = len(exercise_cells(full))
    client = NotebookClient(learner, timeout=300, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})  # allow_errors=False: like Run All
    try:
        client.execute()
    except CellExecutionError as err:
        return [f"Run All stopped: {str(err)[-600:]}"]
    problems = []
    for i in sorted(checkers):
        cell = learner.cells[i]
        if error_name(cell) or "❌" not in stdout(cell) or "not yet" not in stdout(cell):
            problems.append(f"cell {i}: checker did not reject the stub with a verdict: {cell.outputs}")
        elif "expected:" not in stdout(cell) or "hint:" not in stdout(cell):
            problems.append(f"cell {i}: verdict without expected/hint: {stdout(cell)!r}")
    last = next((c for c in reversed(learner.cells) if not {NEXT_TAG, NAV_END} & set(c.metadata.get("tags", []))), None)
    if n_exercises and (last is None or SUMMARY_TAG not in last.metadata.get("tags", [])
                        or f"Exercises done: 0 of {n_exercises}" not in stdout(last)):
        problems.append(f"summary cell: {last.outputs}")
    return problems


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_learner_copy_runs_to_the_end_and_every_checker_gives_its_verdict(path, student_dir):
    # cwd = chapters/ as under nbval, so relative paths in a chapter mean the same thing
    problems = learner_copy_problems(read(path), read(student_dir / path.name), path.parent)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_learner_copy_problems_are_reported(tmp_path):
    """The execution check can fail: a checker passing on a stub, a cell that stops Run All."""
    code, tagged = nbformat.v4.new_code_cell, {"tags": ["solution"]}
    full = nbformat.v4.new_notebook()
    full.cells = [
        code("from ampcourse import exercises"),
        code("### BEGIN SOLUTION\nx = 2.0**-20\n### END SOLUTION", metadata=tagged),
        code("exercises.check_subnormal_example(2.0**-20)"),  # ignores the learner's answer: accepts the stub
        code("### BEGIN SOLUTION\nN = 256\n### END SOLUTION", metadata=tagged),
        code("exercises.check_largest_exact_integer(N, 'bf16')"),
    ]
    problems = learner_copy_problems(full, learner_copy(full), tmp_path)
    assert [p.split(":")[0] for p in problems] == ["cell 2", "summary cell"], problems  # 1 of 2 "done"
    assert "did not reject" in problems[0]
    full.cells.insert(3, code("print(N + 1)"))  # needs a solution the learner has not written
    problems = learner_copy_problems(full, learner_copy(full), tmp_path)
    assert len(problems) == 1 and "Run All stopped" in problems[0] and "NameError" in problems[0], problems


# --- the checkers: verdicts in notebooks, ExerciseError in tests --------------------------------

def test_every_checker_is_exported_and_wrapped():
    """A new chapter's checkers reach the notebook through ampcourse.exercises, wrapped (summary, no traceback)."""
    from ampcourse import exercises
    found = []
    for mod in pkgutil.iter_modules(exercises.__path__):
        if mod.name.startswith("ch"):
            module = importlib.import_module(f"ampcourse.exercises.{mod.name}")
            found += [n for n in dir(module) if n.startswith("check_") and getattr(module, n).__module__ == module.__name__]
    assert found
    for name in found:
        fn = getattr(exercises, name, None)
        assert fn is not None and name in exercises.__all__, f"{name}: import it in ampcourse/exercises/__init__.py"
        assert getattr(fn, "_ampcourse_checker", False), f"{name} is not wrapped by _core.checker"


def test_outside_a_notebook_a_wrong_answer_raises_and_summary_counts_it(capsys, monkeypatch):
    from ampcourse import exercises
    from ampcourse.exercises import _core
    for verdicts in ("_results", "_titles"):  # start from no verdicts: other tests in this process ran checkers
        monkeypatch.setattr(_core, verdicts, {})
    with pytest.raises(exercises.ExerciseError, match="expected"):
        exercises.check_largest_exact_integer(255, "bf16")
    with pytest.raises(exercises.ExerciseError):
        exercises.check_fp16_ulp(lambda x: 2.0 ** -10)  # right only near 1
    exercises.check_largest_exact_integer(256, "bf16")
    capsys.readouterr()
    exercises.summary(["check_largest_exact_integer", "check_subnormal_example"])
    out = capsys.readouterr().out
    assert "Exercises done: 1 of 2" in out and "✅ Exercise 1.2" in out and "· Exercise 1.3" in out
    with pytest.raises(ValueError, match="names"):
        exercises.summary(["check_nothing"])


def test_in_a_kernel_a_wrong_answer_prints_its_verdict_and_raising_restores_the_error(tmp_path):
    code = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [code("from ampcourse import exercises\nexercises.check_largest_exact_integer(255, 'bf16')"),
                code('def check_demo(x):\n    """Exercise 9.9: a checker that cannot use its answer."""\n    return len(x)\n'
                     "exercises.checker(check_demo)(...)"),
                code("with exercises.raising():\n    exercises.check_largest_exact_integer(255, 'bf16')",
                     metadata={"tags": ["raises-exception"]}),
                code("exercises.summary()")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    first, junk, strict, summary = nb.cells
    assert error_name(first) is None and "❌ Exercise 1.2" in stdout(first) and "hint:" in stdout(first)
    assert error_name(junk) is None and "❌ Exercise 9.9" in stdout(junk) and "replace the `...`" in stdout(junk)
    assert error_name(strict) == "ExerciseError"
    assert "Exercises done: 0 of 2" in stdout(summary)


# --- the learner's workspace (`make lab`) ---------------------------------------------------------

def test_workspace_is_made_once_kept_and_gets_new_chapters(tmp_path):
    chapters, ws = tmp_path / "chapters", tmp_path / "workspace"
    chapters.mkdir()
    for p in CHAPTERS[:2]:
        (chapters / p.name).write_bytes(p.read_bytes())
    assert make_student.main([str(p) for p in sorted(chapters.glob("*.ipynb"))] + ["-o", str(ws)]) == 0
    made = sorted(p.name for p in ws.glob("*.ipynb"))
    assert made == sorted(p.name for p in CHAPTERS[:2]) and (ws / "README.md").exists()

    mine = ws / CHAPTERS[0].name  # the learner edits and runs a copy ...
    nb = read(mine)
    nb.cells.append(nbformat.v4.new_code_cell("my_answer = 42"))
    nbformat.write(nb, mine)
    before = mine.read_bytes()
    (chapters / CHAPTERS[2].name).write_bytes(CHAPTERS[2].read_bytes())  # ... and a new chapter arrives
    assert make_student.main([str(p) for p in sorted(chapters.glob("*.ipynb"))] + ["-o", str(ws)]) == 0
    assert mine.read_bytes() == before, "make lab overwrote the learner's copy"
    assert (ws / CHAPTERS[2].name).exists()
    assert not list(ws.glob(".*.tmp")), "a temporary file was left behind"
    assert make_student.main([str(chapters / CHAPTERS[0].name), "-o", str(ws), "--overwrite"]) == 0
    assert "my_answer" not in mine.read_text()


def test_git_ignores_the_workspace():
    run = subprocess.run(["git", "check-ignore", "workspace/01_precision_basics.ipynb", "workspace/README.md"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, "workspace/ must be in .gitignore: a learner's git pull would conflict with it"


def test_binder_opens_the_same_workspace():
    post_build = (ROOT / "binder/postBuild").read_text()
    assert "tools/make_student.py -o workspace" in post_build
    assert "labpath=workspace" in (ROOT / "README.md").read_text()
    assert "--name python3" in post_build and "--env OMP_NUM_THREADS 1" in post_build


def _placeholder_call(fn):
    """Call a checker as a learner copy's stub does: `...` for every answer it needs (raising: ExerciseError)."""
    import inspect
    n = sum(1 for p in inspect.signature(fn.__wrapped__).parameters.values() if p.default is p.empty)
    with pytest.raises(Exception) as err:
        fn(*[...] * n)
    return str(err.value)


def test_a_stub_verdict_names_the_exercise_as_its_answered_verdict_does(monkeypatch):
    """Issue 28 item 14: `N = ...` got "❌ Exercise 1.2: not yet", the docstring's label, not the checker's title."""
    from ampcourse import exercises
    from ampcourse.exercises import _core
    for verdicts in ("_results", "_titles"):
        monkeypatch.setattr(_core, verdicts, {})
    for name in [n for n in exercises.__all__ if n.startswith("check_")]:
        message = _placeholder_call(getattr(exercises, name))
        first = message.splitlines()[0]
        assert "not answered yet" in message and re.match(r"❌ Exercise \d+\.\d+ \(.+\): not yet\.$", first), (name, first)
    # an f-string title takes the call's own arguments, and summary() shows the same title
    with pytest.raises(exercises.ExerciseError, match=r"Exercise 1\.2 \(largest exact integer in fp16\): not yet"):
        exercises.check_largest_exact_integer(..., "fp16")
    assert _core._titles["check_largest_exact_integer"] == "Exercise 1.2 (largest exact integer in fp16)"


def test_working_out_a_title_never_calls_the_learners_function():
    from ampcourse.exercises import _core
    calls = []

    def check_demo(fn, n=3):
        """Exercise 9.9: a title that would call the learner's function."""
        title = f"Exercise 9.9 ({fn(n)})"
        return title

    assert _core._declared_title(check_demo, (lambda n: calls.append(n),), {}) is None and calls == []


# --- markers as authors write them (issue 30, item 10): a learner copy never holds a solution --------

SECRET = "N = 4242  # the answer"


def _nb(*cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 9 · T"), *cells]
    return nb


def _solution(source: str, **metadata) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source, metadata={"tags": ["solution"], **metadata})


@pytest.mark.parametrize("begin, end", [("#### BEGIN SOLUTION", "#### END SOLUTION"), ("# BEGIN SOLUTION", "# END SOLUTION"),
                                        ("###BEGIN SOLUTION", "###END SOLUTION"), ("  ### BEGIN SOLUTION  ", "### END SOLUTION")])
def test_the_marker_spellings_nbgrader_accepts_are_stubbed(begin, end):
    src = f"x = 1\n### BEGIN SOLUTION\nM = 1\n### END SOLUTION\n{begin.strip()}\n{SECRET}\n{end}\n"
    copy = learner_copy(_nb(_solution(src), nbformat.v4.new_code_cell("exercises.check_x(N, M)")))
    stubbed = copy.cells[1].source
    assert "4242" not in stubbed and "SOLUTION" not in stubbed
    assert stubbed == "x = 1\nM = ...  # your code here\nN = ...  # your code here\n"


@pytest.mark.parametrize("line", ["### BEGIN SOLUTION (part 2)", "### begin solution", "## BEGIN_SOLUTION",
                                  "print('### BEGIN SOLUTION')", "### BEGIN SOLUTION: part 2"])
def test_a_line_that_looks_like_a_marker_but_is_not_one_is_an_error(line):
    src = f"### BEGIN SOLUTION\nM = 1\n### END SOLUTION\n{line}\n{SECRET}\n### END SOLUTION\n"
    with pytest.raises(SolutionMarkerError, match="looks like a solution marker"):
        learner_copy(_nb(_solution(src)))
    with pytest.raises(SolutionMarkerError, match="not tagged"):  # untagged, it would have been copied as is
        learner_copy(_nb(nbformat.v4.new_code_cell(f"{line}\n{SECRET}\n")))


@pytest.mark.parametrize("eol", ["\r\n", "\r"])
def test_crlf_and_cr_line_endings_are_understood(eol):
    src = eol.join(["x = 1", "### BEGIN SOLUTION", SECRET, "### END SOLUTION", ""])
    copy = learner_copy(_nb(_solution(src), nbformat.v4.new_code_cell("exercises.check_x(N)")))
    assert copy.cells[1].source == "x = 1\nN = ...  # your code here\n"
    with pytest.raises(SolutionMarkerError, match="not tagged"):
        learner_copy(_nb(nbformat.v4.new_code_cell(src)))


@pytest.mark.parametrize("kind", ["markdown", "raw"])
def test_markers_in_a_markdown_or_raw_cell_are_an_error(kind):
    make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_raw_cell
    cell = make(f"The answer:\n### BEGIN SOLUTION\n{SECRET}\n### END SOLUTION\n", metadata={"tags": ["solution"]})
    with pytest.raises(SolutionMarkerError, match=f"cell 1: a solution marker in a {kind} cell"):
        learner_copy(_nb(cell))


def test_null_tags_are_no_tags_and_other_tags_are_an_error(tmp_path, capsys):
    plain = nbformat.v4.new_code_cell("y = 2")
    plain.metadata["tags"] = None  # as some editors write it
    assert learner_copy(_nb(plain)).cells[1].source == "y = 2"
    odd = _solution(f"### BEGIN SOLUTION\n{SECRET}\n### END SOLUTION")
    odd.metadata["tags"] = "solution"  # a string, not a list: is it tagged? not understood
    with pytest.raises(SolutionMarkerError, match="cell 1: cell tags must be a list of strings"):
        learner_copy(_nb(odd))
    nbformat.write(_nb(odd), tmp_path / "odd.ipynb")
    assert make_student.main([str(tmp_path / "odd.ipynb"), "-o", str(tmp_path / "out")]) == 1
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "out" / "odd.ipynb").exists()


@pytest.mark.parametrize("block", [
    "for i in range(3):\n    N = i + 1",
    "with contextlib.nullcontext() as ctx:\n    N = 3",
    "if True:\n    N = 3\nelse:\n    N = 4",
    "try:\n    N = 3\nexcept ValueError as err:\n    N = 4",
    "while (N := 3) < 0:\n    pass",
])
def test_names_bound_inside_top_level_blocks_get_a_stub_and_the_checker_cell_runs(block):
    full = _nb(_solution(f"import contextlib\n### BEGIN SOLUTION\n{block}\n### END SOLUTION"),
               nbformat.v4.new_code_cell("exercises.check_x(N)"))
    stubbed = learner_copy(full).cells[1].source
    assert "N = ...  # your code here" in stubbed
    namespace: dict = {}
    exec(stubbed, namespace)  # the learner's Run All: the cell runs ...
    assert namespace["N"] is ...  # ... and the checker gets the placeholder, not a NameError


def test_a_region_in_a_top_level_block_is_not_a_raise():
    """Indented but outside any def: a `raise` there would end the cell in error and stop Run All."""
    src = "total = 0\nfor x in range(3):\n    ### BEGIN SOLUTION\n    total += x\n    ### END SOLUTION\n"
    stubbed = stub_source(src, "exercises.check_x(total)")
    assert "raise" not in stubbed and "    total = ...  # your code here" in stubbed
    exec(stubbed, {})
    assert stub_source("for x in range(3):\n    ### BEGIN SOLUTION\n    print(x)\n    ### END SOLUTION\n", "check()") == (
        "for x in range(3):\n    pass  # your code here\n")  # nothing to bind: the block must not be empty
    inside = stub_source("def f(x):\n    for y in x:\n        ### BEGIN SOLUTION\n        y += 1\n        ### END SOLUTION\n")
    assert inside == f"def f(x):\n    for y in x:\n        {STUB}\n"


def test_learner_copies_never_replace_the_chapters_they_are_made_from(tmp_path, capsys):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    full = chapters / CHAPTERS[1].name
    full.write_bytes(CHAPTERS[1].read_bytes())
    for extra in (["--overwrite"], []):
        assert make_student.main([*extra, "-o", str(chapters), str(full)]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "folder of the full chapters" in err
        assert full.read_bytes() == CHAPTERS[1].read_bytes()
    assert make_student.main(["-o", str(ROOT / "chapters"), str(full)]) == 1  # the repository's chapters/ too
