"""ampcourse.bench: behaviour and output schema (not timings: performance lives in benchmarks/)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ampcourse import bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run([sys.executable, "-m", "ampcourse.bench", "--quick", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return out, run.stdout


def test_quick_run_writes_json_and_png(quick_run):
    out, stdout = quick_run
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in stdout and "targets:" in stdout


def test_json_schema(quick_run):
    report = json.loads((quick_run[0] / "bench.json").read_text())
    assert report["schema"] == bench.SCHEMA
    assert set(report) >= {"env", "config", "matmul", "train_step", "trainer_overhead", "saved_bytes", "targets"}
    assert report["env"]["device"] == "cpu" and report["config"]["quick"] is True
    assert {r["dtype"] for r in report["matmul"]} == {"fp32", "bf16", "fp16"}
    for r in report["matmul"]:
        assert set(r) == {"dtype", "n", "seconds", "tflops", "bounded"}
        assert r["seconds"] > 0 and r["tflops"] == pytest.approx(2 * r["n"] ** 3 / r["seconds"] / 1e12)
    for r in report["train_step"]:
        assert r["fp32_ms"] > 0 and r["amp_ms"] > 0 and r["precision"] == "bf16"
        assert len(r["repeats_ms"]["fp32"]) == len(r["repeats_ms"]["bf16"]) == report["config"]["repeats"]
    for r in report["saved_bytes"]:
        assert r["activation_ratio"] == pytest.approx(r["amp_activation_bytes"] / r["fp32_activation_bytes"])
        assert sum(r["amp_by_dtype"].values()) == r["amp_activation_bytes"]
    for r in report["trainer_overhead"]:
        trainer, bare = r["repeats_ms"]["trainer"], r["repeats_ms"]["bare"]
        assert len(trainer) == len(bare) == report["config"]["overhead_repeats"]
        ratios = sorted(t / b for t, b in zip(trainer, bare))
        assert ratios[0] - 1 <= r["overhead"] <= ratios[-1] - 1  # the median of the per-repeat ratios
    names = [t["name"] for t in report["targets"]]
    assert any("trainer per-step overhead" in n for n in names) and any("saved activation bytes" in n for n in names)
    for t in report["targets"]:
        assert t["met"] == (t["value"] <= t["limit"])


def test_saved_bytes_are_deterministic_and_lower_under_autocast():
    a = bench.saved_bytes(["mlp"], batch=4)
    b = bench.saved_bytes(["mlp"], batch=4)
    assert a == b
    # mlp, batch 4, by hand: the inputs of three Linears (32, 64, 64 features) and two GELUs (64 each),
    # fp32; the loss's fp32 log-probs (4 x 10 classes), its 4 int64 targets and a scalar total weight
    by_hand = 4 * 4 * (32 + 64 + 64 + 64 + 64) + 4 * 4 * 10 + 4 * 8 + 4
    assert a[0]["fp32_activation_bytes"] == by_hand


def test_the_default_precision_is_the_devices_amp_dtype_even_where_pick_keeps_fp32(monkeypatch):
    """On a CPU without bf16 units (an Intel Xeon with AVX512 but no AVX512-BF16, an AVX2 laptop) pick() keeps fp32;
    the benchmark's default is still the device's AMP dtype ("--precision: default the device's AMP dtype"). Before,
    `python -m ampcourse.bench` failed there with "pass precision='fp16' or 'bf16'"."""
    from ampcourse import device
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert device.pick("cpu").precision == "fp32"
    assert {r["precision"] for r in bench.saved_bytes(["mlp"], batch=4)} == {"bf16"}
    rows = bench.train_step_times(["mlp"], "cpu", size="tiny", batch=4, steps=1, repeats=1, warmup=0)
    assert {r["precision"] for r in rows} == {"bf16"}
    with pytest.raises(ValueError, match="pass precision='fp16' or 'bf16'"):  # an explicit fp32 has no AMP side
        bench.saved_bytes(["mlp"], batch=4, precision="fp32")


def test_matmul_budget_stops_growing_sizes():
    rows = bench.matmul_tflops("cpu", dtypes=["fp32"], sizes=[16, 32, 64], min_run_time=0.001, budget_s=0.0)
    assert [r["n"] for r in rows] == [16] and rows[0]["bounded"]


def test_speedup_sentence_reads_the_numbers():
    rows = [{"dtype": "fp32", "n": 8, "seconds": 3.0}, {"dtype": "bf16", "n": 8, "seconds": 1.0},
            {"dtype": "fp16", "n": 8, "seconds": 6.0}]
    assert bench.speedup_sentence(rows, "bf16") == "bf16 is 3.0x faster than fp32 here (n=8)"
    assert bench.speedup_sentence(rows, "fp16") == "fp16 is 2.0x slower than fp32 here (n=8)"
    assert "not measured" in bench.speedup_sentence(rows, "tf32")
    rows.append({"dtype": "tf32", "n": 8, "seconds": 2.9})
    assert bench.speedup_sentence(rows, "tf32") == "tf32 is about as fast as fp32 here (1.03x, n=8)"


@pytest.mark.parametrize("kwargs, match", [
    ({"dtypes": ["fp8"]}, "unknown matmul dtype"),
    ({"dtypes": ["tf32"]}, "tf32 exists only on CUDA"),
])
def test_matmul_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.matmul_tflops("cpu", **kwargs)


def test_fp32_only_is_rejected_with_a_clear_message():
    run = subprocess.run([sys.executable, "-m", "ampcourse.bench", "--precision", "fp32", "--out", "unused"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "fp32 is always measured, as the baseline" in run.stderr and "Traceback" not in run.stderr


def test_bad_threads_is_rejected_with_a_clear_message():
    run = subprocess.run([sys.executable, "-m", "ampcourse.bench", "--threads", "0", "--out", "unused"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--threads must be >= 1, got 0" in run.stderr


def test_bare_amp_loop_trains_the_model():
    import torch

    from ampcourse import models
    from ampcourse.device import pick

    model = models.make_model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    times = bench.bare_amp_loop(model, models.make_dataset("mlp", n=64), pick("cpu", "bf16"), steps=3, batch=16)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_trainer_overhead_rejects_warmup_longer_than_the_run():
    with pytest.raises(ValueError, match="warmup"):
        bench.trainer_overhead(["mlp"], "cpu", steps=3, warmup=3)


def test_a_slow_first_call_is_a_warm_up_not_a_measurement(monkeypatch):
    """A cold first call (library start-up) longer than the budget must not mark a dtype bounded and drop it."""
    import time

    import torch

    real = torch.Tensor.__matmul__
    calls = {"n": 0}

    def cold_first(a, b):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(0.3)  # over the 0.25 s budget, like a first cuBLAS call
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", cold_first)
    rows = bench.matmul_tflops("cpu", dtypes=["fp32"], sizes=[32, 64], min_run_time=0.01, repeats=1, budget_s=0.25)
    assert [(r["n"], r["bounded"]) for r in rows] == [(32, False), (64, False)]
    assert all(r["seconds"] < 0.25 for r in rows)


@pytest.fixture
def tf32_state():
    """The process's TF32 flags, put back after the test (through the legacy setters: a consistent state)."""
    import torch

    start = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = start


def _tf32_reads() -> dict:
    """Every way code reads the TF32 state (legacy flags, the matmul precision, the new fields), or 'raises'."""
    import torch

    reads = {"matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
             "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
             "float32_matmul_precision": torch.get_float32_matmul_precision}
    for path in ("cuda.matmul", "cudnn.conv", "cudnn.rnn"):
        obj = torch.backends
        for part in path.split("."):
            obj = getattr(obj, part)
        reads[path] = lambda obj=obj: obj.fp32_precision
    out = {}
    for name, read in reads.items():
        try:
            out[name] = read()
        except RuntimeError:
            out[name] = "raises"
    return out


@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_math_sets_every_field_and_keeps_both_apis_readable(tf32_state, tf32):
    """Issue 19 item 11, reproduced on a CPU: the block used to set matmul and conv through fp32_precision, leaving
    cuDNN's RNN at tf32, so reading cudnn.allow_tf32 inside raised (a mix of the APIs)."""
    import torch

    if not hasattr(torch.backends.cudnn, "rnn"):
        pytest.skip(f"torch {torch.__version__} has no per-field fp32_precision API (2.9+)")
    before, reads_before = bench.tf32_settings(), _tf32_reads()
    mode = "tf32" if tf32 else "ieee"
    with bench.fp32_math(tf32=tf32, device="cuda"):
        inside = _tf32_reads()
        assert "raises" not in inside.values(), inside
        assert inside["matmul.allow_tf32"] is tf32 and inside["cudnn.allow_tf32"] is tf32
        assert bench.tf32_settings() == {"api": "allow_tf32", "matmul": mode, "cudnn_conv": mode, "cudnn_rnn": mode}
    after = _tf32_reads()
    assert bench.tf32_settings() == before and "raises" not in after.values()
    legacy = ("matmul.allow_tf32", "cudnn.allow_tf32", "float32_matmul_precision")
    assert {k: after[k] for k in legacy} == {k: reads_before[k] for k in legacy}
    # (a field that read "none", inherit, may read back as the value it inherited: "ieee" for cuBLAS)
    with bench.fp32_math(tf32=True, device="cpu"):  # off CUDA it changes nothing
        assert _tf32_reads() == after


def test_fp32_math_after_the_new_api_restores_each_field_through_it(tf32_state):
    """A caller who set the fields apart with the new API (conv ieee, RNN tf32; the legacy flags cannot say that):
    every field is set inside, and each comes back to its own value."""
    import torch

    if not hasattr(torch.backends.cudnn, "rnn"):
        pytest.skip(f"torch {torch.__version__} has no per-field fp32_precision API (2.9+)")
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.rnn.fp32_precision = "tf32"
    fields = lambda: {k: v for k, v in _tf32_reads().items() if "." in k and "allow" not in k}  # noqa: E731
    before = fields()
    with bench.fp32_math(tf32=False, device="cuda"):
        assert set(fields().values()) == {"ieee"}
        assert bench.tf32_settings()["cudnn_rnn"] == "ieee"
    assert fields() == before == {"cuda.matmul": "tf32", "cudnn.conv": "ieee", "cudnn.rnn": "tf32"}


def test_bench_json_records_the_tf32_settings(quick_run):
    report = json.loads((quick_run[0] / "bench.json").read_text())
    assert set(report["env"]["tf32"]) == {"api", "matmul", "cudnn_conv", "cudnn_rnn"}
    assert all(r["fp32_math"] == "default" for r in report["train_step"])  # a CPU has no TF32


@pytest.mark.parametrize("capability,dtypes", [((7, 5), ("fp32", "fp16")), ((8, 0), ("fp32", "tf32", "bf16", "fp16"))])
def test_matmul_dtypes_follow_the_chosen_gpus_capability(monkeypatch, capability, dtypes):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # must not decide
    assert bench.matmul_dtypes(torch.device("cuda", 0)) == dtypes


def test_fraction_of_peak_excludes_the_reference_from_the_peak():
    rows = [{"dtype": "bf16", "n": n, "tflops": t} for n, t in ((4096, 800.0), (8192, 700.0), (16384, 760.0))]
    result = bench.fraction_of_peak(rows, "bf16", 4096, "NVIDIA H200")
    assert result["peak_n"] == 16384 and result["peak_sizes"] == [8192, 16384]
    assert result["fraction_of_peak"] == pytest.approx(800 / 760)  # above 1: the reference beat the larger sizes
    assert result["datasheet_tflops"] == 989.0
    assert bench.fraction_of_peak(rows, "bf16", 4096, "NVIDIA H200 NVL")["datasheet_tflops"] is None  # exact names only
    with pytest.raises(ValueError, match="larger than n=16384"):
        bench.fraction_of_peak(rows, "bf16", 16384)


def test_the_recorded_gpu_report_is_loaded_not_typed(tmp_path):
    assert bench.load_gpu_report(tmp_path / "missing.json") is None
    report = {"status": "passed", "started": "2026-12-01T10:00:00+00:00",
              "machine": {"device": "NVIDIA H200", "capability": "sm_90", "torch": "2.13.0", "cuda": "12.8"},
              "goals": [{"name": "transformer step speedup", "shown": "4.10x", "goal": ">= 3x", "met": True},
                        {"name": "trainer overhead", "shown": "", "goal": "<= 3%", "met": None}]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    lines = bench.gpu_report_lines(bench.load_gpu_report(path))
    assert lines[0] == "recorded GPU run: NVIDIA H200 (sm_90), torch 2.13.0 (CUDA 12.8), 2026-12-01, status passed"
    assert lines[1:] == ["  transformer step speedup: 4.10x (goal >= 3x, met)", "  trainer overhead: not measured (goal <= 3%, -)"]


def test_no_compared_chapter_output_depends_on_the_gpu_report():
    """Issue 19 item 8: chapter 2 stored "No GPU report has been recorded yet", so committing a report failed strict
    nbval until the chapter was re-run. A cell that prints from the report must not have its output compared;
    the cell that loads it must run (and check it) whether or not a report exists."""
    chapters = sorted((ROOT / "chapters").glob("*.ipynb"))
    seen = 0
    for path in chapters:
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or not ("load_gpu_report" in source or "report_lines" in source):
                continue
            seen += 1
            ignored = "nbval-ignore-output" in cell.get("metadata", {}).get("tags", [])
            assert ignored or not cell.get("outputs"), f"{path.name}: a compared cell prints from the GPU report"
    assert seen >= 2


@pytest.mark.parametrize("report", [None, {"machine": {"device": "NVIDIA H200", "capability": "sm_90", "torch": "2.11.0",
                                                       "cuda": "12.8"}, "started": "2026-12-02T10:00:00+00:00",
                                           "status": "passed", "goals": [{"name": "g", "shown": "3.10x", "goal": ">= 3x",
                                                                          "met": True}]}])
def test_chapter_2_loads_the_gpu_report_whether_or_not_it_exists(monkeypatch, capsys, report):
    cells = json.loads((ROOT / "chapters/02_why_mixed_precision.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    start = next(i for i, s in enumerate(code) if "load_gpu_report" in s)
    monkeypatch.setattr(bench, "load_gpu_report", lambda path=None: report)
    namespace = {"bench": bench}
    for source in code[start:start + 2]:
        exec(source, namespace)  # noqa: S102 - the chapter's own cells
    out = capsys.readouterr().out
    assert ("No GPU report has been recorded yet" in out) == (report is None)
    assert report is None or "recorded GPU run: NVIDIA H200 (sm_90), torch 2.11.0" in out


def test_tf32_keeps_fp32_range_with_fp16_precision():
    """The format chapter 2 emulates TF32's error with (formats.spec('tf32')): fp32's exponent, fp16's mantissa."""
    import numpy as np

    from ampcourse import formats

    tf32 = formats.spec("tf32")
    assert (tf32.exponent_bits, tf32.mantissa_bits, tf32.bits) == (8, 10, 19) and tf32.torch_dtype is None
    assert formats.spec("tensorfloat32") is tf32 and "tf32" not in formats.names(narrow=True)  # compute-only
    q = formats.quantize(np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 3e38, 1e-38]), "tf32")
    assert q[:2].tolist() == [1.0, 1 + 2.0**-9]  # ties to even at fp16's spacing 2**-10
    assert np.isfinite(q[2]) and q[3] > 0 and formats.quantize(np.array([1e5]), "fp16")[0] == np.inf  # fp32's range
