"""benchmarks/README.md's published-vs-predicted table is what benchmarks/plan_published.py computes from
benchmarks/published_steps.json (the data file), and its goal line is what its own rows say."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "benchmarks" / "published_steps.json").read_text())


def _readme_block() -> str:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    return text.split("<!-- plan-published:begin -->\n", 1)[1].split("<!-- plan-published:end -->", 1)[0].strip()


def _readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in _readme_block().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("row",) and not cells[0].startswith("-"):
            rows[cells[0]] = cells
    return rows


def _plan_published():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plan_published
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return plan_published


def test_every_row_names_a_known_source_gpu_model_and_precisions():
    from ampcourse.plan import GPUS
    for row in DATA["rows"]:
        assert row["source"] in DATA["sources"] and row["gpu"] in GPUS
        assert row["model"] in ("nanogpt-eager", "resnet50", "bert-large-mlm", "bert-large-qa")
        assert {row["base"]["precision"], row["amp"]["precision"]} <= {"fp32", "tf32", "bf16", "fp16"}
        assert row["unit"] in ("ms", "samples/s") and row["kind"] in ("amp", "tf32")


def test_published_speedups_in_the_readme_come_from_the_data_file():
    rows = _readme_rows()
    assert set(rows) == {r["id"] for r in DATA["rows"]}
    for r in DATA["rows"]:
        b, a = r["base"]["value"], r["amp"]["value"]
        published = b / a if r["unit"] == "ms" else a / b
        assert rows[r["id"]][6] == f"{published:.2f}"


def test_the_goal_line_is_computed_from_the_rows():
    rows, kinds = _readme_rows(), {r["id"]: r["kind"] for r in DATA["rows"]}
    amp = [(float(c[6]), float(c[7])) for i, c in rows.items() if kinds[i] == "amp"]
    errs = [abs(pred / pub - 1) for pub, pred in amp]
    line = _readme_block().splitlines()[-1]
    assert f"median |error| of the speedup {statistics.median(errs):.0%}" in line
    assert f"within 30%: {sum(e <= 0.30 for e in errs) / len(errs):.0%}" in line
    worst = max(max(p / q, q / p) for q, p in amp)
    assert abs(float(re.search(r"worst ([\d.]+)x", line)[1]) - worst) < 0.01  # the table rounds to 2 decimals


@pytest.mark.slow
def test_the_table_is_recomputed_from_the_data_file():
    """Plans every configuration again (about 80 s on the 2-core machine) and compares the whole table."""
    pp = _plan_published()
    assert pp.markdown([pp.predict(r) for r in DATA["rows"]]) == _readme_block()
