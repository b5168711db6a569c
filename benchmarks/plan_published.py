"""Published AMP speedups beside ampcourse.plan's predictions: every row of benchmarks/published_steps.json.

    python benchmarks/plan_published.py            # prints the markdown table of benchmarks/README.md
    python benchmarks/plan_published.py --json F   # and writes the rows with their predictions

Each configuration is predicted as it was run (model, batch, sequence length, accumulation, precision); the
optimizer step is spread over the accumulated micro-batches. No constant is fitted: the GPU numbers are
ampcourse.plan.GPUS's (datasheets and published microbenchmarks). tests/tools/test_plan_published.py recomputes
this table and compares it with the one in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampcourse.plan import GPUS, capture_step  # noqa: E402
from ampcourse.plan.gpus import HOST_SECONDS_PER_OP  # noqa: E402
from ampcourse.plan.roofline import op_time  # noqa: E402
from ampcourse.plan.zoo import build  # noqa: E402

DATA = ROOT / "benchmarks" / "published_steps.json"


def _bert_qa(batch: int, seq: int):
    """BERT-large for SQuAD (Hugging Face BertForQuestionAnswering on meta; returns its loss)."""
    from transformers import BertConfig, BertForQuestionAnswering
    cfg = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                     attn_implementation="sdpa")
    with torch.device("meta"):
        model = BertForQuestionAnswering(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    pos = torch.zeros(batch, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "start_positions": pos, "end_positions": pos}, None, None


def _setup(model: str, batch: int, seq: int):
    """(model, inputs, loss_fn, targets) for a row's model name."""
    if model == "bert-large-qa":
        return _bert_qa(batch, seq)
    s = build({"bert-large-mlm": "bert-large"}.get(model, model), batch=batch, seq=seq)
    return s.model, s.inputs, s.loss_fn, s.targets


@lru_cache(maxsize=None)
def counts(model: str, batch: int, seq: int, precision: str):
    """The counted step of one configuration (GPU-independent, so cached across rows)."""
    recipe = "fp32" if precision == "tf32" else precision
    m, inputs, loss_fn, targets = _setup(model, batch, seq)
    return capture_step(m, inputs, precision=recipe, loss_fn=loss_fn, targets=targets)


def seconds_per_micro_step(model: str, gpu: str, side: dict) -> float:
    """Predicted seconds of one micro-batch: forward + backward + the optimizer step / accum (GPU or host bound)."""
    c = counts(model, side["batch"], side.get("seq", 0), side["precision"])
    accum = side.get("accum", 1)
    gpu_s = host_s = 0.0
    for r in c.ops:
        share = 1.0 / accum if r.phase == "optimizer" else 1.0
        gpu_s += share * op_time(r, GPUS[gpu], side["precision"]).seconds
        host_s += share * HOST_SECONDS_PER_OP
    return max(gpu_s, host_s)


def predict(row: dict) -> dict:
    """The row with its published and predicted speedups (amp over base) and the error of the prediction."""
    base, amp = row["base"], row["amp"]
    t_base = seconds_per_micro_step(row["model"], row["gpu"], base)
    t_amp = seconds_per_micro_step(row["model"], row["gpu"], amp)
    if row["unit"] == "ms":
        published = base["value"] / amp["value"]
        predicted_base, predicted_amp = t_base * 1e3, t_amp * 1e3
    else:  # samples/s
        published = amp["value"] / base["value"]
        predicted_base, predicted_amp = base["batch"] / t_base, amp["batch"] / t_amp
    predicted = (amp["batch"] / t_amp) / (base["batch"] / t_base)
    return {**row, "published_speedup": published, "predicted_speedup": predicted,
            "predicted_base": predicted_base, "predicted_amp": predicted_amp, "error": predicted / published - 1}


def stats(rows: list[dict]) -> dict:
    """The issue's goals over the AMP rows: median |error|, share within 30%, worst ratio."""
    amp = [r for r in rows if r["kind"] == "amp"]
    errs = [abs(r["error"]) for r in amp]
    worst = max(max(r["predicted_speedup"] / r["published_speedup"], r["published_speedup"] / r["predicted_speedup"])
                for r in amp)
    return {"rows": len(amp), "median_abs_error": statistics.median(errs),
            "within_30": sum(e <= 0.30 for e in errs) / len(errs), "worst_ratio": worst}


def markdown(rows: list[dict]) -> str:
    """The table of benchmarks/README.md."""
    lines = ["| row | GPU | base | AMP | published (base -> AMP) | predicted (base -> AMP) | speedup published | "
             "speedup predicted | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a, unit = r["base"], r["amp"], r["unit"]
        fmt = "{:.0f}" if unit == "ms" or max(b["value"], a["value"]) >= 100 else "{:.1f}"

        def side(s):
            seq = f" T={s['seq']}" if s.get("seq") else ""
            acc = f" x{s['accum']}" if s.get("accum", 1) > 1 else ""
            return f"{s['precision']} b{s['batch']}{seq}{acc}"

        lines.append(f"| {r['id']} | {r['gpu']} | {side(b)} | {side(a)} | {fmt.format(b['value'])} -> "
                     f"{fmt.format(a['value'])} {unit} | {r['predicted_base']:.0f} -> {r['predicted_amp']:.0f} {unit} | "
                     f"{r['published_speedup']:.2f} | {r['predicted_speedup']:.2f} | {r['error']:+.0%} |")
    s = stats(rows)
    lines.append("")
    lines.append(f"AMP rows: {s['rows']}; median |error| of the speedup {s['median_abs_error']:.0%} (goal <= 20%); "
                 f"within 30%: {s['within_30']:.0%} (goal >= 75%); worst {s['worst_ratio']:.2f}x off (goal < 2x).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows with predictions here")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    data = json.loads(DATA.read_text())
    rows = [predict(r) for r in data["rows"]]
    print(markdown(rows))
    print(f"\n(planned in {time.perf_counter() - start:.0f} s on this machine)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
