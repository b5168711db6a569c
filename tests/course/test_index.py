"""chapters/00_index.ipynb and ampcourse.course: the index links every chapter that exists and nothing else,
the outline mapping names sections that exist, and the glossary has the core terms in both languages."""

import re
from pathlib import Path

import nbformat
import pytest

from ampcourse import course

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
INDEX = CHAPTERS / "00_index.ipynb"
REQUIRED_OUTLINE = {"1", "2.1", "2.1.1", "2.1.2", "2.2.1", "2.2.2", "2.3.1", "2.3.2", "2.3.3", "3.1.1", "3.1.2"}
REQUIRED_TERMS = {
    "mixed precision": "混合精度", "loss scaling": "损失缩放", "half precision": "半精度", "single precision": "单精度",
    "gradient scaling": "梯度缩放", "underflow": "下溢", "overflow": "上溢", "master weights": "主权重",
    "autocast": "自动类型转换", "dynamic loss scaling": "动态损失缩放",
}
LINK = re.compile(r"\](?!\(\w+://)\(([^)\s#]+\.ipynb)(?:#[^)]*)?\)")  # relative links to notebooks
STALE = "re-run it (`make notebooks`): the index lists the chapters that exist when it is executed"


def index_text() -> str:
    """Everything a reader of the index sees: markdown cells and the stored Markdown outputs."""
    nb = nbformat.read(INDEX, as_version=4)
    parts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    for c in nb.cells:
        for out in c.get("outputs", []):
            parts.append(out.get("data", {}).get("text/markdown", ""))
    return "\n".join(parts)


def existing_chapters() -> set[str]:
    """File names of the numbered chapters (not the index itself)."""
    return {p.name for p in CHAPTERS.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00")}


def test_index_links_only_chapters_that_exist():
    links = set(LINK.findall(index_text()))
    missing = sorted(link for link in links if not (CHAPTERS / link).is_file())
    assert not missing, f"00_index.ipynb links {missing}, which do not exist; {STALE}"


def test_index_links_every_chapter():
    unlinked = sorted(existing_chapters() - set(LINK.findall(index_text())))
    assert not unlinked, f"00_index.ipynb does not link {unlinked}; {STALE}"


def test_index_stored_tables_match_what_the_code_makes_now():
    text = index_text()
    for table in (course.chapter_table(CHAPTERS), course.outline_table(CHAPTERS), course.glossary_table(CHAPTERS)):
        assert table in text, f"a table in 00_index.ipynb is out of date; {STALE}"


def test_outline_covers_the_source_outline_once():
    numbers = [s.number for s in course.OUTLINE]
    assert set(numbers) == REQUIRED_OUTLINE and len(numbers) == len(set(numbers))


def test_outline_names_sections_the_chapters_have():
    course.outline_table(CHAPTERS)  # raises ValueError naming the section and chapter otherwise


def test_outline_mapping_catches_a_section_that_is_not_there(monkeypatch):
    bad = course.OutlineSection("2.1", "precision basics", 1, ("1.99",))
    monkeypatch.setattr(course, "OUTLINE", (bad,))
    with pytest.raises(ValueError, match=r"\['1\.99'\].*01_precision_basics"):
        course.outline_table(CHAPTERS)


def outline_numbers(line: str) -> set[str]:
    """Outline section numbers in a chapter's 'Source outline' line; '2.3.1–2.3.3' expands to three."""
    found = set()
    for a, b in re.findall(r"(?<![\w.])(\d+(?:\.\d+)*)(?:\s*[–-]\s*(\d+(?:\.\d+)*))?(?![\w.])", line):
        found.add(a)
        if b:
            head, lo, hi = a.rsplit(".", 1)[0], int(a.rsplit(".", 1)[1]), int(b.rsplit(".", 1)[1])
            found |= {f"{head}.{k}" for k in range(lo, hi + 1)}
    return found


@pytest.mark.parametrize("chapter", [ch for n, ch in course.find_chapters(CHAPTERS).items()
                                     if n in {s.chapter for s in course.OUTLINE}], ids=lambda ch: ch.path.name)
def test_each_chapter_names_the_outline_sections_the_index_gives_it(chapter):
    number = chapter.number
    first = nbformat.read(chapter.path, as_version=4).cells[0].source
    line = next((ln for ln in first.splitlines() if "Source outline" in ln), "")
    claimed = {s.number for s in course.OUTLINE if s.chapter == number}
    assert claimed <= outline_numbers(line), f"{chapter.path.name} says {line!r}; the index maps {sorted(claimed)} to it"


def test_glossary_has_the_core_terms_in_english_and_chinese():
    terms = {t.en.split(" (")[0]: t.zh for t in course.GLOSSARY}
    for en, zh in REQUIRED_TERMS.items():
        assert en in terms and zh in terms[en], f"glossary: {en} / {zh}"
    assert all(1 <= t.chapter <= max(course.CHAPTER_OUTLINE) for t in course.GLOSSARY)


def test_outline_numbers_parser():
    assert outline_numbers("section 1 and 2.1 (precision basics), 2.1.1 (fp16 vs fp32).") == {"1", "2.1", "2.1.1"}
    assert outline_numbers("sections 2.3.1–2.3.3 (training with AMP)") == {"2.3.1", "2.3.2", "2.3.3"}


def test_glossary_says_when_ddp_all_reduces_as_chapter_7_does():
    """DDP all-reduces bucket by bucket while backward runs (chapter 7, 7.3), not after it."""
    ddp = next(t for t in course.GLOSSARY if t.en.startswith("data parallel"))
    chapter7 = "\n".join(c.source for c in nbformat.read(CHAPTERS / "07_multi_gpu.ipynb", as_version=4).cells)
    assert "overlapping with the rest of backward" in chapter7
    assert "during backward" in ddp.meaning and "bucket" in ddp.meaning and "after backward" not in ddp.meaning


def test_outline_maps_the_seeds_training_sections_to_what_they_teach():
    """The seed's 2.3.1 initialises the AMP environment and 2.3.2 writes the loop (issue 28, item 11)."""
    by_number = {s.number: s for s in course.OUTLINE}
    init, loop = by_number["2.3.1"], by_number["2.3.2"]
    assert "initialis" in init.topic and "GradScaler" in init.topic
    assert {"4.0", "4.3"} <= set(init.sections)  # pick() chooses device and dtype; 4.3 creates the GradScaler
    assert "loop" in loop.topic and "scaler" not in loop.topic
    assert {"4.1", "4.2", "4.4"} <= set(loop.sections) and not set(init.sections) & set(loop.sections)


# --- navigation (issue 28, item 18): every chapter links to the index at its top and its end ---------------

import nbtool  # noqa: E402  (tools/nbtool.py: tests/conftest.py puts tools/ on sys.path)

NOTEBOOKS = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_links_to_the_index_at_its_top_and_end_and_its_badge_opens_the_workspace(path):
    """What `tools/nbtool.py nav --check` reports; `tools/nbtool.py nav chapters/*.ipynb` fixes it (markdown only)."""
    nxt = nbtool.chapter_order(NOTEBOOKS)[path]
    problems = nbtool.nav_problems(nbformat.read(path, as_version=4), path.name, nxt)
    assert not problems, f"{path.name}: {problems}"


def test_nav_is_idempotent_and_the_last_chapter_ends_with_a_link_too():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 10 · Last\n\n[![Binder](x)](https://mybinder.org/v2/gh/a/b/main?labpath=chapters%2F10_x.ipynb)"),
                nbformat.v4.new_code_cell("1")]
    once = nbtool.add_nav(nbformat.from_dict(nb), "10_x.ipynb", None)
    twice = nbtool.add_nav(nbformat.from_dict(once), "10_x.ipynb", None)
    shown = lambda nb: [(c.cell_type, c.source, c.metadata) for c in nb.cells]  # noqa: E731 (ids are new each time)
    assert shown(once) == shown(twice) and nbtool.nav_problems(once, "10_x.ipynb", None) == []
    assert nbtool.nav_problems(nb, "10_x.ipynb", None)  # before: three problems
    top, end = once.cells[1].source, once.cells[-1].source
    assert "(00_index.ipynb)" in top and "(00_index.ipynb)" in end and "end of the course" in end
    assert "labpath=workspace%2F10_x.ipynb" in once.cells[0].source and "chapters%2F" not in once.cells[0].source
    renamed = nbtool.add_nav(nbformat.from_dict(once), "10_x.ipynb", ("11_y.ipynb", "Chapter 11 · More"))
    assert len(renamed.cells) == len(once.cells) and "[Chapter 11 · More](11_y.ipynb)" in renamed.cells[-1].source
    assert [c.cell_type for c in renamed.cells].count("code") == 1 and renamed.cells[2].source == "1"


def test_glossary_numbers_are_what_the_formats_say():
    """Its numbers come from code: bf16's largest run of exact integers, its unit roundoff, the MX block."""
    import torch
    from ampcourse.fp8 import GRANULARITIES

    terms = {t.en: t.meaning for t in course.GLOSSARY}
    top = round(2 / torch.finfo(torch.bfloat16).eps)  # 2**(mantissa bits + 1)
    assert torch.tensor(float(top + 1)).bfloat16().item() == top and torch.tensor(float(top)).bfloat16().item() == top
    assert f"only up to {top} ({top + 1} rounds to {top})" in terms["rotary position embedding (RoPE)"]
    assert "L * 2**-8" in terms["attention-logit growth"] and torch.finfo(torch.bfloat16).eps / 2 == 2.0**-8
    assert f"blocks of {GRANULARITIES['mx'][0][1]} " in terms["microscaling (MX) format"]
