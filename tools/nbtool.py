"""Keep the chapter notebooks executed and clean (nbdev-style), so nbval has outputs to compare.

    python tools/nbtool.py execute chapters/*.ipynb   # run top to bottom, store outputs, clean
    python tools/nbtool.py clean chapters/*.ipynb     # strip noisy metadata only
    python tools/nbtool.py check chapters/*.ipynb     # exit 1 if a notebook is not clean
    python tools/nbtool.py nav chapters/*.ipynb       # links to the index and the next chapter, Binder badge
    python tools/nbtool.py nav --check chapters/*.ipynb   # exit 1 if a chapter's links are missing or stale

"Clean" means: no execution timestamps, no widget state, no machine paths, a standard python3
kernelspec, only the cell metadata that means something (tags), and execution counts 1..n.

It also means "opens unmodified in JupyterLab". JupyterLab copies the kernel's ``language_info``
(kernel_info reply: name, version, mimetype, codemirror_mode, ...) into the notebook when the kernel
connects; if the stored one differs (a trimmed dict, another Python version), the notebook is marked
modified on open and autosave writes it back. So ``language_info`` is stored whole, as the kernel that
executed the notebook reported it (cell ids and nbformat 4.4 do not matter: checked in a browser).
A widget's output keeps no ``widget-view`` entry: without stored widget state JupyterLab can only show
"Error displaying widget: model not found" for it; the text/plain left says to run the cells.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import nbformat

# The course's one kernel: "python3" (the name Jupyter and nbclient know everywhere), shown as "ampcourse";
# `make lab` and Binder install it under that display name, so a notebook opens unmodified in the course's
# JupyterLab (JupyterLab rewrites a kernelspec that differs from the kernel's and marks the notebook modified).
KERNELSPEC = {"display_name": "ampcourse", "language": "python", "name": "python3"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KEEP_CELL_METADATA = ("tags",)
# Absolute paths of the machine that ran the notebook have no place in the course.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|tmp|home|Users|opt|usr)/[\w.+-]+(?:/[\w.+-]+)*")
# Terminal colour codes as they appear, JSON-escaped, in the .ipynb text of tracebacks.
ANSI_JSON = re.compile(r"\\u001b\[[0-9;]*m")
# Where an installed package's file sits: everything up to site-packages/ says which machine ran it.
SITE_PACKAGES = re.compile(r"/[^\s\"'\x1b]*?/site-packages/")


def scrub_paths(text: str, repo: Path) -> str:
    """Replace this machine's paths in an output (tracebacks of expected errors) with portable ones."""
    text = SITE_PACKAGES.sub("<site-packages>/", text)
    return text.replace(str(repo.resolve()) + "/", "")


def kernel_language_info() -> dict:
    """The language_info this interpreter's ipykernel reports (what JupyterLab writes into a notebook)."""
    from ipykernel.ipkernel import IPythonKernel

    return json.loads(json.dumps(IPythonKernel.language_info))  # a deep copy


def language_info(stored: dict | None) -> dict:
    """The stored language_info if a kernel wrote it whole (after execute), else this interpreter's kernel's."""
    current = kernel_language_info()
    return dict(stored) if stored and set(current) <= set(stored) else current


def widget_hint() -> str:
    """The line a widget's text/plain ends with (ampcourse.widgets.STORED_HINT)."""
    from ampcourse.widgets import STORED_HINT

    return STORED_HINT


def clean_widget_output(out: nbformat.NotebookNode) -> None:
    """Drop a stored widget view (no state is stored: it cannot render) and keep a text/plain that says why."""
    data = out.get("data", {})
    if WIDGET_VIEW not in data:
        return
    del data[WIDGET_VIEW]
    hint = widget_hint()
    text = data.get("text/plain", "")
    if hint not in text:
        data["text/plain"] = f"{text}\n{hint}" if text else hint


def clean(nb: nbformat.NotebookNode, repo: Path = Path(__file__).resolve().parents[1]) -> nbformat.NotebookNode:
    """Strip timestamps, widget state, per-machine metadata and paths; renumber executed cells."""
    nb.metadata = nbformat.from_dict({
        "kernelspec": KERNELSPEC,
        "language_info": language_info(nb.metadata.get("language_info")),
    })
    count = 0
    for cell in nb.cells:
        cell.metadata = nbformat.from_dict({k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA})
        cell.pop("id", None)
        if cell.cell_type != "code":
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
            continue
        if cell.execution_count is not None:
            count += 1
            cell.execution_count = count
        for out in cell.outputs:
            if "execution_count" in out:
                out.execution_count = cell.execution_count
            if out.get("output_type") == "error":  # nbval ignores tracebacks; readers should not see our paths
                out.traceback = [scrub_paths(line, repo) for line in out.traceback]
            if out.get("output_type") in ("display_data", "execute_result"):
                clean_widget_output(out)
                out.metadata = nbformat.from_dict({k: v for k, v in out.get("metadata", {}).items() if k == "image/png"})
    nb.nbformat, nb.nbformat_minor = 4, 4  # 4.4: no cell ids, so diffs show content, not random ids
    return nb


def problems(path: Path) -> list[str]:
    """What is not clean about one notebook (empty list: clean)."""
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    found = []
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    if code and all(c.execution_count is None for c in code):
        found.append("never executed: nbval would compare nothing")
    for i, c in enumerate(code):
        extra = set(c.metadata) - set(KEEP_CELL_METADATA)
        if extra:
            found.append(f"code cell {i}: metadata {sorted(extra)}")
        if c.execution_count is None and c.outputs:
            found.append(f"code cell {i}: outputs without an execution count")
    if "widgets" in nb.metadata:
        found.append("widget state stored")
    missing = set(kernel_language_info()) - set(nb.metadata.get("language_info", {}))
    if missing:
        found.append(f"language_info lacks {sorted(missing)}: JupyterLab would mark it modified on open (run clean)")
    for i, c in enumerate(code):
        if any(WIDGET_VIEW in o.get("data", {}) for o in c.outputs):
            found.append(f"code cell {i}: a widget view without state (JupyterLab: 'model not found'; run clean)")
    for m in MACHINE_PATH.finditer(ANSI_JSON.sub("", text)):
        found.append(f"machine path {m.group(0)!r}")
    counts = [c.execution_count for c in code if c.execution_count is not None]
    if counts != list(range(1, len(counts) + 1)):
        found.append("execution counts are not 1..n (run it top to bottom with `make notebooks`)")
    return found


def execute(path: Path, timeout: int = 600) -> float:
    """Run one notebook top to bottom in a fresh kernel (cwd: its folder) and save it clean."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # fresh run: nothing from a previous execution survives
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            store_widget_state=False, resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    nbformat.write(clean(nb), path)
    return elapsed


# --- navigation: every chapter links to the index at its top and its end, and to the next chapter ----------
# Markdown cells only (nbval compares no markdown), so adding them needs no re-execution. Idempotent: the cells
# are found again by their tag and rewritten; run it after adding or renaming a chapter (`nav --check` says when).

NAV_TOP, NAV_END = "nav-top", "nav-end"  # the tags of the two navigation cells
INDEX = "00_index.ipynb"
BINDER = "https://mybinder.org/badge_logo.svg"
BINDER_REPO = "https://mybinder.org/v2/gh/ampcourse/ampcourse/main"
_BINDER_BADGE = re.compile(r"\[!\[Binder\]\([^)]*\)\]\([^)]*\)")
_TITLE = re.compile(r"^#\s+(?:Chapter\s+\d+\s*·\s*)?(.+?)\s*$", re.MULTILINE)


def binder_badge(name: str) -> str:
    """The Binder badge of a notebook: it opens the learner's copy in workspace/, as `make lab` does."""
    return f"[![Binder]({BINDER})]({BINDER_REPO}?labpath=workspace%2F{name})"


def notebook_title(nb: nbformat.NotebookNode) -> str:
    """'Chapter 2 · Why mixed precision...' from the first markdown heading ('' if none)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def nav_cells(name: str, next_chapter: tuple[str, str] | None) -> tuple[str | None, str]:
    """The (top, end) markdown of a notebook's navigation cells; top is None for the index (it is the top).

    next_chapter: (file name, title) of the chapter after this one, None for the last.
    """
    index = f"[course index]({INDEX})"
    nxt = f"[{next_chapter[1] or next_chapter[0]}]({next_chapter[0]})" if next_chapter else None
    if name == INDEX:
        return None, f"**Start:** {nxt}" if nxt else "**Start:** the chapters listed above"
    top = f"← Back to the {index}" + (f" · next: {nxt}" if nxt else "")
    end = (f"**Next:** {nxt} · or back to the {index}" if nxt
           else f"**The end of the course.** Back to the {index} for the chapters, the outline map and the glossary.")
    return top, end


def _tagged(nb: nbformat.NotebookNode, tag: str) -> list[int]:
    """Indices of the cells carrying tag."""
    return [i for i, c in enumerate(nb.cells) if tag in ((c.get("metadata") or {}).get("tags") or [])]


def add_nav(nb: nbformat.NotebookNode, name: str, next_chapter: tuple[str, str] | None) -> nbformat.NotebookNode:
    """Put the navigation cells in place (top: after the title cell; end: last) and the first cell's Binder badge.

    Idempotent: existing navigation cells are removed first and written again, so a rename is picked up.
    """
    for i in reversed(_tagged(nb, NAV_TOP) + _tagged(nb, NAV_END)):
        del nb.cells[i]
    top, end = nav_cells(name, next_chapter)
    first = nb.cells[0] if nb.cells and nb.cells[0].cell_type == "markdown" else None
    if first is not None and name != INDEX:  # one Binder story: every badge opens the learner's copy
        badge = binder_badge(name)
        first.source = (_BINDER_BADGE.sub(badge, first.source) if _BINDER_BADGE.search(first.source)
                        else first.source.rstrip("\n") + "\n\n" + badge)
    if top is not None:
        nb.cells.insert(1 if first is not None else 0, nbformat.v4.new_markdown_cell(top, metadata={"tags": [NAV_TOP]}))
    nb.cells.append(nbformat.v4.new_markdown_cell(end, metadata={"tags": [NAV_END]}))
    for cell in nb.cells:  # nbformat 4.4 (what `clean` stores): no cell ids
        if (nb.nbformat, nb.nbformat_minor) < (4, 5):
            cell.pop("id", None)
    return nb


def nav_problems(nb: nbformat.NotebookNode, name: str, next_chapter: tuple[str, str] | None) -> list[str]:
    """What is missing or stale in a notebook's navigation (empty: as `nav` would write it)."""
    want = add_nav(nbformat.from_dict(nb), name, next_chapter)
    found = []
    top, end = nav_cells(name, next_chapter)
    tops, ends = _tagged(nb, NAV_TOP), _tagged(nb, NAV_END)
    if top is not None and (len(tops) != 1 or nb.cells[tops[0]].source != top or tops[0] > 1):
        found.append(f"no link to {INDEX} at the top (or a stale one): run `tools/nbtool.py nav`")
    if len(ends) != 1 or ends[0] != len(nb.cells) - 1 or nb.cells[ends[0]].source != end:
        found.append(f"no closing link ({INDEX}, next chapter) as its last cell (or a stale one): run `tools/nbtool.py nav`")
    if nb.cells and want.cells and nb.cells[0].source != want.cells[0].source:
        found.append("its Binder badge does not open the learner's copy (workspace/): run `tools/nbtool.py nav`")
    return found


def chapter_order(paths: list[Path]) -> dict[Path, tuple[str, str] | None]:
    """{notebook: (file name, title) of the next numbered notebook in its folder, or None for the last}."""
    out: dict[Path, tuple[str, str] | None] = {}
    for path in paths:
        siblings = sorted(path.parent.glob("[0-9][0-9]_*.ipynb"))
        later = siblings[siblings.index(path) + 1:] if path in siblings else []
        out[path] = (later[0].name, notebook_title(nbformat.read(later[0], as_version=4))) if later else None
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: execute, clean, check or add navigation to notebooks."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["execute", "clean", "check", "nav"])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="nav: only report missing or stale navigation (exit 1)")
    args = ap.parse_args(argv)
    status = 0
    if args.command == "nav":
        for path, nxt in chapter_order(args.notebooks).items():
            nb = nbformat.read(path, as_version=4)
            if args.check:
                for p in nav_problems(nb, path.name, nxt):
                    print(f"{path}: {p}")
                    status = 1
            elif nav_problems(nb, path.name, nxt):
                nbformat.write(add_nav(nb, path.name, nxt), path)
                print(f"{path}: navigation written")
        return status
    for path in args.notebooks:
        if args.command == "execute":
            print(f"{path}: executed in {execute(path):.1f} s", flush=True)
        elif args.command == "clean":
            nbformat.write(clean(nbformat.read(path, as_version=4)), path)
        found = problems(path)
        for p in found:
            print(f"{path}: {p}")
        status |= bool(found)
    return status


if __name__ == "__main__":
    sys.exit(main())
