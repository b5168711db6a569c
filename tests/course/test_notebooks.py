"""The chapter notebooks: clean in git, in order, framed like a course chapter, importing ampcourse."""

import re
import sys
from pathlib import Path

import nbformat
import pytest

import nbtool  # tools/ (tests/conftest.py puts it on sys.path)

ROOT = Path(__file__).resolve().parents[2]

CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))


def test_chapters_exist_and_are_numbered_in_order():
    numbers = [int(p.name[:2]) for p in CHAPTERS]
    assert numbers and numbers == sorted(set(numbers))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_is_clean(path):
    assert nbtool.problems(path) == []


@pytest.mark.parametrize("path", [p for p in CHAPTERS if int(p.name[:2]) > 0], ids=lambda p: p.name)
def test_chapter_frame(path):
    nb = nbformat.read(path, as_version=4)
    md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# Chapter")
    for heading in ["What you will learn", "Time and hardware", "## Summary", "## Exercises"]:
        assert heading in md, f"{path.name} lacks {heading!r}"
    assert "pick(" in code, "every chapter chooses its device through ampcourse.device.pick"
    assert not re.search(r"\.cuda\(\)", code), "no hard-coded .cuda(): use the device from pick()"
    assert "torch.cpu.amp" not in code, "teach torch.amp, not the deprecated torch.cpu.amp"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_solution_cells_are_marked(path):
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if "solution" in c.metadata.get("tags", []):
            assert "### BEGIN SOLUTION" in c.source and "### END SOLUTION" in c.source


def test_stale_outputs_fail_nbval(tmp_path):
    """A notebook whose stored output no longer matches what the code prints must fail."""
    import subprocess

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)", execution_count=1,
                                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="41\n")])]
    nb.metadata["kernelspec"] = nbtool.KERNELSPEC
    path = tmp_path / "stale.ipynb"
    nbformat.write(nb, path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                          "--nbval-current-env", str(path), "-c", "/dev/null"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-2000:]


def test_clean_scrubs_machine_paths_from_tracebacks(tmp_path):
    """An expected error's traceback names files by absolute path (inside ANSI colour codes): clean() removes them."""
    nb = nbformat.v4.new_notebook()
    frame = "\x1b[36mFile \x1b[39m\x1b[32m/home/ada/venvs/amp/lib/python3.11/site-packages/torch/amp/grad_scaler.py:342\x1b[39m"
    own = f"\x1b[36mFile \x1b[39m\x1b[32m{ROOT}/ampcourse/scaling.py:10\x1b[39m"
    err = nbformat.v4.new_output("error", ename="RuntimeError", evalue="boom", traceback=[frame, own])
    nb.cells = [nbformat.v4.new_code_cell("raise RuntimeError('boom')", execution_count=1, outputs=[err])]
    path = tmp_path / "err.ipynb"
    nbformat.write(nb, path)
    assert any("machine path" in p for p in nbtool.problems(path))
    nbformat.write(nbtool.clean(nbformat.read(path, as_version=4)), path)
    assert nbtool.problems(path) == []
    tb = nbformat.read(path, as_version=4).cells[0].outputs[0].traceback
    assert "<site-packages>/torch/amp/grad_scaler.py:342" in tb[0] and "\x1b[32mampcourse/scaling.py:10" in tb[1]


def _format_limits() -> set[str]:
    """The ways prose would type a format's max, smallest normal or smallest subnormal (65504, 6.1e-05, ...)."""
    from ampcourse import formats
    typed = set()
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        s = formats.spec(name)
        for v in (s.max, s.min_normal, s.min_subnormal):
            typed |= {f"{v:g}", f"{v:.1e}", f"{v:.2g}", f"{v:.2e}", f"{v:.3g}"}
    return {t for t in typed if len(t.replace(".", "").replace("e", "").replace("-", "").replace("+", "")) >= 3}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_prose_does_not_type_format_limits_that_code_prints(path):
    """Never type into prose a number code can show: fp16's 65504 or 6.1e-05 come from torch.finfo / formats.spec
    in a cell. Numbers in `code spans` (an input to try, a call) and in code cells are fine."""
    limits = _format_limits()
    found = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "markdown":
            continue
        prose = re.sub(r"`[^`]*`", " ", cell.source)  # code spans are code
        for token in re.findall(r"(?<![\w.])\d[\d.,]*(?:e[-+]?\d+)?(?![\w])", prose):
            if token.replace(",", "") in limits:
                found.append(f"cell {i}: {token}")
    assert not found, f"{path.name} types format limits in prose (print them from code instead): {found}"


def _workspace_folder() -> str:
    """The folder `make lab` / `make student` copy the chapters into (the Makefile's WORKSPACE)."""
    return re.search(r"^WORKSPACE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def _reader_text(path: Path) -> str:
    """What a reader sees of a notebook (every cell's source) or a Markdown file."""
    if path.suffix == ".ipynb":
        return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    return path.read_text()


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_learner_copies_are_named_by_the_folder_make_writes(path):
    """The learner copies live where the Makefile puts them; a folder that does not exist (`student/`,
    the target's name rather than its folder) sends a learner looking for nothing."""
    workspace = _workspace_folder()
    text = _reader_text(path)
    folders = set(re.findall(r"`(\w+)/`", text)) - {"chapters", "tests", "tools", "binder", "examples", "benchmarks",
                                                    "ampcourse", "runs", "shared"}
    assert folders <= {workspace}, f"{path.name} names {sorted(folders - {workspace})}/: the copies are in {workspace}/"
    assert not re.search(r"(?<![\w_-])student/", text), f"{path.name} names student/: the copies are in {workspace}/"


def test_readme_and_index_binder_badges_open_the_same_notebook():
    """One story: the README's badge and the index's open the same notebook (the learner's copy of the index)."""
    badge = re.compile(r"https://mybinder\.org/v2/gh/[^)\s]+")
    readme = set(badge.findall((ROOT / "README.md").read_text()))
    index = set(badge.findall(_reader_text(ROOT / "chapters" / "00_index.ipynb")))
    assert len(readme) == 1 and readme == index, f"README {readme} vs index {index}"
    assert f"labpath={_workspace_folder()}%2F00_index.ipynb" in readme.pop()


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_a_forced_exit_in_an_example_says_why_with_its_cause(path):
    """Examples are code learners copy: os._exit (no atexit handlers, no flushes) only with the measured cause
    and the upstream issue next to it, and with the streams flushed by hand."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if "os._exit(" in line:
            before = "\n".join(lines[max(0, i - 14):i])
            assert re.search(r"pytorch/pytorch#\d+", before) and "measured" in before, \
                f"{path.name}:{i + 1}: os._exit without the measured cause and the upstream issue beside it"
            assert "sys.stdout.flush()" in before and "sys.stderr.flush()" in before, f"{path.name}: flush before os._exit"


# Claims an expert review found wrong (issue 20), each with the live computation that now stands in its place.
# Prose must not come back to the wrong claim; the cell that computes the right one must stay.
WRONG_CLAIMS = [
    ("03_torch_amp_api", r"do \*?not\*? promote by themselves \(they raise",
     "autocast's promote lists hold ops that promote natively too (addcmul, atan2): the chapter runs them"),
    ("07_multi_gpu", r"keeps bf16's 8 significant bits|8 significant bits per averaged",
     "a bf16 all-reduce rounds at every addition; the error grows with the world size"),
    ("04_amp_training_loop", r"50264 is the classic fix",
     "nanoGPT pads 50257 to 50304, a multiple of 64; multiples of 8 were old cuBLAS's fp16 rule"),
    ("05_custom_precision", r"is the standard example",
     "the built-in RMSNorm upcasts; a hand-written one is an example, not the standard"),
    ("*", r"bf16 on (a )?CPUs?\b|bf16 on CPUs and",
     "pick() decides a CPU's precision by its units and prints why: no blanket 'bf16 on CPUs'"),
]
LIVE_CHECKS = [
    ("03_torch_amp_api", ["PROMOTE_LISTS", "_dispatch_has_kernel_for_dispatch_key", "mixed_dtype("]),
    ("03_torch_amp_api", ["create_selective_checkpoint_contexts", "cache_enabled=False"]),
    ("04_amp_training_loop", ["pad_to(GPT2_VOCAB, 64) == 50304"]),
    ("05_custom_precision", ["F.rms_norm(", "'aten::rms_norm'"]),
    ("07_multi_gpu", ["reduction_error(", "rounding_steps("]),
]


def _cells(stem: str, kind: str) -> list[str]:
    return [c.source for c in nbformat.read(ROOT / "chapters" / f"{stem}.ipynb", as_version=4).cells if c.cell_type == kind]


@pytest.mark.parametrize("stem,pattern,why", WRONG_CLAIMS, ids=[f"{s}:{p[:20]}" for s, p, _ in WRONG_CLAIMS])
def test_prose_does_not_bring_back_a_corrected_claim(stem, pattern, why):
    stems = [p.stem for p in CHAPTERS] if stem == "*" else [stem]
    hits = [(s, m.group(0)) for s in stems for md in _cells(s, "markdown") for m in re.finditer(pattern, md)]
    assert not hits, f"{hits}: {why}"


@pytest.mark.parametrize("stem,snippets", LIVE_CHECKS, ids=[s for s, _ in LIVE_CHECKS])
def test_corrected_claims_stay_computed_live(stem, snippets):
    code = "\n".join(_cells(stem, "code"))
    missing = [s for s in snippets if s not in code]
    assert not missing, f"{stem}: the cell computing the claim is gone ({missing})"


def test_chapter_3_cites_the_recompute_issues_it_demonstrates():
    text = "\n".join(_cells("03_torch_amp_api", "markdown"))
    for issue in ("pytorch/pytorch#193338", "pytorch/pytorch#148831", "pytorch/pytorch#182580"):
        assert issue in text, issue
