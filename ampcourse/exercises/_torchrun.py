"""Run a learner's function on N ranks under torchrun, and bring back what every rank computed.

A distributed exercise's checker hands :func:`run_on_ranks` the learner's function (and, in the same
launch, the package's reference solution). The function's source (``inspect.getsource``, which works for
functions defined in notebook cells) travels to the workers in a spec file; torchrun (through
:func:`ampcourse.distributed.launch`) starts N workers, each runs this module's ``main``: it starts the
process group (NCCL on a node with two or more GPUs, one worker per GPU from LOCAL_RANK; gloo on the CPU
otherwise: :func:`default_nproc`), rebuilds every
solution from its source, hands each to the exercise's runner (a function in the chapter's checker
module that runs the solution on this rank and returns what it computed), and writes the results to
``rank-R.pt``. The parent reads them back (``torch.load(weights_only=True)``).

A hang (a rank that never reaches a collective) ends: collectives time out after ``dist_timeout`` s and
the whole launch after ``timeout`` s, after which :func:`ampcourse.distributed.launch` kills torchrun's
process group and every worker. The verdict then says which ranks never finished.

The learner's function runs in fresh processes: it sees only what it imports itself, plus ``torch``,
``torch.distributed as dist``, ``torch.nn as nn``, ``os`` and ``math``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import distributed
from ._core import failed

__all__ = ["RankResults", "learner_source", "default_nproc", "run_on_ranks", "main"]

#: Names a learner's function may use without importing them (they are there in every worker).
PRELUDE = "import math\nimport os\n\nimport torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"


def learner_source(title: str, fn: Callable) -> str:
    """The source of the learner's function, dedented; feedback if it is no function or still the stub."""
    if not callable(fn) or not inspect.isfunction(fn):
        failed(title, "a function", f"{type(fn).__name__} {fn!r}", "pass the function itself, without calling it")
    if fn.__name__ == "<lambda>":  # its source is the lines around it, which may not parse alone (a lambda in brackets)
        failed(title, "a function defined with `def` in a cell or a file", "a lambda",
               "define it with `def name(...):` (its source travels to the ranks; a lambda's does not) and pass that")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as err:
        failed(title, "a function defined with `def` in a cell or a file", f"no source for it ({err})",
               "define it with `def name(...):` (not a lambda, not built with exec) and run that cell again")
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != fn.__name__:
        failed(title, "a function defined with `def` at the top of a cell", source.splitlines()[0],
               "define it with `def name(...):` in a cell of its own, without decorators")
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    only_raises = body and all(isinstance(s, ast.Raise) or isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)
    if only_raises and any(isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s) for s in body):
        failed(title, "an implementation", "NotImplementedError",
               "replace the `raise NotImplementedError` stub with your code")
    return source


#: Ranks a checker starts by default: two are enough to show a collective's effect ("inf on the last rank", "kill
#: the last rank", "ranks identical"), and on an 8-GPU node one rank per GPU meant 8 processes importing torch and
#: starting NCCL within the checker's 120 s limit, twice for 7.6's restart. More only when asked (nproc=).
CHECKER_NPROC = 2


def default_nproc(device: str | None) -> tuple[int, str]:
    """(processes, device): CHECKER_NPROC NCCL ranks, one per GPU, on a node with two or more GPUs; else 2 CPU ranks
    over gloo.

    The exercises judge what happens *between* ranks ("inf on the last rank", "kill the last rank", "ranks
    identical"): on one rank those test nothing and wrong solutions pass. So below two GPUs (an H200 box,
    Colab) the checkers use two gloo ranks on the CPU, as chapter 7 says, and an explicit device='cuda'
    there is refused. Above two GPUs the checkers still start two ranks (CHECKER_NPROC), not one per GPU.

    Args:
        device: 'cuda', 'cpu', or None/'auto' (CUDA where two or more GPUs exist).

    Example::

        >>> default_nproc("cpu")
        (2, 'cpu')
    """
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < 2:
            raise ValueError(f"device='cuda' needs two or more GPUs for two ranks, this node has {gpus}; "
                             "use device=None or 'cpu' (two gloo ranks on the CPU)")
        return min(gpus, CHECKER_NPROC), "cuda"
    if device == "cpu":
        return CHECKER_NPROC, "cpu"
    raise ValueError(f"device must be 'cpu', 'cuda' or None (auto), got {device!r}")


#: The most ranks a checker launches on one node (each is a Python process importing torch).
MAX_NPROC = 64


@dataclass
class RankResults:
    """What every rank returned for every solution: results[name][rank] (a dict, or {'error': text})."""

    results: dict[str, list[dict]]
    nproc: int
    device: str
    seconds: float
    restarts: int = 0
    stderr: str = field(default="", repr=False)

    def errors(self, name: str) -> list[tuple[int, str]]:
        """(rank, error text) for every rank whose run of solution `name` raised."""
        return [(r, res["error"]) for r, res in enumerate(self.results[name]) if "error" in res]


def _hang_hint(exercise: str) -> str:
    """What usually makes one rank wait forever."""
    return ("a rank waits in a collective (all_reduce, barrier, ...) that another rank never reaches: every rank "
            "must call the same collectives in the same order; never put one inside `if rank == ...` or skip "
            f"backward()/the all-reduce on one rank only ({exercise})")


def run_on_ranks(title: str, runner: str, solutions: Mapping[str, tuple[str, str]], *, nproc: int | None = None,
                 device: str | None = None, params: Mapping[str, Any] | None = None, timeout: float = 120.0,
                 dist_timeout: float = 30.0, max_restarts: int = 0) -> RankResults:
    """Launch `runner` ('module:function') on N ranks for every solution {name: (source, function name)}.

    Returns every rank's results, or gives the learner's verdict (ExerciseError) when the launch hung or
    a worker died for reasons outside the learner's code.
    """
    procs, dev = default_nproc(device)
    if nproc is not None:
        # One rank tests nothing (a solution that never all-reduces passes), and a huge count spawns that many
        # processes before failing: both refused before any launch.
        if isinstance(nproc, bool) or not isinstance(nproc, int) or not 2 <= nproc <= MAX_NPROC:
            raise ValueError(f"nproc must be an int from 2 to {MAX_NPROC} (one rank cannot show a collective's "
                             f"effect), got {nproc!r}")
        if dev == "cuda" and nproc > torch.cuda.device_count():
            raise ValueError(f"nproc={nproc} but this node has {torch.cuda.device_count()} GPUs; use at most that")
        procs = nproc
    with tempfile.TemporaryDirectory(prefix="ampcourse-ex-") as tmp:
        spec = {"runner": runner, "device": dev, "dist_timeout": dist_timeout, "params": dict(params or {}),
                "solutions": {name: {"source": src, "function": fn} for name, (src, fn) in solutions.items()}}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        try:
            run = distributed.launch(["spec.json"], module="ampcourse.exercises._torchrun", nproc_per_node=procs,
                                     max_restarts=max_restarts, cwd=tmp, timeout=timeout,
                                     monitor_interval=0.5 if max_restarts else None)
        except distributed.LaunchTimeout:
            # A rank stuck in a collective gives up after dist_timeout and writes its error; the culprit never does.
            done = {int(p.stem.split("-")[1]): p for p in Path(tmp).glob("rank-*.pt")}
            missing = [r for r in range(procs) if r not in done]
            waited = []
            for r, path in sorted(done.items()):
                errors = [res["error"] for res in torch.load(path, weights_only=True)["results"].values() if "error" in res]
                waited += [f"rank {r}: {errors[0][:160]}"] if errors else []
            failed(title, f"all {procs} ranks to finish within {timeout:g} s",
                   f"a hang: rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} never finished "
                   "(torchrun and every worker were killed)" + "".join(f"; {w}" for w in waited), _hang_hint(title))
        files = {r: Path(tmp) / f"rank-{r}.pt" for r in range(procs)}
        missing = [r for r, f in files.items() if not f.exists()]
        if missing:
            tail = "\n".join(run.stderr.strip().splitlines()[-6:])
            if re.search(r"timed? ?out|watchdog", run.stderr, re.IGNORECASE):  # NCCL's watchdog aborts the waiting rank
                failed(title, f"all {procs} ranks to finish", f"a hang: a collective timed out after {dist_timeout:g} s "
                       f"and torchrun stopped the job (ranks {missing} wrote no result)", _hang_hint(title))
            finished = [r for r in range(procs) if r not in missing]
            if finished and re.search(r"SIGABRT|Signal 6\b|exitcode\s*:\s*-6\b", run.stderr):
                # a rank aborted (gloo or NCCL on mismatched collectives) while others finished their work: the
                # usual cause is a collective called on some ranks only, not a crash outside the learner's code
                failed(title, "every rank to call the same collectives",
                       f"rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} aborted (SIGABRT) "
                       f"while rank{'s' if len(finished) != 1 else ''} {', '.join(map(str, finished))} finished: a "
                       "collective was called on some ranks only", _hang_hint(title))
            failed(title, f"all {procs} ranks to finish", f"torchrun exited {run.returncode}; ranks {missing} wrote "
                   f"no result. Last lines:\n{textwrap.indent(tail, '             ')}",
                   "a rank crashed outside your function (or torchrun could not restart it): read the lines above")
        per_rank = [torch.load(files[r], weights_only=True) for r in range(procs)]
    results = {name: [per_rank[r]["results"][name] for r in range(procs)] for name in solutions}
    return RankResults(results, procs, dev, run.seconds, restarts=max(p["restarts"] for p in per_rank),
                       stderr=run.stderr)


# ---------------------------------------------------------------------------------------------
# The worker side: runs under torchrun
# ---------------------------------------------------------------------------------------------

def _build(source: str, name: str) -> Callable:
    """The learner's function, rebuilt from its source in a fresh namespace with the prelude's imports."""
    namespace: dict[str, Any] = {"__name__": "__learner__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)  # noqa: S102 - the learner's own code, on their machine
    exec(compile(source, f"<your {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _error_text(err: BaseException, source: str) -> str:
    """The exception in one line, plus the line of the learner's function where it happened."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename.startswith("<your ")]
    lines = source.splitlines()
    where = ""
    if frames and 0 < (frames[-1].lineno or 0) <= len(lines):
        where = f" (line {frames[-1].lineno} of your function: {lines[frames[-1].lineno - 1].strip()})"
    return f"{type(err).__name__}: {text}{where}"


def main(argv: list[str] | None = None) -> int:
    """One worker: start the process group, run every solution through the runner, write rank-R.pt."""
    spec_path = Path((argv if argv is not None else sys.argv[1:])[0])
    spec = json.loads(spec_path.read_text())
    env = distributed.torchrun_env()
    device = distributed.worker_device(env, spec["device"])
    ctx = distributed.init(device, env, timeout_s=spec["dist_timeout"])
    module, func = spec["runner"].split(":")
    runner = getattr(importlib.import_module(module), func)
    results: dict[str, dict] = {}
    for index, (name, sol) in enumerate(spec["solutions"].items()):
        try:
            fn = _build(sol["source"], sol["function"])
            results[name] = runner(fn, ctx, dict(spec["params"], case=name, case_index=index, workdir=str(spec_path.parent)))
        except Exception as err:  # the learner's code: reported per rank, never a crash of the checker
            results[name] = {"error": _error_text(err, sol["source"])}
    out = spec_path.parent / f"rank-{env.rank}.pt"
    tmp = out.with_suffix(".tmp")
    torch.save({"results": results, "restarts": env.restart_count}, tmp)
    os.replace(tmp, out)  # the parent never reads half a file
    try:
        # NCCL: no rank may destroy its communicator while another is still in a collective with it (the
        # learner's last all-reduce can still be in flight on a slower rank). Bounded by dist_timeout.
        distributed.teardown(barrier=True)
    except Exception:  # noqa: BLE001 - a rank that is gone or stuck: our result is written, the parent judges
        pass
    return 0


if __name__ == "__main__":
    distributed.exit_worker(main())
