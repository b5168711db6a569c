"""benchmarks/doctor_cost.py's tensor-memory measure: the CPU analogue of CUDA's max_memory_allocated."""
import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "doctor_cost.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports its neighbours
    try:
        spec = importlib.util.spec_from_file_location("doctor_cost_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_tensor_peak_counts_what_is_live_at_once_not_what_was_ever_allocated():
    cost = _load()
    mib = 1 << 20

    def two_at_once():
        a = torch.empty(4 * mib, dtype=torch.uint8)
        b = torch.empty(2 * mib, dtype=torch.uint8)
        del a, b

    def one_after_another():
        for _ in range(3):
            a = torch.empty(4 * mib, dtype=torch.uint8)
            del a

    assert 6 * mib <= cost.tensor_peak(two_at_once) < 7 * mib
    assert 4 * mib <= cost.tensor_peak(one_after_another) < 5 * mib
    assert cost.tensor_peak(lambda: None) == 0


def test_timings_report_the_forensic_pass_and_the_confirmation_against_the_plain_steps_it_runs():
    cost = _load()
    t = cost.timings("mlp", torch.device("cpu"), repeats=1, steps=2)
    assert t["steps"] == 2 and t["trained"][0] == "fp32" and len(t["trained"]) >= 2
    s = t["seconds"]
    assert s["examine confirmed"] > 0 and s["plain steps"] > 0 and t["confirmation_over_plain_steps"] > 0
    assert t["ratio"] == s["examine"] / s["fp32 fwd+bwd"]
