"""How often does a torchrun elastic restart succeed, with and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?

Runs the fault scenario of tests/test_distributed.py::test_elastic_restart_after_sigkill_resumes_and_matches
(2 CPU processes, DDP fp16, 10 steps, checkpoint every 3, rank 1 SIGKILLs itself in step 5,
torchrun --max-restarts 1) `--runs` times and prints one line per run and the counts:

    .venv/bin/python benchmarks/elastic_restarts.py --store-fix 1 --runs 10
    .venv/bin/python benchmarks/elastic_restarts.py --store-fix 0 --runs 10
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ampcourse import distributed

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model", "mlp", "--device", "cpu", "--global-batch-size", "32", "--samples", "256", "--seed", "0",
        "--no-progress", "--strategy", "ddp", "--precision", "fp16", "--steps", "10", "--checkpoint-every", "3",
        "--out", "summary.json", "--checkpoint-dir", "ckpt", "--dist-timeout", "30"]


def reason(stderr: str) -> str:
    """The first gloo connection error in a failed run's output."""
    for line in stderr.splitlines():
        if ("Connection refused" in line or "connectFullMesh" in line) and "ampcourse.train: warning" not in line:
            return line.strip()[:160]
    return stderr.strip().splitlines()[-1][:160] if stderr.strip() else "?"


def main() -> None:
    """Run the scenario repeatedly and print the counts."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store-fix", choices=("0", "1"), required=True)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    ok, checksums = 0, set()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            run = distributed.launch(ARGS, script=ROOT / "tests" / "dist_worker.py", cwd=tmp, max_restarts=1,
                                     env={"AMPCOURSE_TEST_KILL": "1:5", distributed.STORE_FIX_ENV: args.store_fix},
                                     timeout=240)
            killed = "exitcode: -9" in run.stderr
            if run.returncode == 0:
                summary = json.loads((Path(tmp) / "summary.json").read_text())
                checksums.add(summary["checksum"])
                ok += 1
                what = f"ok, resumed from step {summary['resumed_from_step']}, checksum {summary['checksum'][:12]}"
            else:
                what = f"FAILED: {reason(run.stderr)}"
            print(f"run {i}: killed={killed} {time.perf_counter() - start:5.1f} s  {what}", flush=True)
    print(f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE={args.store_fix}: {ok}/{args.runs} restarts succeeded; "
          f"distinct final checksums among them: {len(checksums)}")


if __name__ == "__main__":
    main()
