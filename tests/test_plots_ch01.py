"""Chapter 1's ulp staircase is readable: text of at least 10 pixels at its own size, and every line named."""

import matplotlib

matplotlib.use("Agg")

from ampcourse import plots  # noqa: E402


def test_ulp_staircase_text_is_readable_and_every_line_is_named():
    fig = plots.ulp_staircase()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *legend.get_texts(),
             *(t.label1 for t in ax.xaxis.get_major_ticks() if t.label1.get_visible() and t.label1.get_text())]
    for t in texts:
        assert t.get_fontsize() * fig.dpi / 72 >= 10, (t.get_text(), t.get_fontsize(), fig.dpi)
    named = {t.get_text() for t in legend.get_texts()}
    assert {ln.get_label() for ln in ax.get_lines()} <= named  # the grey guides too: no unlabelled line
    assert any("min normal" in n for n in named) and any("max" in n for n in named)
