"""tools/nbtool.py clean: notebooks stored in the form JupyterLab keeps (no "modified" on open), and widget
outputs that say how to see the widget instead of "Error displaying widget: model not found".

What JupyterLab changes on open was found in Chromium (JupyterLab 4.6): it copies the kernel's
`language_info` into the notebook when the kernel connects, so a trimmed dict, or another Python
version, marks the notebook modified; cell ids and nbformat 4.4 vs 4.5 made no difference.
"""

from pathlib import Path

import nbformat
import pytest

import nbtool  # tools/ (tests/conftest.py puts it on sys.path)

ROOT = Path(__file__).resolve().parents[2]

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def executed(tmp_path: Path) -> Path:
    """A two-cell notebook run by a real kernel (nbclient stores the kernel's language_info), then cleaned."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("from ampcourse.widgets import format_explorer\nformat_explorer(2.0)")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nbtool.WIDGET_VIEW in nb.cells[1].outputs[0].data  # what the kernel sends
    path = tmp_path / "nb.ipynb"
    nbformat.write(nbtool.clean(nb), path)
    return path


def test_clean_keeps_the_language_info_the_kernel_reported_and_drops_widget_views(tmp_path):
    path = executed(tmp_path)
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.language_info == nbtool.kernel_language_info()  # exactly what JupyterLab would write
    out = nb.cells[1].outputs[0]
    assert nbtool.WIDGET_VIEW not in out.data
    assert out.data["text/plain"].startswith("FormatExplorer(x=2.0") and nbtool.widget_hint() in out.data["text/plain"]
    assert nbtool.problems(path) == []
    before = path.read_text()  # idempotent: cleaning a clean notebook changes nothing
    nbformat.write(nbtool.clean(nbformat.read(path, as_version=4)), path)
    assert path.read_text() == before


def test_check_flags_a_trimmed_language_info_and_a_stored_widget_view(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": nbtool.KERNELSPEC, "language_info": {"name": "python", "pygments_lexer": "ipython3"}}
    cell = nbformat.v4.new_code_cell("w", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("execute_result", execution_count=1, data={
        "text/plain": "W()", nbtool.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0}})]
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    found = nbtool.problems(path)
    assert any("language_info" in p for p in found) and any("widget view" in p for p in found)
    nbformat.write(nbtool.clean(nbformat.read(path, as_version=4)), path)
    assert nbtool.problems(path) == []


def test_the_hint_is_the_one_the_widgets_print():
    from ampcourse.widgets import STORED_HINT
    assert nbtool.widget_hint() == STORED_HINT and "run this cell and the cells above" in STORED_HINT


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapters_store_the_language_info_a_kernel_reports(path):
    info = nbformat.read(path, as_version=4).metadata.get("language_info", {})
    assert set(nbtool.kernel_language_info()) <= set(info), f"{path.name}: run tools/nbtool.py clean"
