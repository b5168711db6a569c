"""The chapter-9 outlier widget, driven headlessly: move the outlier and the block size, read the errors."""

import pytest
import torch

from ampcourse import fp8
from ampcourse.widgets import outlier_explorer


def test_outlier_explorer_results_are_the_fp8_module_s():
    w = outlier_explorer(magnitude=8, block_size=32)
    x = w.tensor()
    assert x[0, 5] == 256.0 and set(w.results) == {"tensor", "row", "block fp32", "block e8m0", "nvfp4"}
    mx = fp8.quantize_scaled(x, "fp4_e2m1", "mx", block_size=32)
    assert w.results["block e8m0"]["rel_error"] == fp8.relative_error(x, mx.values)
    assert w.results["block e8m0"]["underflowed"] == mx.underflowed
    assert f"{w.results['tensor']['rel_error']:.4f}" in w.table.value


def test_a_bigger_outlier_hurts_per_tensor_more_than_blocks():
    w = outlier_explorer(magnitude=2)
    calm = dict(w.results)
    w.magnitude.value = 12
    assert w.results["tensor"]["underflowed"] > calm["tensor"]["underflowed"]
    assert w.results["tensor"]["rel_error"] > w.results["row"]["rel_error"] > w.results["block e8m0"]["rel_error"]
    # the damage is local to the outlier's group: smaller blocks contain it better
    w.block.value = 128
    big = w.results["block e8m0"]["underflowed"]
    w.block.value = 8
    assert w.results["block e8m0"]["underflowed"] < big


def test_element_and_position_controls():
    w = outlier_explorer()
    w.element.value = "fp8_e4m3"
    assert "nvfp4" not in w.results and w.results["tensor"]["rel_error"] < 0.1
    w.position.value = 200
    assert w.tensor()[0, 200] == 2.0**w.magnitude.value and w.tensor()[0, 5] != 2.0**w.magnitude.value
    assert "OutlierExplorer(element='fp8_e4m3'" in repr(w)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=24), "block_size must be one of"),
    (dict(element="bf16"), "element must be one of"),
    (dict(position=999), "position must be in"),
    (dict(x=torch.ones(2, 12)), "divisible by 8"),
])
def test_outlier_explorer_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        outlier_explorer(**kwargs)


def test_chapter_9_checks_leave_the_learner_s_widget_alone():
    """No cell after the one that shows the outlier widget assigns to it: a check cell that moved the learner's
    slider (``w.magnitude.value = 12``) changed what the learner had set; the chapter's check uses its own probe."""
    import ast
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[2] / "chapters" / "09_below_16_bits.ipynb").read_text())
    codes = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    shown = next(i for i, s in enumerate(codes) if "outlier_explorer(" in s and "= outlier_explorer(" in s)
    name = next(t.id for node in ast.walk(ast.parse(codes[shown])) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name))

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    for source in codes[shown + 1:]:
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            assert all(root(t) != name or isinstance(t, ast.Name) for t in targets), source
