"""Static figures are sharp on HiDPI screens (issue 28, item 17): one course-wide setting, ``plots.hidpi_figures``.

In a kernel, a figure shows at its own size (the output's width/height metadata) and is drawn at twice the
pixels; before, the inline backend's 1x PNG was blurry on a HiDPI screen. Chapters need no line of their own:
``import ampcourse`` after pyplot (what every chapter's first cell does) turns it on, and so does importing
``ampcourse.plots``.
"""

import base64
import struct

import nbformat
import pytest
from nbclient import NotebookClient

from ampcourse import plots


def png_size(data: str) -> tuple[int, int]:
    """(width, height) of a base64 PNG, from its IHDR chunk."""
    raw = base64.b64decode(data)
    return struct.unpack(">II", raw[16:24])


@pytest.mark.parametrize("imports", ["import matplotlib.pyplot as plt\nimport ampcourse",
                                     "import matplotlib.pyplot as plt\nfrom ampcourse import plots"])
def test_a_chapters_figure_is_drawn_at_twice_the_pixels_it_is_shown_at(imports, tmp_path):
    code = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook()
    nb.cells = [code(imports), code("fig = plt.figure(figsize=(2, 1), dpi=80)\nfig.add_subplot().plot([0, 1])\nplt.show()")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    (out,) = [o for o in nb.cells[1].outputs if "image/png" in o.get("data", {})]
    width, height = png_size(out.data["image/png"])
    shown = out.metadata["image/png"]
    assert abs(width - 2 * shown["width"]) <= 1 and abs(height - 2 * shown["height"]) <= 1  # halves rounded down
    assert shown["width"] <= 2 * 80  # shown at (about) the figure's size, bbox_inches="tight" trims a little


def test_outside_a_kernel_nothing_changes():
    assert plots.hidpi_figures() is False and plots.FIGURE_FORMAT == "retina"
