"""`make gpu-test`: on a CUDA machine, collect the GPU evidence step by step, then build the report from it.

    python tools/gpu_test.py                        # needs CUDA; evidence + report -> benchmarks/gpu/
    python tools/gpu_test.py --out DIR              # evidence + report -> DIR
    python tools/gpu_test.py --dry-run              # list what would run, run nothing
    python tools/gpu_test.py --require-cuda         # the GPU CI job: no CUDA is a failure, not a dry run
    python tools/gpu_test.py --only 04 --only tests/gpu/test_cuda_doctor.py   # a subset (second try), smoke first
    python tools/gpu_test.py --report-from DIR      # on any machine (a CPU is enough): rebuild DIR's report
    python tools/gpu_test.py --report-from DIR --out benchmarks/gpu   # ... and write it (and the evidence) there

On a GPU machine without network whose Python has torch but no Jupyter stack (the course's GPU image:
Python 3.12, torch 2.11; `make` not known to be there), bring the wheels from tools/gpu_wheels.sh and run with
that Python. The one prepared command (under 8 minutes; each step writes its evidence into $OUT as soon as it
ends, so a run cut short still leaves the steps before the cut):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site python3 tools/gpu_test.py --require-cuda --out /tmp/gpu-evidence --archive $OUT/gpu-evidence.tar.gz

(`make gpu-test GPU_PYTHON=python3 GPU_WHEELS=.whl GPU_TEST_ARGS="..."` wraps the same two commands. The device
session carries `.whl` along and brings back only a few files from $OUT, hence one archive, refreshed after every
step, with report.json and report.md beside it.) A second try for what failed, within the same device time: the
same command with `--only` and what to rerun, e.g. `--only chapters/04_amp_training_loop.ipynb` or
`--only tests/gpu/test_cuda_doctor.py` (the smoke step always comes first: 10 s of machine facts), and its own
folder and archive (`--out /tmp/gpu-evidence-2 --archive $OUT/gpu-evidence-2.tar.gz`): its report covers what it
reran, the first run's report the rest.
Afterwards, on a CPU, with that archive fetched:

    python tools/gpu_test.py --report-from gpu-evidence.tar.gz --out benchmarks/gpu   # evidence + report

Steps, in this order (most evidence first), each in a process group of its own with its own budget (measured
times: the constants below); a step that reaches its budget gets SIGINT (pytest then writes its JUnit file and
summary: the tests done before the cut are kept), CUT_GRACE_S to end, then it is killed with every process it
started (notebook kernels, torchrun workers in their own sessions included), and the next step runs:

  1. smoke (30 s; about 10 s on an idle machine): versions, GPU and compute capability, TF32 defaults, what an
     fp32 -> fp8 cast does on CPU and GPU, fused vs foreach AdamW (the same steps: equal?), imports of nbval and
     torchao -> smoke.json;
  2. gpu tests (140 s; each test at most GPU_TEST_TIMEOUT_S, or its own timeout mark: the doctor's cost test,
     100 s): tests/gpu (marker `gpu`): speedup, matmul fraction
     of peak, trainer overhead, host syncs per step, `ampcourse.train --strategy ddp|fsdp` under torchrun on NCCL
     with one process (and with two where 2 GPUs exist), CUDA autocast and GradScaler, the doctor on CUDA, torchao
     float8 training (sm_89+), MXFP8 (emulated kernel on CUDA tensors where this torchao runs it; MX kernels on
     sm_100+) -> gpu-tests.xml (JUnit), bench-tests.json (figures), doctor_*.json/txt;
  3. one step per chapter, riskiest first (4, 7, 9, 1, then the rest), each its own pytest run and JUnit file
     (nb-<chapter>.xml), nbval in lax mode (numbers differ from the stored CPU outputs, so cells must run without
     error; outputs are not compared), a cell timeout below the step's budget, with AMPCOURSE_CHECKERS_RAISE=1 so
     an exercise checker that rejects the chapter's own solution fails the cell instead of printing its verdict;
  4. benchmarks (the rest of the 8 minutes, never less than BENCH_MIN_S: earlier steps are cut to leave it):
     `python -m ampcourse.bench --device cuda --quick` (on CUDA the large transformer, a few repeats) ->
     bench/bench.json. The full run (`python -m ampcourse.bench --device cuda --out DIR`, all three models at
     size="large") needs a few minutes of its own.
Every step's command, exit code, time, budget and whether it was cut go to steps.json (rewritten after
each step) and its output (unbuffered) to <step>.log. report.json and report.md are built from those files only,
by this file's stdlib-only code (the parent process imports neither torch nor ampcourse: the image's
Python may not have the repository on its path). A step passes when it exited 0 within its budget and
something ran; skipped tests (e.g. bf16 on a GPU below compute capability 8.0) are listed, not failures.
Without CUDA this is a dry run: it says what it skips and why, and exits 0 (`make test` checks that).
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "gpu"
#: The whole run, all steps together (the device sessions that run it have 8 minutes per command).
BUDGET_S = 8 * 60 - 20
CELL_TIMEOUT_S = 120
#: A step past its budget gets SIGINT first (pytest then writes its JUnit file and summary: the tests that passed
#: before the cut are kept), this many seconds to do so, then SIGTERM and SIGKILL for it and everything it started.
#: The cut comes this much before the budget ends, so a step still ends within it.
CUT_GRACE_S = 10.0
#: Step budgets, from measured times (the smoke step: ~10 s on an idle machine; tests/gpu: never run on a GPU yet,
#: the sum of its tests' own limits below, ~100 s expected; see NOTEBOOK_CPU_S for the chapters).
SMOKE_BUDGET_S = 30
GPU_TESTS_BUDGET_S = 140
#: Each test under tests/gpu (pytest-timeout, brought by tools/gpu_wheels.sh): a hung test fails alone, well before
#: its step's budget, and the tests after it still run. The slowest (the doctor's cost, two torchrun runs) fit in it.
GPU_TEST_TIMEOUT_S = 60
#: Strict nbval seconds of each chapter on the 2-core CPU machine, one torch thread, idle (benchmarks/README.md,
#: "Notebook suite wall time", 2026-11-30; 10 measured 2026-12-02 alone at load ~1.5. The same day at load ~9, 4 took
#: 40 s and 7 took 190 s: these are idle figures, as the GPU machine is idle). On the
#: GPU machine (16 cores, idle) the CPU side runs no slower; each chapter also starts pytest, a kernel, torch and CUDA
#: (NOTEBOOK_START_S). Budget: NOTEBOOK_START_S + NOTEBOOK_FACTOR x the CPU time, at least NOTEBOOK_MIN_S (chapter 10
#: runs larger sizes on CUDA; the GPU runs them faster than the CPU its small ones).
NOTEBOOK_CPU_S = {"00": 3.3, "01": 5.5, "02": 12.4, "03": 4.2, "04": 7.1, "05": 4.2, "06": 6.4, "07": 31.4,
                  "08": 7.0, "09": 6.9, "10": 27.7}
NOTEBOOK_START_S = 10.0
NOTEBOOK_FACTOR = 1.5
#: No chapter gets less: its first cell imports torch and starts CUDA, and nbval's cell timeout must leave room
#: for that below the step's budget.
NOTEBOOK_MIN_S = 30.0
NOTEBOOK_UNMEASURED_S = 45.0
#: The benchmarks (the payoff) come last and get what is left, but never less than this: each earlier step's budget
#: is cut to leave it (ampcourse.bench --quick on CUDA: the large transformer, a few repeats).
BENCH_MIN_S = 60
#: The chapters most likely to break on a GPU, run first: 4 (bit-identical loops, fused optimizers),
#: 7 (NCCL, ranks), 9 (fp8 on real hardware), 1 (fp8 cast behaviour, the environment check).
RISKY_CHAPTERS = ("04", "07", "09", "01")
#: What an exercise checker reads to raise instead of printing its verdict in a kernel (ampcourse.exercises._core).
CHECKERS_RAISE_ENV = "AMPCOURSE_CHECKERS_RAISE"
#: Skips that say the hardware lacks a feature: listed in the report, never a failure.
#: Steps that run pytest (name prefixes): one that collected nothing failed. ("notebooks" is the old plan's name.)
PYTEST_STEPS = ("gpu tests", "notebook")
CAPABILITY_SKIP = re.compile(r"compute capability|sm_\d\d|tensor cores|needs (an? |\d+ )?(Ampere|Hopper|Ada|Blackwell|GPUs?)",
                             re.I)


@dataclass
class Step:
    """One process of the GPU check: its command, its own time budget, and the evidence it writes."""

    name: str
    argv: list[str]
    budget_s: float
    junit: str | None = None  # file name in the evidence folder (pytest steps)
    env: dict[str, str] = field(default_factory=dict)
    reserve_s: float = 0.0  # the time kept for this step: the steps before it never get it

    @property
    def log(self) -> str:
        """The file its stdout and stderr go to, in the evidence folder."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") + ".log"


@dataclass
class StepResult:
    """What one step did: exit code, time, whether it was cut at its budget, and each test's outcome."""

    name: str
    command: str
    returncode: int | None  # None: stopped at its budget
    seconds: float
    budget_s: float
    tests: list[dict]
    log: str = ""

    @property
    def counts(self) -> dict[str, int]:
        """passed/failed/error/skipped totals."""
        out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        for t in self.tests:
            out[t["outcome"]] += 1
        return out

    @property
    def skips(self) -> list[dict]:
        """Skipped tests, each marked whether the hardware's capability was the reason."""
        return [{**t, "capability": bool(CAPABILITY_SKIP.search(t["message"]))} for t in self.tests
                if t["outcome"] == "skipped"]

    @property
    def ok(self) -> bool:
        """Finished in time with exit code 0, and for a pytest step something ran and nothing failed.

        Skips do not fail a step (a T4 has no bf16 tensor cores to time); the report lists each with its reason.
        """
        if self.returncode != 0:
            return False
        if not self.tests:
            return not self.name.startswith(PYTEST_STEPS)  # a pytest step that ran nothing failed
        c = self.counts
        return c["passed"] > 0 and c["failed"] == c["error"] == 0

    def to_json(self) -> dict:
        """The step as steps.json and report.json store it."""
        return {**asdict(self), "counts": self.counts, "ok": self.ok, "skips": self.skips}

    @classmethod
    def from_json(cls, d: dict) -> StepResult:
        """Back from steps.json; EvidenceError (one line) for an entry that is not what run_all() writes."""
        if not isinstance(d, dict):
            raise EvidenceError(f"steps.json: a step is a {type(d).__name__}, not an object")
        label = f"steps.json: step {d.get('name')!r}"
        kinds = {"name": str, "command": str, "returncode": (int, type(None)), "seconds": (int, float),
                 "budget_s": (int, float), "tests": list, "log": str}
        for key, kind in kinds.items():
            if key not in d and key in ("tests", "log"):
                continue
            if key not in d or isinstance(d[key], bool) or not isinstance(d[key], kind):
                raise EvidenceError(f"{label}: {key} is {'missing' if key not in d else repr(d[key])[:60]}")
        tests = d.get("tests", [])
        for t in tests:
            if (not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("message", ""), str)
                    or t.get("outcome") not in ("passed", "failed", "error", "skipped")):
                raise EvidenceError(f"{label}: a test entry {repr(t)[:80]} is not {{name, outcome, seconds, message}}")
            t = dict(t)
        tests = [{"name": t["name"], "outcome": t["outcome"], "seconds": _seconds(t.get("seconds", 0), label),
                  "message": t.get("message", "")} for t in tests]
        _seconds(d["seconds"], label)
        return cls(d["name"], d["command"], d["returncode"], d["seconds"], d["budget_s"], tests, d.get("log", ""))


def pytest_argv(*args: str, junit: Path | str, python: str | None = None) -> list[str]:
    """pytest with the project's addopts replaced (they select nbval strict mode and `not gpu`)."""
    return [python or sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rA",
            f"--junitxml={junit}", *args]


def shown(argv: list[str], workdir: Path | None = None) -> str:
    """A step's command as the report shows it: `python`, not this machine's interpreter or evidence folder."""
    out = []
    for a in argv:
        if a == sys.executable:
            a = "python"
        elif workdir is not None:
            a = a.replace(f"{workdir}{os.sep}", "").replace(str(workdir), "<out>")
        out.append(a.replace(f"{ROOT}{os.sep}", ""))
    return shlex.join(out)


def shown_args(args: list[str]) -> list[str]:
    """The command-line arguments as the report shows them: a folder outside the repository as <dir>."""
    out, after_dir = [], False
    for a in args:
        flag = next((f for f in ("--out=", "--report-from=", "--archive=") if a.startswith(f)), None)
        value = a.split("=", 1)[1] if flag else (a if after_dir else None)
        if value is not None and Path(value).is_absolute() and ROOT not in Path(value).resolve().parents:
            a = f"{flag}<dir>" if flag else "<dir>"
        out.append(a)
        after_dir = a in ("--out", "--report-from", "--archive")
    return out


def notebooks() -> list[str]:
    """Every notebook in chapters/, relative to the repository."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("*.ipynb"))


def risky_notebooks() -> list[str]:
    """The chapters in RISKY_CHAPTERS order (those that exist)."""
    by_number = {Path(nb).name[:2]: nb for nb in notebooks()}
    return [by_number[n] for n in RISKY_CHAPTERS if n in by_number]


def ordered_notebooks() -> list[str]:
    """Every chapter, the riskiest first (RISKY_CHAPTERS), then the rest in order."""
    risky = risky_notebooks()
    return risky + [nb for nb in notebooks() if nb not in risky]


def notebook_budget(nb: str) -> float:
    """A chapter's step budget: NOTEBOOK_START_S plus NOTEBOOK_FACTOR times its measured CPU time (NOTEBOOK_CPU_S).

    At least NOTEBOOK_MIN_S; a chapter without a measured time gets NOTEBOOK_UNMEASURED_S (and tests/tools/test_gpu_tool.py
    asks for a figure)."""
    measured = NOTEBOOK_CPU_S.get(Path(nb).name[:2])
    if measured is None:
        return NOTEBOOK_UNMEASURED_S
    return max(NOTEBOOK_MIN_S, round(NOTEBOOK_START_S + NOTEBOOK_FACTOR * measured))


def notebook_step(nb: str, out: Path, python: str | None = None) -> Step:
    """One chapter under nbval (lax), one pytest run and one JUnit file of its own, a cell timeout below its budget."""
    budget = notebook_budget(nb)
    stem = Path(nb).stem
    nbval = ("--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={cell_timeout(budget)}")
    junit = f"nb-{stem}.xml"
    return Step(f"notebook {stem}", pytest_argv(*nbval, nb, junit=out / junit, python=python), budget, junit,
                {CHECKERS_RAISE_ENV: "1"})


def cell_timeout(budget_s: float) -> int:
    """nbval's per-cell limit for a step of budget_s: below it, so a hung cell fails as a test (recorded in the JUnit
    file) before the step is cut, and at most CELL_TIMEOUT_S."""
    return int(max(5, min(CELL_TIMEOUT_S, budget_s - CUT_GRACE_S - 2)))


#: tests/gpu's files in the order they run: the quick ones and the paths nothing else covers first, the long doctor
#: cost test (its own 100 s limit) last, so a step cut at its budget loses the least (every file must be listed).
GPU_TEST_FILES = ("tests/gpu/test_cuda_amp.py", "tests/gpu/test_cuda_scaling.py", "tests/gpu/test_cuda_lowbit.py",
                  "tests/gpu/test_cuda_emulate.py", "tests/gpu/test_cuda_plan.py", "tests/gpu/test_cuda_bench.py",
                  "tests/gpu/test_cuda_doctor.py")


def gpu_tests_step(out: Path, python: str | None = None, targets: tuple[str, ...] = GPU_TEST_FILES,
                   timeouts: bool = True) -> Step:
    """tests/gpu (or some of its files or test ids) in one pytest run, each test limited to GPU_TEST_TIMEOUT_S
    (timeouts: whether the step's Python has pytest-timeout; without it a hung test is stopped by the step's cut)."""
    name = "gpu tests" if targets == GPU_TEST_FILES else "gpu tests (" + ", ".join(targets) + ")"
    limit = (f"--timeout={GPU_TEST_TIMEOUT_S}",) if timeouts else ()
    return Step(name, pytest_argv("-m", "gpu", *limit, *targets, junit=out / "gpu-tests.xml",
                                  python=python), GPU_TESTS_BUDGET_S, "gpu-tests.xml",
                {"AMPCOURSE_BENCH_JSON": str(out / "bench-tests.json"), "AMPCOURSE_GPU_OUT": str(out)})


def plan(out: Path, python: str | None = None, timeouts: bool = True) -> list[Step]:
    """The steps of a GPU check, writing their evidence into out: smoke, tests/gpu, one step per chapter (riskiest
    first), the benchmarks (their minimum, BENCH_MIN_S, reserved: earlier steps never eat it)."""
    py = python or sys.executable
    return [
        Step("smoke", [py, str(ROOT / "tools" / "gpu_test.py"), "--smoke", str(out / "smoke.json")], SMOKE_BUDGET_S),
        gpu_tests_step(out, py, timeouts=timeouts),
        *[notebook_step(nb, out, py) for nb in ordered_notebooks()],
        # --quick: on CUDA the large transformer, few repeats: it fits the time left (tests/gpu measured the goals)
        Step("benchmarks", [py, "-m", "ampcourse.bench", "--device", "cuda", "--quick", "--out", str(out / "bench")],
             BUDGET_S, reserve_s=BENCH_MIN_S),
    ]


def select(steps: list[Step], only: list[str], out: Path, python: str | None = None, timeouts: bool = True) -> list[Step]:
    """The subset of a plan that `--only` names, for a second try that fits: the smoke step (machine facts, 10 s)
    and then each item in the order given: a step's name ("gpu tests", "benchmarks"), a chapter (its path, file name
    or number: "chapters/04_amp_training_loop.ipynb", "04"), or GPU test files or ids ("tests/gpu/test_x.py::test_y",
    run together in one pytest step). ValueError (one line, naming the choices) for anything else."""
    by_name = {s.name: s for s in steps}
    chapters = {nb: by_name[f"notebook {Path(nb).stem}"] for nb in notebooks() if f"notebook {Path(nb).stem}" in by_name}
    chosen: list[Step] = [by_name["smoke"]] if "smoke" in by_name else []
    gpu_targets: list[str] = []
    for item in only:
        key = item.strip()
        if key in by_name:
            step = by_name[key]
        elif key.split("::")[0].startswith("tests/gpu") and (ROOT / key.split("::")[0]).exists():
            gpu_targets.append(key)
            continue
        else:
            match = [s for nb, s in chapters.items() if key in (nb, Path(nb).name, Path(nb).stem, Path(nb).name[:2])]
            if not match:
                raise ValueError(f"--only {item!r}: not a step ({', '.join(s.name for s in steps if not s.name.startswith('notebook'))}), "
                                 "a chapter (chapters/NN_name.ipynb or NN) or a tests/gpu file or test id")
            step = match[0]
        if step not in chosen:
            chosen.append(step)
    if gpu_targets:
        chosen.insert(1 if chosen and chosen[0].name == "smoke" else 0,
                      gpu_tests_step(out, python or sys.executable, tuple(gpu_targets), timeouts))
    return chosen


class EvidenceError(ValueError):
    """Evidence that is not what a gpu_test.py run writes (a malformed archive, steps.json or JUnit file, a path that
    leads outside the evidence): main() prints its message as one line and exits 2."""


def _seconds(value, where: str) -> float:
    """A JUnit time attribute (or steps.json seconds) as a float; EvidenceError naming where it is otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise EvidenceError(f"{where}: time {value!r} is not a number of seconds") from None
    if number != number or number in (float("inf"), float("-inf")) or number < 0:
        raise EvidenceError(f"{where}: time {value!r} is not a number of seconds")
    return number


def parse_junit(path: Path) -> list[dict]:
    """Each test case in a JUnit XML file: name, outcome, seconds, message.

    A file cut short (a step killed while pytest wrote it) gives []; a test case whose time is not a number is an
    EvidenceError."""
    if not path.exists():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:  # a step killed while pytest wrote it
        return []
    tests = []
    for case in root.iter("testcase"):
        if not case.get("name"):  # the test running when a SIGINT cut the step: pytest leaves an empty element
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        seconds = _seconds(case.get("time", 0), f"{path.name}: test case {name!r}")
        tests.append({"name": name, "outcome": outcome, "seconds": round(seconds, 2), "message": message})
    return tests


def _load_proctree():
    """ampcourse/_proctree.py (stdlib only), loaded by its path: this parent imports nothing of the ampcourse package
    (issue 19 item 2: the image's Python may not find it, or torch), yet shares the one /proc walk with
    ampcourse.distributed."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ampcourse_proctree", ROOT / "ampcourse" / "_proctree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_proctree = _load_proctree()
descendants = _proctree.descendants  # PIDs of every descendant of a pid, from /proc (torchrun's workers among them)


def kill_tree(proc: subprocess.Popen, family: list[int] | None = None) -> None:
    """Stop a step: its process group and every descendant (SIGTERM, then SIGKILL after 5 s).

    Args:
        proc: the step's process (the leader of its process group).
        family: descendants found earlier: after the leader exits, its children are re-parented and no walk from
            it finds them (torchrun workers in sessions of their own), so interrupt() passes what it saw first.
    """
    family = list(dict.fromkeys((family or []) + descendants(proc.pid)))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, group in [(proc.pid, True)] + [(p, False) for p in family]:
            try:
                os.killpg(pid, sig) if group else os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        family += [p for p in descendants(proc.pid) if p not in family]
        if sig == signal.SIGTERM and proc.poll() is not None and not any(_proctree.alive(p) for p in family):
            return


def interrupt(proc: subprocess.Popen, grace_s: float = CUT_GRACE_S) -> None:
    """Cut a step as Ctrl-C would, so its evidence survives: SIGINT to its process group (pytest then stops, writes
    its JUnit file with the tests done so far and prints its summary), up to grace_s seconds for that, then
    kill_tree() for the step and everything it started (a kernel, torchrun workers in sessions of their own).

    SIGTERM first, as before, lost every result: pytest writes JUnit only at the end of its session, and SIGTERM
    ends it without one (reproduced: a cut step with 2 passed tests reported none)."""
    family = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=max(grace_s, 0.1))
    except subprocess.TimeoutExpired:
        pass
    kill_tree(proc, family)


def step_env(step: Step) -> dict[str, str]:
    """The environment of a step: ours, the step's own variables, the repository first on PYTHONPATH and unbuffered
    output (a step's log is evidence up to the moment it was cut, not up to its last full buffer)."""
    env = dict(os.environ, **step.env)
    # Notebook kernels run in chapters/ and torchrun workers anywhere: ampcourse must import without an
    # install, e.g. under `make gpu-test GPU_PYTHON=python3` with the wheels on PYTHONPATH.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: Step, budget_s: float, out: Path) -> StepResult:
    """Run one step (cwd: the repository) in a process group of its own; cut it (interrupt()) so that it ends within
    budget_s: SIGINT CUT_GRACE_S (at most a fifth of the budget) before the end, then the whole tree."""
    out.mkdir(parents=True, exist_ok=True)
    grace = min(CUT_GRACE_S, budget_s / 5)
    start = time.monotonic()
    rc: int | None
    with open(out / step.log, "w") as log:
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=step_env(step), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(budget_s - grace, 1))
        except subprocess.TimeoutExpired:
            interrupt(proc, grace)
            rc = None
        except BaseException:  # Ctrl-C: no kernel or worker left on the GPU
            kill_tree(proc)
            raise
        else:
            try:  # what it started and left behind in its group (a kernel, a server) goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    seconds = round(time.monotonic() - start, 1)
    if rc is None:
        with open(out / step.log, "a") as log:
            log.write(f"\ngpu-test: {step.name} stopped at its {budget_s:.0f} s budget (SIGINT {grace:.0f} s before "
                      "it, then its processes were killed)\n")
    try:
        tests = parse_junit(out / step.junit) if step.junit else []
    except EvidenceError:  # a JUnit file cut mid-write: the step failed, its log says why
        tests = []
    return StepResult(step.name, shown(step.argv, out), rc, seconds, round(budget_s, 1), tests, step.log)


def machine_info() -> dict:
    """Versions, and the GPU if CUDA works: what this process's torch sees (the --probe and smoke steps)."""
    import torch

    import importlib.util

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "gpus": 0,
            "pytest_timeout": importlib.util.find_spec("pytest_timeout") is not None}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpus=torch.cuda.device_count(), device=props.name, capability=f"sm_{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    return info


def cuda_info(python: str | None = None) -> dict:
    """machine_info() of the step's Python, asked in a child process (this one imports no torch)."""
    argv = [python or sys.executable, str(ROOT / "tools" / "gpu_test.py"), "--probe"]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=step_env(Step("probe", [], 0)))
        if run.returncode == 0:
            return json.loads(run.stdout.strip().splitlines()[-1])
        error = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        error = f"{type(err).__name__}: {err}"
    return {"python": platform.python_version(), "torch": None, "cuda": None, "cuda_available": False, "gpus": 0,
            "error": error}


def git_commit() -> str | None:
    """The checked-out commit (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ------------------------------------------------------------------------------------------------
# The smoke step (runs in its own process, with torch): `gpu_test.py --smoke FILE`
# ------------------------------------------------------------------------------------------------

def _attempt(results: dict, key: str, fn) -> None:
    """results[key] = fn(), or the error in one line: one failed probe never hides the others."""
    try:
        results[key] = fn()
    except Exception as err:  # noqa: BLE001 - a smoke test records every failure as evidence
        results[key] = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"}


def _fp8_casts(device: str) -> dict:
    """What an fp32 -> fp8 cast gives for values past the format's max on this device (torch's behaviour moved)."""
    import torch

    values = [300.0, 500.0, 1e5, float("inf")]
    out = {}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name)
        out[name] = torch.tensor(values, device=device).to(dtype).float().cpu().tolist()
    return {"inputs": values, **out}


def _fused_vs_foreach() -> dict:
    """Three AdamW steps on the GPU with fused=True and foreach=True from the same start: bit-identical or not."""
    import torch

    weights = {}
    for impl in ("fused", "foreach"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{impl: True})
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(32, 64, device="cuda", generator=gen)).square().mean().backward()
            opt.step()
        weights[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    diff = (weights["fused"] - weights["foreach"]).abs().max().item()
    return {"bit_identical": bool(torch.equal(weights["fused"], weights["foreach"])), "max_abs_diff": diff}


def _tf32_defaults() -> dict:
    """The TF32 settings a fresh process starts with (the first knob on an Ampere+ GPU; chapter 2 teaches it)."""
    import torch

    out = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
           "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
           "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    for name, obj in (("cuda.matmul", torch.backends.cuda.matmul), ("cudnn.conv", getattr(torch.backends.cudnn, "conv", None))):
        if obj is not None and hasattr(obj, "fp32_precision"):
            out[f"{name}.fp32_precision"] = obj.fp32_precision
    return out


def _module_versions(names: tuple[str, ...]) -> dict[str, dict]:
    """Import each module in a child process of its own, all at once (a broken extension can abort an interpreter;
    torchao's import alone takes seconds): {name: {"version": ...} or {"error": last line}}."""
    procs = {name: subprocess.Popen([sys.executable, "-c", f"import importlib.metadata as m, {name}; print(m.version({name!r}))"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out[name] = {"error": "import took over 60 s"}
            continue
        out[name] = ({"version": stdout.strip().splitlines()[-1]} if proc.returncode == 0 else
                     {"error": (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]})
    return out


def smoke(path: Path) -> int:
    """The smoke step: write what this machine is and does to path (JSON), rewritten after every probe, so a
    probe that hangs past the step's budget still leaves the others' answers."""
    import torch

    start = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine_info()}
    probes = [("fp8_cast_cpu", lambda: _fp8_casts("cpu")),
              ("imports", lambda: _module_versions(("nbval", "torchao", "ipykernel", "ipywidgets")))]
    if torch.cuda.is_available():
        probes[:0] = [("bf16_supported_without_emulation", lambda: torch.cuda.is_bf16_supported(including_emulation=False)),
                      ("tf32_defaults", _tf32_defaults), ("fp8_cast_cuda", lambda: _fp8_casts("cuda")),
                      ("adamw_fused_vs_foreach", _fused_vs_foreach)]
    for key, probe in probes:
        _attempt(results, key, probe)
        results["seconds"] = round(time.monotonic() - start, 1)
        path.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0 if results["machine"]["cuda_available"] else 1


# ------------------------------------------------------------------------------------------------
# The report: built from the evidence files alone (stdlib only: runs on any CPU afterwards)
# ------------------------------------------------------------------------------------------------

TARGET_NAMES = ("BF16_PEAK_TARGET", "GPU_STEP_SPEEDUP_TARGET", "TRAINER_OVERHEAD_TARGET")
#: The course's GPU claims and the tests/gpu tests that back each (a part of the test name): the report says for
#: each whether it ran, was skipped (and why) or failed, so "DDP on NCCL" never reads as more than what ran.
COVERAGE = (
    ("test_torchrun_one_process_nccl", "DDP and FSDP2 under torchrun on NCCL, one process (no cross-rank collective)"),
    ("test_torchrun_two_ranks_nccl", "DDP and FSDP2 on NCCL with two ranks on two GPUs (all-reduce, sharding)"),
    ("test_float8_training_on_float8_tensor_cores", "torchao float8 training with float8 matmuls (sm_89+)"),
    ("test_mxfp8_training_emulated_on_cuda_tensors", "torchao MXFP8 training, emulated kernel, on CUDA tensors"),
    ("test_mxfp8_training_on_mx_tensor_cores", "torchao MXFP8 training with MX matmuls (sm_100+)"),
)


def coverage(steps: list[dict]) -> list[dict]:
    """Each COVERAGE claim with what this run did for it: passed / failed / skipped (with the reason) / not run."""
    tests = [t for s in steps for t in s.get("tests", [])]
    out = []
    for fragment, claim in COVERAGE:
        mine = [t for t in tests if fragment in t["name"]]
        outcomes = {t["outcome"] for t in mine}
        state = ("not run" if not mine else "failed" if outcomes & {"failed", "error"} else
                 "passed" if outcomes == {"passed"} else "skipped" if outcomes == {"skipped"} else "partly skipped")
        why = next((t["message"] for t in mine if t["outcome"] == "skipped"), "")
        out.append({"claim": claim, "state": state, "tests": len(mine), "reason": why})
    return out


def bench_targets(source: Path = ROOT / "ampcourse" / "bench.py") -> dict[str, float]:
    """The GPU goals as ampcourse/bench.py defines them, read from its source (no torch, no import needed)."""
    found = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in TARGET_NAMES:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = set(TARGET_NAMES) - set(found)
    if missing:
        raise RuntimeError(f"{source} no longer defines {sorted(missing)} as plain numbers; update TARGET_NAMES")
    return found


def _goal(name: str, value: float | None, shown_value: str, goal: str, met: bool | None) -> dict:
    """One row of the goals table (value None: not measured)."""
    return {"name": name, "value": value, "shown": shown_value if value is not None else "", "goal": goal,
            "met": None if value is None else met}


def goals(bench: dict, targets: dict[str, float] | None = None) -> list[dict]:
    """The GPU goals of benchmarks/README.md, read from the benchmark figures (value None: not measured)."""
    t = targets or bench_targets()
    speed, peak_goal, over_goal = t["GPU_STEP_SPEEDUP_TARGET"], t["BF16_PEAK_TARGET"], t["TRAINER_OVERHEAD_TARGET"]
    out = []
    step = bench.get("transformer_large_train_step", {})
    for p in ("bf16", "fp16"):
        v = step.get(f"speedup_{p}")
        out.append(_goal(f"transformer (size=large) train step, {p} AMP vs fp32 (TF32 off): speedup", v,
                         f"{v:.2f}x" if v is not None else "", f">= {speed:g}x", v is not None and v >= speed))
    for p in ("bf16", "fp16"):
        peak = bench.get(f"{p}_matmul_peak", {})
        frac = peak.get("fraction_of_peak")
        ref = (f"n={peak['reference_n']} vs the best of n={peak.get('peak_sizes', list(peak['tflops_by_n']))} "
               f"({peak['peak_tflops']:.0f} TFLOP/s at n={peak['peak_n']})" if peak else "n=4096 vs the best larger size")
        out.append(_goal(f"{p} matmul TFLOP/s as a fraction of a separately measured peak ({ref})", frac,
                         f"{frac:.0%}" if frac is not None else "", f">= {peak_goal:.0%}",
                         frac is not None and frac >= peak_goal))
    over = bench.get("trainer_overhead", {}).get("overhead")
    out.append(_goal("ampcourse.train vs a bare AMP loop on the GPU: per-step overhead", over,
                     f"{over:+.1%}" if over is not None else "", f"<= {over_goal:.0%}",
                     over is not None and over <= over_goal))
    syncs = bench.get("host_syncs_per_step", {}).get("fp16_fused")
    out.append(_goal("host syncs per fp16 train_step with fused AdamW", syncs, f"{syncs:g}" if syncs is not None else "",
                     "1", syncs is not None and syncs <= 1))
    return out


def _read_json(path: Path) -> dict:
    """A JSON object from an evidence file; {} when missing, cut short (a killed step) or a link (nothing outside the
    evidence is read)."""
    try:
        if path.is_symlink():
            return {}
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def evidence_file(evidence: Path, name, what: str) -> Path:
    """evidence / name, for a name that steps.json gives: a relative path that stays inside the evidence folder
    (no absolute path, no `..`, no link out of it), else EvidenceError: nothing outside the evidence is read."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise EvidenceError(f"steps.json: {what} {name!r} is not a file name")
    rel = Path(name)
    root = evidence.resolve()
    target = (evidence / rel).resolve()
    if rel.is_absolute() or ".." in rel.parts or (target != root and root not in target.parents):
        raise EvidenceError(f"steps.json: {what} {name!r} points outside the evidence folder; refusing to read it")
    return evidence / rel


def build_report(evidence: Path, targets: dict[str, float] | None = None) -> dict:
    """report.json's content from an evidence folder (steps.json, smoke.json, JUnit files, benchmark JSON).

    EvidenceError (one line) when the folder is not a run's evidence: no or malformed steps.json, a JUnit path that
    leads outside the folder, a test time that is not a number."""
    if not evidence.is_dir():
        raise EvidenceError(f"{evidence} is not a folder or an archive of a gpu_test.py run")
    if not (evidence / "steps.json").is_file():
        raise EvidenceError(f"{evidence} holds no steps.json: give the folder a `gpu_test.py` run wrote")
    try:
        run = json.loads((evidence / "steps.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise EvidenceError(f"steps.json is not JSON ({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    if not isinstance(run, dict) or not isinstance(run.get("steps", []), list) or not run:
        raise EvidenceError("steps.json is not an object with a list of steps, as a gpu_test.py run writes it")
    planned = run.get("planned", [s.get("name") if isinstance(s, dict) else None for s in run.get("steps", [])])
    if not isinstance(planned, list) or not all(isinstance(n, str) for n in planned):
        raise EvidenceError("steps.json: planned is not a list of step names")
    for key, kind in (("seconds", (int, float)), ("budget_seconds", (int, float)), ("command", str), ("started", str),
                      ("machine", dict)):
        if key in run and (isinstance(run[key], bool) or not isinstance(run[key], kind)):
            raise EvidenceError(f"steps.json: {key} is {repr(run[key])[:60]}")
    results = [StepResult.from_json(s) for s in run.get("steps", [])]
    for r, s in zip(results, run.get("steps", [])):  # re-read the JUnit files: they are the evidence
        if s.get("junit") is not None:
            junit = evidence_file(evidence, s["junit"], f"step {r.name!r}'s junit")
            if junit.is_file():
                r.tests = parse_junit(junit)
    smoke_data = _read_json(evidence / "smoke.json")
    bench = _read_json(evidence / "bench-tests.json")
    ampbench = _read_json(evidence / "bench" / "bench.json")
    not_run = [name for name in planned if name not in {r.name for r in results}]
    elapsed = run.get("seconds", sum(r.seconds for r in results))
    ok = bool(results) and not not_run and all(r.ok for r in results)
    try:
        the_goals = goals(bench, targets)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise EvidenceError(f"bench-tests.json does not hold the figures tests/gpu write ({type(err).__name__}: "
                            f"{err})") from None
    return {"status": "passed" if ok else "failed", "command": run.get("command", ""), "commit": run.get("commit"),
            "started": run.get("started", ""), "machine": smoke_data.get("machine") or run.get("machine", {}),
            "budget_seconds": run.get("budget_seconds", BUDGET_S), "seconds": elapsed, "not_run": not_run,
            "smoke": {k: v for k, v in smoke_data.items() if k != "machine"},
            "steps": [r.to_json() for r in results], "bench": bench, "goals": the_goals,
            "coverage": coverage([r.to_json() for r in results]), "ampcourse_bench": ampbench}


def _smoke_lines(smoke_data: dict) -> list[str]:
    """The smoke step's findings as Markdown bullets."""
    lines = []
    for key, value in smoke_data.items():
        if key == "seconds":
            continue
        if isinstance(value, dict) and set(value) == {"error"}:
            lines.append(f"- {key}: **error** {value['error']}")
        else:
            lines.append(f"- {key}: `{json.dumps(value)}`")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: machine, steps, skips, each test, goals, benchmark figures."""
    m = report["machine"]
    gpu = (f"{m.get('device')} ({m.get('capability')}, {m.get('memory_gib')} GiB), {m.get('gpus')} visible"
           if m.get("cuda_available") else "none")
    lines = [f"# GPU check: {report['status']}", "",
             f"- command: `{report['command']}`", f"- commit: `{report['commit']}`", f"- started: {report['started']}",
             f"- GPU: {gpu}", f"- torch {m.get('torch')} (CUDA {m.get('cuda')}), Python {m.get('python')}",
             f"- time: {report['seconds']} s of a {report['budget_seconds']} s budget", ""]
    if report["status"] == "dry-run":
        lines += [f"Dry run: {report['reason']}", "", "Would run:", ""]
        lines += [f"- {s['name']} ({s['budget_s']:.0f} s): `{s['command']}`" for s in report["steps"]]
        return "\n".join(lines) + "\n"
    if report.get("not_run"):
        lines += ["Not run (the run ended before them): " + ", ".join(report["not_run"]), ""]
    lines += ["| step | result | passed | failed | error | skipped | seconds | budget |",
              "|---|---|---|---|---|---|---|---|"]
    for s in report["steps"]:
        c = s["counts"]
        result = "ok" if s["ok"] else ("stopped at its budget" if s["returncode"] is None else "FAILED")
        lines.append(f"| {s['name']} | {result} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} "
                     f"| {s['seconds']} | {s['budget_s']:.0f} |")
    if report.get("smoke"):
        lines += ["", "## Smoke", ""] + _smoke_lines(report["smoke"])
    skips = [(s["name"], k) for s in report["steps"] for k in s.get("skips", [])]
    if skips:
        lines += ["", "## Skipped (listed, not failures)", ""]
        lines += [f"- {step}: `{k['name']}`: {k['message']}" + (" (hardware capability)" if k["capability"] else "")
                  for step, k in skips]
    for s in report["steps"]:
        if not s["tests"]:
            continue
        lines += ["", f"## {s['name']}", "", f"`{s['command']}`", "", "| test | outcome | seconds |", "|---|---|---|"]
        for t in s["tests"]:
            note = f" ({t['message']})" if t["message"] else ""
            lines.append(f"| `{t['name']}` | {t['outcome']}{note} | {t['seconds']} |")
    if report.get("coverage"):
        lines += ["", "## What the GPU paths ran", "", "| claim | this run |", "|---|---|"]
        lines += [f"| {c['claim']} | {c['state']}" + (f": {c['reason']}" if c["reason"] else "") + " |"
                  for c in report["coverage"]]
    if report.get("goals"):
        lines += ["", "## Goals (benchmarks/README.md)", "", "| figure | measured | goal | met |", "|---|---|---|---|"]
        for g in report["goals"]:
            value = "not measured" if g["value"] is None else g["shown"]
            met = "-" if g["met"] is None else ("yes" if g["met"] else "**no**")
            lines.append(f"| {g['name']} | {value} | {g['goal']} | {met} |")
    lines += _bench_lines(report.get("bench") or {})
    lines += _ampcourse_bench_lines(report.get("ampcourse_bench") or {})
    return "\n".join(lines) + "\n"


def _bench_lines(bench: dict) -> list[str]:
    """tests/gpu's figures (bench-tests.json) as Markdown tables."""
    lines = []
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
    return lines


def _ampcourse_bench_lines(ab: dict) -> list[str]:
    """`python -m ampcourse.bench --device cuda`'s bench.json, its train-step table."""
    rows = ab.get("train_step") or []
    if not rows:
        return []
    prec = ab.get("config", {}).get("precision", "amp")
    lines = ["", f"## python -m ampcourse.bench --device cuda (train step, fp32 vs {prec}, ms)", "",
             "| model | size | batch | fp32 ms | amp ms | amp / fp32 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['size']} | {r['batch']} | {r['fp32_ms']:.3g} | {r['amp_ms']:.3g} | "
              f"{r['amp_over_fp32']:.2f} |" for r in rows]
    return lines


def write_report(report: dict, out: Path) -> list[Path]:
    """report.json and report.md in out."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    return paths


def copy_evidence(src: Path, dst: Path) -> None:
    """The evidence files of a run (not an old report) from src into dst."""
    if src.resolve() == dst.resolve():
        return
    dst.mkdir(parents=True, exist_ok=True)
    root = src.resolve()
    for p in src.rglob("*"):
        # a link is not evidence: it would copy a file from elsewhere on this machine into the commit
        if p.is_file() and not p.is_symlink() and root in p.resolve().parents and p.name not in ("report.json", "report.md"):
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)


def write_archive(evidence: Path, archive: Path) -> None:
    """Every file of the evidence folder in one .tar.gz (replaced whole: a reader never sees half of one).

    A device session brings back only a few files from $OUT (8 there), so the run keeps its evidence in a
    folder of its own and refreshes this one file after every step.
    """
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(evidence.rglob("*")):
            if p.is_file() and p.resolve() != archive.resolve():
                tar.add(p, arcname=str(p.relative_to(evidence)))
    os.replace(tmp, archive)


def unpack(archive: Path, into: Path) -> Path:
    """A .tar.gz of evidence unpacked into `into` (plain files only, no paths outside it); EvidenceError (one line)
    for anything else: text, an empty or truncated file, a zip, a gzip that holds no tar."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts]
            try:
                tar.extractall(into, members=members, filter="data")  # Python >= 3.11.4: refuse links and odd modes
            except TypeError:
                tar.extractall(into, members=members)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        why = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise EvidenceError(f"{archive} is not a .tar.gz of evidence as --archive writes it ({why})") from None
    return into


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------

def load_plan(path: Path) -> list[Step]:
    """Steps from a JSON list of {name, argv, budget_s, junit?, env?, reserve_s?} (tests give stub steps this way)."""
    return [Step(d["name"], list(d["argv"]), float(d["budget_s"]), d.get("junit"), dict(d.get("env", {})),
                 float(d.get("reserve_s", 0))) for d in json.loads(path.read_text())]


def run_all(steps: list[Step], out: Path, header: dict, budget_s: float = BUDGET_S,
            archive: Path | None = None) -> list[StepResult]:
    """Run the steps in order, each within min(its budget, what is left); steps.json (and the archive) after each."""
    start = time.monotonic()
    results: list[StepResult] = []
    ran: list[Step] = []
    for i, step in enumerate(steps):
        left = budget_s - (time.monotonic() - start)
        reserved = sum(s.reserve_s for s in steps[i + 1:])  # the later steps' minimum (the benchmarks')
        if left - reserved < 5:
            print(f"gpu-test: no time left for {step.name}" + (f" ({reserved:.0f} s kept for the steps after it)"
                                                                 if reserved else ""), flush=True)
            continue
        budget = min(step.budget_s, left - reserved)
        print(f"\n=== gpu-test: {step.name} (budget {budget:.0f} s, {left:.0f} s left)\n{shown(step.argv, out)}", flush=True)
        result = run_step(step, budget, out)
        results.append(result)
        ran.append(step)
        c = result.counts
        state = "ok" if result.ok else ("stopped at its budget" if result.returncode is None else "FAILED")
        print(f"--- {step.name}: {state} in {result.seconds} s (passed {c['passed']}, failed {c['failed']}, "
              f"error {c['error']}, skipped {c['skipped']})", flush=True)
        if not result.ok:
            print("".join((out / step.log).read_text(errors="replace").splitlines(True)[-15:]), flush=True)
        record = {**header, "seconds": round(time.monotonic() - start, 1), "budget_seconds": budget_s,
                  "planned": [s.name for s in steps],
                  "steps": [{**r.to_json(), "junit": s.junit} for r, s in zip(results, ran)]}
        (out / "steps.json").write_text(json.dumps(record, indent=2) + "\n")
        if archive is not None:
            write_archive(out, archive)
    return results


def report_from(source: Path, out: Path | None) -> int:
    """`--report-from SOURCE [--out DIR]`: rebuild the report from a run's evidence folder or archive, write it (and
    a copy of the evidence) into out (default: the folder itself). EvidenceError (one line) for bad input."""
    if not source.exists():
        raise EvidenceError(f"--report-from {source}: no such file or folder")
    if source.is_file():  # an --archive file
        if out is None:
            raise EvidenceError("--report-from FILE (an archive) needs --out DIR for the evidence and the report")
        source = unpack(source, Path(tempfile.mkdtemp(prefix="gpu-evidence-")))
    elif out is not None and out.resolve() != source.resolve() and source.resolve() in out.resolve().parents:
        # copying the evidence into a folder inside it would copy the copy again, until "File name too long"
        raise EvidenceError(f"--out {out} is inside the evidence folder {source}: give a folder outside it (or none, "
                            "to write the report into the evidence folder itself)")
    out = out or source
    report = build_report(source)
    try:
        copy_evidence(source, out)
        paths = write_report(report, out)
    except OSError as err:
        raise EvidenceError(f"--out {out}: cannot write there ({err.strerror or err})") from None
    for p in paths:
        print(f"wrote {p}")
    print(f"gpu-test: {report['status']}")
    return 0 if report["status"] == "passed" else 1


def main(argv: list[str] | None = None) -> int:
    """Command line: run the GPU check (or a dry run, or rebuild a report) and write the report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help=f"evidence and report folder (default {DEFAULT_OUT.relative_to(ROOT)}; a dry run writes "
                         "a report only when given)")
    ap.add_argument("--dry-run", action="store_true", help="list the steps, run nothing")
    ap.add_argument("--require-cuda", action="store_true", help="exit 1 instead of a dry run when CUDA is missing")
    ap.add_argument("--report-from", type=Path, default=None, metavar="DIR",
                    help="build report.json/report.md from a run's evidence folder or --archive file (no GPU needed)")
    ap.add_argument("--archive", type=Path, default=None, metavar="FILE",
                    help="also keep the evidence in this .tar.gz, refreshed after every step, with report.json and "
                         "report.md beside it (for a device session that brings back only a few files)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds for the whole run, all steps together (default {BUDGET_S}: an 8-minute device call)")
    ap.add_argument("--only", action="append", default=[], metavar="ITEM",
                    help="a second try that fits: run the smoke step and only this (repeatable): a step's name "
                         "(\"gpu tests\", \"benchmarks\"), a chapter (chapters/04_amp_training_loop.ipynb, or 04), or a "
                         "tests/gpu file or test id")
    ap.add_argument("--plan", type=Path, default=None, help=argparse.SUPPRESS)  # JSON steps instead of the real plan
    ap.add_argument("--smoke", type=Path, default=None, help=argparse.SUPPRESS)  # the smoke step itself
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # machine_info() as JSON
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(machine_info()))
        return 0
    if args.smoke is not None:
        return smoke(args.smoke)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        ap.exit(2, f"gpu-test: --out {args.out} is a file, not a folder\n")
    if args.report_from is not None:
        try:
            return report_from(args.report_from, args.out)
        except EvidenceError as err:
            ap.exit(2, f"gpu-test: {err}\n")
    command = shlex.join(["python", "tools/gpu_test.py", *shown_args(argv if argv is not None else sys.argv[1:])])
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    out = args.out or DEFAULT_OUT
    machine = {"python": platform.python_version(), "cuda_available": True, "note": "stub plan"} if args.plan else cuda_info()
    steps = load_plan(args.plan) if args.plan is not None else plan(out, timeouts=machine.get("pytest_timeout", True))
    if args.only:
        try:
            steps = select(steps, args.only, out, timeouts=machine.get("pytest_timeout", True))
        except ValueError as err:
            ap.exit(2, f"gpu-test: {err}\n")
    header = {"command": command, "commit": git_commit(), "started": started, "machine": machine}
    if args.dry_run or not machine["cuda_available"]:
        reason = ("--dry-run given" if args.dry_run else
                  f"no CUDA device (torch {machine['torch']}, built for CUDA {machine['cuda']})"
                  + (f": {machine['error']}" if machine.get("error") else ""))
        if not args.dry_run and args.require_cuda:
            print(f"gpu-test: {reason}, and --require-cuda was given", file=sys.stderr)
            return 1
        print(f"gpu-test: dry run: {reason}. Skipping the GPU parts: the smoke step, the GPU-only tests (tests/gpu), "
              f"nbval (lax) over {len(notebooks())} notebooks and the benchmarks. Run `make gpu-test` on a machine "
              "with an NVIDIA GPU.")
        for s in steps:
            print(f"  would run {s.name} ({s.budget_s:.0f} s): {shown(s.argv, out)}")
        report = {**header, "status": "dry-run", "reason": reason, "budget_seconds": BUDGET_S, "seconds": 0.0,
                  "steps": [{"name": s.name, "command": shown(s.argv, out), "budget_s": s.budget_s} for s in steps]}
        if args.out is not None:
            for p in write_report(report, args.out):
                print(f"wrote {p}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    stale = ["steps.json", "smoke.json", "bench-tests.json", "report.json", "report.md", "bench/bench.json"]
    for name in stale + [s.log for s in steps] + [s.junit for s in steps if s.junit]:
        (out / name).unlink(missing_ok=True)  # evidence of an earlier run must not pass for this one's
    run_all(steps, out, header, args.budget, args.archive)
    report = build_report(out)
    for p in write_report(report, out) + (write_report(report, args.archive.parent) if args.archive else []):
        print(f"wrote {p}")
    print(f"gpu-test: {report['status']} in {report['seconds']} s")
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
