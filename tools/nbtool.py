"""Keep the chapter notebooks executed and clean (nbdev-style), so nbval has outputs to compare.

    python tools/nbtool.py execute chapters/*.ipynb   # run top to bottom, store outputs, clean
    python tools/nbtool.py clean chapters/*.ipynb     # strip noisy metadata only
    python tools/nbtool.py check chapters/*.ipynb     # exit 1 if a notebook is not clean

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


def main(argv: list[str] | None = None) -> int:
    """Command line: execute, clean or check notebooks."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["execute", "clean", "check"])
    ap.add_argument("notebooks", nargs="+", type=Path)
    args = ap.parse_args(argv)
    status = 0
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
