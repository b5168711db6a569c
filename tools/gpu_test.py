"""`make gpu-test`: on a CUDA machine, every notebook through nbval (lax) and the GPU-only tests, with a report.

    python tools/gpu_test.py                    # needs CUDA; report -> benchmarks/gpu/report.{json,md}
    python tools/gpu_test.py --dry-run          # list what would run, run nothing
    python tools/gpu_test.py --require-cuda     # the GPU CI job: no CUDA is a failure, not a dry run

On a GPU machine without network whose Python has torch but no Jupyter stack (e.g. a CUDA container image),
bring the wheels from tools/gpu_wheels.sh and run with that Python instead of building .venv:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    make gpu-test GPU_PYTHON=python3 GPU_TEST_ARGS=--require-cuda

Steps, each a pytest run with a JUnit XML file the report is built from:
  1. notebooks: every chapters/*.ipynb through nbval in lax mode (on a GPU the numbers differ from the
     CPU outputs stored in the notebooks, so cells must run without error, outputs are not compared);
  2. gpu tests: tests/gpu (marker `gpu`): CUDA autocast + GradScaler, and the benchmarks, whose figures go
     into the report with the GPU goals of benchmarks/README.md: the transformer (size="large") train step,
     fp32 (TF32 off) vs bf16 vs fp16 AMP (speedup, goal >= 3x; interleaved); bf16 and fp16 n=4096 matmuls
     as a fraction of a peak measured separately (the best of n = 8192..16384 in the same run; goal >= 85%);
     ampcourse.train vs a bare loop (goal <= 3%); host syncs per fp16 step with fused AdamW (goal 1); and
     `--strategy ddp` / `fsdp` under torchrun with one process on NCCL.
The whole run has a budget of 8 minutes on one GPU; a step still running then is stopped and fails.
Without CUDA this is a dry run: it says what it skips and why, and exits 0 (`make test` checks that).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "gpu"
BUDGET_S = 8 * 60
CELL_TIMEOUT_S = 300


@dataclass
class Step:
    """One pytest run of the GPU check."""

    name: str
    argv: list[str]
    junit: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StepResult:
    """What one step did: exit code, time, and each test's outcome."""

    name: str
    command: str
    returncode: int | None  # None: stopped at the budget
    seconds: float
    tests: list[dict]

    @property
    def counts(self) -> dict[str, int]:
        """passed/failed/error/skipped totals."""
        out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        for t in self.tests:
            out[t["outcome"]] += 1
        return out

    @property
    def ok(self) -> bool:
        """Finished in time, exit code 0, something ran, nothing failed or skipped."""
        c = self.counts
        return self.returncode == 0 and c["passed"] > 0 and c["failed"] == c["error"] == c["skipped"] == 0


def pytest_argv(*args: str, junit: Path) -> list[str]:
    """pytest with the project's addopts replaced (they select nbval strict mode and `not gpu`)."""
    return [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rA",
            f"--junitxml={junit}", *args]


def shown(argv: list[str], workdir: Path) -> str:
    """A step's command as the report shows it: `python`, not this machine's interpreter path or temp folder."""
    return shlex.join("python" if a == sys.executable else a.replace(f"{workdir}{os.sep}", "") for a in argv)


def shown_args(args: list[str]) -> list[str]:
    """The command-line arguments as the report shows them: an --out folder outside the repository as <dir>."""
    out, after_out = [], False
    for a in args:
        value = a.split("=", 1)[1] if a.startswith("--out=") else (a if after_out else None)
        if value is not None and Path(value).is_absolute() and ROOT not in Path(value).resolve().parents:
            a = "--out=<dir>" if a.startswith("--out=") else "<dir>"
        out.append(a)
        after_out = a == "--out"
    return out


def notebooks() -> list[str]:
    """Every notebook in chapters/, relative to the repository."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("*.ipynb"))


def plan(workdir: Path, bench_json: Path) -> list[Step]:
    """The steps of a GPU check, writing their JUnit XML into workdir."""
    return [
        Step("notebooks", pytest_argv("--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={CELL_TIMEOUT_S}",
                                      *notebooks(), junit=workdir / "notebooks.xml"), workdir / "notebooks.xml"),
        Step("gpu tests", pytest_argv("-m", "gpu", "tests/gpu", junit=workdir / "gpu.xml"), workdir / "gpu.xml",
             env={"AMPCOURSE_BENCH_JSON": str(bench_json)}),
    ]


def parse_junit(path: Path) -> list[dict]:
    """Each test case in a JUnit XML file: name, outcome, seconds, message."""
    if not path.exists():
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        tests.append({"name": name, "outcome": outcome, "seconds": round(float(case.get("time", 0)), 2), "message": message})
    return tests


def run_step(step: Step, timeout: float, workdir: Path) -> StepResult:
    """Run one step (cwd: the repository) within timeout seconds; its output streams through."""
    start = time.monotonic()
    env = dict(os.environ, **step.env)
    # The repository on the path of every process a step starts (notebook kernels run in chapters/, torchrun
    # workers anywhere): ampcourse imports without an install, e.g. with `make gpu-test GPU_PYTHON=python3`.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        rc: int | None = subprocess.run(step.argv, cwd=ROOT, env=env, timeout=max(timeout, 1)).returncode
    except subprocess.TimeoutExpired:
        rc = None
        print(f"\n{step.name}: stopped at the {BUDGET_S // 60}-minute budget", flush=True)
    return StepResult(step.name, shown(step.argv, workdir), rc, round(time.monotonic() - start, 1), parse_junit(step.junit))


def cuda_info() -> dict:
    """torch's view of the machine: versions, and the GPU if CUDA works."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "gpus": 0}
    if info["cuda_available"]:
        major, minor = torch.cuda.get_device_capability(0)
        info.update(gpus=torch.cuda.device_count(), device=torch.cuda.get_device_name(0), capability=f"sm_{major}{minor}",
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return info


def git_commit() -> str | None:
    """The checked-out commit (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown(report: dict) -> str:
    """The report as Markdown: machine, steps, each test, benchmark figures."""
    m = report["machine"]
    gpu = f"{m.get('device')} ({m.get('capability')}, {m.get('memory_gib')} GiB), {m.get('gpus')} visible" if m.get("cuda_available") else "none"
    lines = [f"# GPU check: {report['status']}", "",
             f"- command: `{report['command']}`", f"- commit: `{report['commit']}`", f"- started: {report['started']}",
             f"- GPU: {gpu}", f"- torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}",
             f"- time: {report['seconds']} s of a {report['budget_seconds']} s budget", ""]
    if report["status"] == "dry-run":
        lines += [f"Dry run: {report['reason']}", "", "Would run:", ""]
        lines += [f"- {s['name']}: `{s['command']}`" for s in report["steps"]]
        return "\n".join(lines) + "\n"
    lines += ["| step | result | passed | failed | error | skipped | seconds |", "|---|---|---|---|---|---|---|"]
    for s in report["steps"]:
        c = s["counts"]
        result = "ok" if s["ok"] else ("stopped at budget" if s["returncode"] is None else "FAILED")
        lines.append(f"| {s['name']} | {result} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | {s['seconds']} |")
    for s in report["steps"]:
        lines += ["", f"## {s['name']}", "", f"`{s['command']}`", "", "| test | outcome | seconds |", "|---|---|---|"]
        for t in s["tests"]:
            note = f" ({t['message']})" if t["message"] else ""
            lines.append(f"| `{t['name']}` | {t['outcome']}{note} | {t['seconds']} |")
    if report.get("goals"):
        lines += ["", "## Goals (benchmarks/README.md)", "", "| figure | measured | goal | met |", "|---|---|---|---|"]
        for g in report["goals"]:
            shown = "not measured" if g["value"] is None else g["shown"]
            met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
            lines.append(f"| {g['name']} | {shown} | {g['goal']} | {met} |")
    bench = report.get("bench") or {}
    pairs = {k: b for k, b in bench.items() if "seconds_fp32" in b}
    if pairs:
        lows = [p for p in ("bf16", "fp16") if any(f"seconds_{p}" in b for b in pairs.values())]
        lines += ["", f"## Benchmark (fp32 with TF32 off vs {' and '.join(lows)} autocast, interleaved, medians)", "",
                  "| workload | fp32 ms | " + " | ".join(f"{p} ms | {p} speed-up" for p in lows) + " |",
                  "|---|---|" + "---|---|" * len(lows)]
        for name, b in pairs.items():
            cells = [f"{b[f'seconds_{p}'] * 1e3:.3g} | {b[f'speedup_{p}']:.2f}x" if f"seconds_{p}" in b else "- | -"
                     for p in lows]
            lines.append(f"| {b.get('what', name)} | {b['seconds_fp32'] * 1e3:.3g} | " + " | ".join(cells) + " |")
    for p in ("bf16", "fp16"):
        peak = bench.get(f"{p}_matmul_peak")
        if not peak:
            continue
        lines += ["", f"## {p} matmul TFLOP/s by size (the peak: the best size above n={peak['reference_n']})", "",
                  "| n | TFLOP/s |", "|---|---|"]
        lines += [f"| {n} | {t:.1f} |" for n, t in peak["tflops_by_n"].items()]
        if peak.get("datasheet_tflops"):
            lines += ["", f"Datasheet dense {p} for this GPU: {peak['datasheet_tflops']:g} TFLOP/s; the measured peak is "
                          f"{peak['peak_fraction_of_datasheet']:.0%} of it (context, not the goal)."]
    syncs = bench.get("host_syncs_per_step")
    if syncs:
        lines += ["", "## Host syncs (torch.cuda.set_sync_debug_mode)", ""]
        lines += [f"- {k}: {v:g}" for k, v in syncs.items() if isinstance(v, (int, float))]
    runs = [b for k, b in bench.items() if k.startswith("torchrun_")]
    if runs:
        lines += ["", "## torchrun, one process per GPU", "", "| command | backend | precision | steps | final loss |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{b['what']}` | {b['backend']} | {b['precision']} | {b['steps_done']} | {b['final_loss']:.4g} |"
                  for b in runs]
    return "\n".join(lines) + "\n"


def _goal(name: str, value: float | None, shown: str, goal: str, met: bool | None) -> dict:
    """One row of the goals table (value None: not measured)."""
    return {"name": name, "value": value, "shown": shown if value is not None else "", "goal": goal,
            "met": None if value is None else met}


def goals(bench: dict) -> list[dict]:
    """The GPU goals of benchmarks/README.md, read from the benchmark figures (value None: not measured)."""
    from ampcourse.bench import BF16_PEAK_TARGET, GPU_STEP_SPEEDUP_TARGET, TRAINER_OVERHEAD_TARGET

    out = []
    step = bench.get("transformer_large_train_step", {})
    for p in ("bf16", "fp16"):
        v = step.get(f"speedup_{p}")
        out.append(_goal(f"transformer (size=large) train step, {p} AMP vs fp32 (TF32 off): speedup", v,
                         f"{v:.2f}x" if v is not None else "", f">= {GPU_STEP_SPEEDUP_TARGET:g}x",
                         v is not None and v >= GPU_STEP_SPEEDUP_TARGET))
    for p in ("bf16", "fp16"):
        peak = bench.get(f"{p}_matmul_peak", {})
        frac = peak.get("fraction_of_peak")
        ref = (f"n={peak['reference_n']} vs the best of n={peak.get('peak_sizes', list(peak['tflops_by_n']))} "
               f"({peak['peak_tflops']:.0f} TFLOP/s at n={peak['peak_n']})" if peak else "n=4096 vs the best larger size")
        out.append(_goal(f"{p} matmul TFLOP/s as a fraction of a separately measured peak ({ref})", frac,
                         f"{frac:.0%}" if frac is not None else "", f">= {BF16_PEAK_TARGET:.0%}",
                         frac is not None and frac >= BF16_PEAK_TARGET))
    over = bench.get("trainer_overhead", {}).get("overhead")
    out.append(_goal("ampcourse.train vs a bare AMP loop on the GPU: per-step overhead", over,
                     f"{over:+.1%}" if over is not None else "", f"<= {TRAINER_OVERHEAD_TARGET:.0%}",
                     over is not None and over <= TRAINER_OVERHEAD_TARGET))
    syncs = bench.get("host_syncs_per_step", {}).get("fp16_fused")
    out.append(_goal("host syncs per fp16 train_step with fused AdamW", syncs, f"{syncs:g}" if syncs is not None else "",
                     "1", syncs is not None and syncs <= 1))
    return out


def write_report(report: dict, out: Path) -> list[Path]:
    """report.json and report.md in out."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    return paths


def main(argv: list[str] | None = None) -> int:
    """Command line: run the GPU check (or a dry run) and write the report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"report folder (default {DEFAULT_OUT.relative_to(ROOT)}; a dry run writes one only when given)")
    ap.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    ap.add_argument("--require-cuda", action="store_true", help="exit 1 instead of a dry run when CUDA is missing")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "tools/gpu_test.py", *shown_args(argv if argv is not None else sys.argv[1:])])
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    machine = cuda_info()
    with tempfile.TemporaryDirectory(prefix="gpu-test-") as tmp:
        work = Path(tmp)
        bench_json = work / "bench.json"
        steps = plan(work, bench_json)
        report = {"status": "", "command": command, "commit": git_commit(), "started": started, "machine": machine,
                  "budget_seconds": BUDGET_S, "seconds": 0.0}
        if args.dry_run or not machine["cuda_available"]:
            reason = ("--dry-run given" if args.dry_run else
                      f"no CUDA device (torch {machine['torch']}, built for CUDA {machine['cuda']})")
            if not args.dry_run and args.require_cuda:
                print(f"gpu-test: {reason}, and --require-cuda was given", file=sys.stderr)
                return 1
            print(f"gpu-test: dry run: {reason}. Skipping the GPU parts: nbval (lax) over {len(notebooks())} "
                  "notebooks and the GPU-only tests (tests/gpu). Run `make gpu-test` on a machine with an NVIDIA GPU.")
            for s in steps:
                print(f"  would run {s.name}: {shown(s.argv, work)}")
            report.update(status="dry-run", reason=reason,
                          steps=[{"name": s.name, "command": shown(s.argv, work)} for s in steps])
            if args.out is not None:
                for p in write_report(report, args.out):
                    print(f"wrote {p}")
            return 0
        start = time.monotonic()
        results = []
        for step in steps:
            left = BUDGET_S - (time.monotonic() - start)
            print(f"\n=== gpu-test: {step.name} ({left:.0f} s of the budget left)\n{shown(step.argv, work)}", flush=True)
            results.append(run_step(step, left, work))
        elapsed = round(time.monotonic() - start, 1)
        bench = json.loads(bench_json.read_text()) if bench_json.exists() else {}
    ok = all(r.ok for r in results) and elapsed <= BUDGET_S
    report.update(status="passed" if ok else "failed", seconds=elapsed, bench=bench, goals=goals(bench),
                  steps=[{**asdict(r), "counts": r.counts, "ok": r.ok} for r in results])
    for p in write_report(report, args.out or DEFAULT_OUT):
        print(f"wrote {p}")
    print(f"gpu-test: {report['status']} in {elapsed} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
