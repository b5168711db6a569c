"""The autocast op table is measured live and classifies ops the way CPU autocast really treats them."""

import os

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
    ("mps", torch.bfloat16, "not available here"),
])
def test_bad_arguments(device_type, dtype, match):
    with pytest.raises(ValueError, match=match):
        op_table(device_type, dtype)


def test_cuda_table_without_a_gpu_is_cudas_policy():
    """op_table('cuda') runs CUDA's own autocast kernels (fake CUDA tensors without a GPU): fp32 where CPU keeps low."""
    rows = {r.op: r for r in op_table("cuda", torch.bfloat16)}
    assert [r for r in rows] == [s.name for s in autocast_ops.OPS]
    cats = {op: r.category for op, r in rows.items()}
    assert cats["linear"] == cats["matmul (@)"] == cats["conv2d"] == cats["scaled_dot_product_attention"] == "lower"
    for op in ("softmax", "layer_norm", "exp", "log", "sum", "cumsum", "cross_entropy", "mse_loss"):
        assert cats[op] == "fp32", op
    assert cats["add (a + b)"] == cats["cat"] == cats["addcmul"] == "promote"
    assert cats["relu"] == cats["gelu"] == "unchanged"
    assert rows["softmax"].kind == rows["sum"].kind == "fp32_set_opt_dtype"
    assert rows["exp"].kind == rows["layer_norm"].kind == "fp32"
    assert rows["softmax"].entered == "aten::softmax" and rows["cross_entropy"].entered == "aten::cross_entropy_loss"
    assert {r.category for r in rows.values()} <= set(autocast_ops.CATEGORIES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_and_cuda_differ_where_the_lists_differ(dtype):
    diff = {op: (a, b) for op, a, b in autocast_ops.differences("cpu", "cuda", dtype)}
    assert diff["softmax"] == ("unchanged", "fp32") and diff["layer_norm"] == ("unchanged", "fp32")
    assert "linear" not in diff and "cross_entropy" not in diff  # both lists agree on these


def test_callers_ops_direct_aten_calls_and_banned_ops():
    specs = [OpSpec("aten.mm.default", ((4, 8), (8, 3)), torch.ops.aten.mm.default),
             OpSpec("aten.softmax.int", ((4, 8),), lambda x: torch.ops.aten.softmax.int(x, -1)),
             OpSpec("softmax, explicit dtype", ((4, 8),), lambda x: torch.softmax(x, -1, dtype=x.dtype)),
             OpSpec("binary_cross_entropy", ((4,), (4,)), torch.nn.functional.binary_cross_entropy)]
    rows = {r.op: r for r in op_table("cuda", torch.float16, ops=specs)}
    assert rows["aten.mm.default"].category == "lower"
    assert rows["aten.softmax.int"].category == "fp32"
    assert rows["softmax, explicit dtype"].category == "unchanged"  # set_opt_dtype keeps a dtype the caller gave
    bce = rows["binary_cross_entropy"]
    assert bce.category == "unsupported" and "unsafe to autocast" in bce.reason


def _abort(x):
    os.abort()  # what a C++ assertion does to the probe's process: uncatchable in Python


def test_a_probe_that_aborts_is_a_row_not_a_crash():
    """A probe that aborts the child from C++ is a row that says so; the other ops are probed again, one child each.
    On the CPU-only wheel a fake CUDA tensor that requires grad aborts ("not linked with support for cuda"); a CUDA
    build of torch runs it, so os.abort() stands in for the abort on every build."""
    specs = [OpSpec("aborts", ((4, 8),), _abort), OpSpec("requires grad", ((4, 8),), lambda x: x.requires_grad_().exp()),
             OpSpec("exp", ((4, 8),), torch.exp)]
    rows = {r.op: r for r in op_table("cuda", torch.bfloat16, ops=specs)}
    assert rows["aborts"].category == "unsupported" and "died" in rows["aborts"].reason
    if torch.version.cuda is None:  # the CPU-only wheel
        assert rows["requires grad"].category == "unsupported" and "died" in rows["requires grad"].reason
    else:
        assert rows["requires grad"].category == "fp32"
    assert rows["exp"].category == "fp32"  # the other op is probed again in a process of its own


def test_probe_leaves_this_process_autocast_state_alone():
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    op_table("cuda", torch.bfloat16, ops=[OpSpec("exp", ((2,),), torch.exp)])
    with autocast_ops._cuda_autocast_state(torch.bfloat16):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before


def test_registered_ops_are_the_dispatchers():
    cuda = autocast_ops.registered_ops("cuda")
    assert "aten::mm" in cuda and "aten::softmax.int" in cuda and "aten::relu" not in cuda
    for name in ("aten::mm", "aten::layer_norm"):
        table = torch._C._dispatch_dump_table(name)
        assert "AutocastCUDA: registered" in table and "[kernel]" in table
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        autocast_ops.registered_ops("tpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_policy_covers_every_registered_overload(dtype):
    pol = autocast_ops.policy("cuda", dtype)
    assert sorted(pol) == autocast_ops.registered_ops("cuda")
    assert {p.category for p in pol.values()} <= set(autocast_ops.CATEGORIES)
    assert pol["aten::mm"].category == pol["aten::linear"].category == "lower"
    assert (pol["aten::softmax.int"].category, pol["aten::softmax.int"].kind) == ("fp32", "fp32_set_opt_dtype")
    assert pol["aten::norm.Scalar"].kind == "fp32_append_dtype" and pol["aten::exp"].kind == "fp32"
    assert pol["aten::addcmul"].category == "promote"
    assert pol["aten::binary_cross_entropy"].reason.startswith("CUDA autocast raises: ")
    unsupported = [p for p in pol.values() if p.category == "unsupported"]
    assert all(p.reason for p in unsupported)
    named = [p for p in unsupported if "named-tensor (Dimname)" in p.reason]  # some builds (2.11's CUDA) register them
    assert len(unsupported) - len(named) <= 3  # bce, and what the probe says it can't tell
    # only binary_cross_entropy is banned: _cudnn_rnn read as banned by an INTERNAL ASSERT on the probe's arguments
    assert [p.op for p in unsupported if p.reason.startswith("CUDA autocast raises")] == ["aten::binary_cross_entropy"]
    # the Scalar-ord matrix norm was probed with ord=2, which rejects low precision before dispatch: "not probeable"
    matrix_norm = pol["aten::linalg_matrix_norm"]
    assert (matrix_norm.category, matrix_norm.kind) == ("fp32", "fp32_set_opt_dtype")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_cudnn_rnn_wrapper_is_probed_as_a_cast_to_fp16_in_every_region(dtype):
    """AutocastRNN.cpp hard-codes at::kHalf; +cpu builds (no cuDNN) register no wrapper, CUDA wheels (2.11, 2.15) do."""
    pol = autocast_ops.policy("cuda", dtype)
    if "aten::_cudnn_rnn" not in pol:
        pytest.skip("this torch build has no cuDNN RNN autocast kernel")
    rnn = pol["aten::_cudnn_rnn"]
    assert (rnn.category, rnn.kind) == ("lower", None if dtype == torch.float16 else "fp16"), rnn


def test_policy_is_cached_on_disk_per_torch_build(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPCOURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    first = autocast_ops.policy("cuda", torch.bfloat16)
    (path,) = tmp_path.glob("autocast-policy-cuda-bfloat16-*.json")

    def no_probe(*a):
        raise AssertionError("probed again although the cache holds the policy")

    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    monkeypatch.setattr(autocast_ops, "_in_child", no_probe)
    assert autocast_ops.policy("cuda", torch.bfloat16) == first
    path.write_text("not json")  # a damaged cache is probed again, never trusted
    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    with pytest.raises(AssertionError, match="probed again"):
        autocast_ops.policy("cuda", torch.bfloat16)


def test_a_probe_started_inside_cuda_autocast_probes_from_a_clean_state(tmp_path, monkeypatch):
    """The probe forks: its child inherits the caller's autocast state. Started inside CUDA's autocast (the
    emulator's region, a caller's own context), the probe's "autocast off" call was an autocast call, so a banned
    op (binary_cross_entropy) read as "not probeable" and the cache kept that for every later process."""
    monkeypatch.setenv("AMPCOURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    clean = autocast_ops._probe_policy("cuda", torch.bfloat16)
    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    prev = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        inside = autocast_ops.policy("cuda", torch.bfloat16)
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
    assert inside["aten::binary_cross_entropy"].reason.startswith("CUDA autocast raises: ")
    assert inside == clean


def test_a_probe_started_inside_a_dispatch_mode_and_an_emulation_probes_torch_not_its_caller(tmp_path, monkeypatch):
    """Fork copies the caller's thread state: a probe started inside the doctor's op watch (a dispatch mode reading
    every output with .item()) read all 126 overloads as "not probeable" (the 2.11 leg, 2026-12-02), and inside an
    emulation of another dtype it ran under the emulator's keys. The child starts from a clean thread."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ampcourse import emulate

    class Reads(TorchDispatchMode):  # what the doctor's watch does to every output
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel():
                out.flatten()[0].item()
            return out

    monkeypatch.setenv("AMPCOURSE_CACHE", str(tmp_path))
    monkeypatch.setattr(autocast_ops, "_POLICIES", {})
    clean = autocast_ops._probe_policy("cuda", torch.bfloat16)
    autocast_ops.policy("cuda", torch.float16)  # the emulation below needs its own dtype's policy first
    monkeypatch.setattr(autocast_ops, "_POLICIES", {k: v for k, v in autocast_ops._POLICIES.items()
                                                    if k[2] == torch.float16})
    with emulate.autocast("cuda", dtype=torch.float16), Reads():
        inside = autocast_ops.policy("cuda", torch.bfloat16)
    assert inside["aten::mm"].category == "lower"
    assert inside == clean


def test_the_op_a_call_enters_on_a_real_device():
    """What a GPU's table uses to name the fp32 kind: the aten op the call enters (here on CPU tensors)."""
    specs = {s.name: s for s in autocast_ops.OPS}
    enters = {op: autocast_ops._entered_real(specs[op], torch.bfloat16, torch.device("cpu"))
              for op in ("softmax", "cross_entropy", "linear")}
    assert enters == {"softmax": "aten::softmax", "cross_entropy": "aten::cross_entropy_loss", "linear": "aten::linear"}
    pol = autocast_ops.policy("cuda", torch.bfloat16)
    assert autocast_ops._kind_of("aten::softmax", pol) == "fp32_set_opt_dtype"


def test_a_probe_that_hangs_is_stopped():
    import time

    result, why = autocast_ops._in_child(time.sleep, 30, timeout=1.0)
    assert result is None and "longer than 1 s" in why
    assert autocast_ops._in_child(sum, [1, 2]) == (3, None)
