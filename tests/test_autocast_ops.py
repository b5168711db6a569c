"""The autocast op table is measured live and classifies ops the way CPU autocast really treats them."""

import pytest
import torch

from ampcourse import autocast_ops
from ampcourse.autocast_ops import OpSpec, op_table


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def cpu_table(request):
    return request.param, {r.op: r for r in op_table("cpu", request.param)}


@pytest.mark.parametrize("op, category", [
    ("linear", "lower"), ("matmul (@)", "lower"), ("conv2d", "lower"),
    ("cross_entropy", "fp32"), ("mse_loss", "fp32"),
    ("add (a + b)", "promote"), ("cat", "promote"),
    ("relu", "unchanged"),
    # CPU differs from CUDA here: these follow their input on CPU (CUDA autocast runs them in fp32)
    ("softmax", "unchanged"), ("layer_norm", "unchanged"),
])
def test_cpu_categories(cpu_table, op, category):
    _, rows = cpu_table
    assert rows[op].category == category


def test_decisive_probe_shows_the_category(cpu_table):
    dtype, rows = cpu_table
    low = str(dtype).removeprefix("torch.")
    assert rows["linear"].inputs == ("float32",) * 3 and rows["linear"].output == low
    assert rows["cross_entropy"].inputs == (low,) and rows["cross_entropy"].output == "float32"
    assert rows["add (a + b)"].inputs == (low, "float32") and rows["add (a + b)"].output == "float32"
    assert rows["softmax"].inputs == (low,) and rows["softmax"].output == low


def test_every_row_has_a_known_category(cpu_table):
    _, rows = cpu_table
    assert {r.category for r in rows.values()} <= set(autocast_ops.CATEGORIES)
    assert [r.op for r in rows.values()] == [s.name for s in autocast_ops.OPS]


def test_table_follows_the_live_behaviour_not_a_list():
    """A custom op that casts up by hand is classified 'fp32' although no autocast list names it."""
    spec = OpSpec("my_upcast", ((2, 2),), lambda x: x.float() * 2)
    (row,) = op_table("cpu", torch.bfloat16, ops=[spec])
    assert row.category == "fp32" and row.from_mixed is None


def test_errors_are_reported_not_raised():
    spec = OpSpec("broken", ((2, 2),), lambda x: torch.linalg.inv(x[:1]))  # 1x2 is not square
    (row,) = op_table("cpu", torch.bfloat16, ops=[spec])
    assert row.category == "unsupported" and row.from_fp32.failed


def test_mixed_probe_of_an_op_without_promotion_shows_the_error(cpu_table):
    _, rows = cpu_table
    assert rows["dot"].from_mixed.failed  # CPU autocast does not promote dot; plain dot rejects mixed dtypes


def test_format_table_and_differences(cpu_table):
    dtype, rows = cpu_table
    text = autocast_ops.format_table(list(rows.values()))
    assert text.splitlines()[0].split()[:3] == ["op", "fp32", "in"]
    assert any(line.startswith("linear") and line.rstrip().endswith("lower") for line in text.splitlines())
    other = op_table("cpu", torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    assert autocast_ops.differences(list(rows.values()), other) == []  # CPU treats fp16 and bf16 alike


@pytest.mark.parametrize("device_type, dtype, match", [
    ("cpu", torch.float32, "float16 or torch.bfloat16"),
    ("tpu", torch.bfloat16, "unknown device_type 'tpu'"),
])
def test_bad_arguments(device_type, dtype, match):
    with pytest.raises(ValueError, match=match):
        op_table(device_type, dtype)


def test_cuda_table_or_a_clear_error():
    """On a GPU, CUDA autocast runs softmax and layer_norm in fp32; without one, a clear ValueError."""
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available here"):
            op_table("cuda", torch.float16)
        return
    rows = {r.op: r.category for r in op_table("cuda", torch.float16)}
    assert rows["linear"] == "lower" and rows["softmax"] == rows["layer_norm"] == rows["cross_entropy"] == "fp32"
