#!/usr/bin/env bash
# One extra torch "leg" of CI: the course on another torch than the lock's, as a learner would get it.
#
#   tools/torch_leg.sh 2.11.0        # the declared floor
#   tools/torch_leg.sh 2.15.0        # the newest torch tested
#   tools/torch_leg.sh --install-only 2.15.0   # step 1 only (.ci/run builds both venvs while `make test` runs)
#
# For the torch version given (one of pyproject.toml's [tool.ampcourse] torch-tested), the leg
#   1. builds (or reuses) a virtual environment with that torch, the torchao that pyproject.toml pairs with it
#      ([tool.ampcourse] torchao-for-torch) and every other package at requirements.lock's pin;
#   2. checks that torch, torchao and every ampcourse module import;
#   3. runs the unit tests that depend on torch: not the slow (multi-process), browser, learner-copy
#      (test_student.py) and make-lab tests, which re-run chapters that step 4 covers, nor the GPU ones;
#   4. runs every chapter under nbval in lax mode: the cells must run and their asserts hold, but the stored
#      outputs come from the lock's torch and are compared strictly only by `make test`.
# Each step prints its wall time. The venv lives outside the clone (CI starts on a clean clone, so the script
# installs what it needs; a venv with the same torch, torchao and lock is reused):
#   TORCH_LEG_CACHE (default ~/.cache/ampcourse/torch-legs)/torch-<version>
# Exit status: non-zero when any step fails (later steps still run, so one failure does not hide the others).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

INSTALL_ONLY=0
if [ "${1:-}" = "--install-only" ]; then
    INSTALL_ONLY=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: tools/torch_leg.sh [--install-only] TORCH_VERSION   (one of pyproject.toml's [tool.ampcourse] torch-tested)" >&2
    exit 2
fi
TORCH="$1"
PYTHON="${PYTHON:-python3}"

# The torchao paired with this torch, from pyproject.toml (one home for the pairing).
TORCHAO="$("$PYTHON" - "$TORCH" <<'EOF'
import sys, tomllib
cfg = tomllib.load(open("pyproject.toml", "rb"))["tool"]["ampcourse"]
torch = sys.argv[1]
if torch not in cfg["torch-tested"]:
    sys.exit(f"torch {torch} is not in pyproject.toml's [tool.ampcourse] torch-tested {cfg['torch-tested']}")
print(cfg["torchao-for-torch"][torch])
EOF
)" || exit 2

CACHE="${TORCH_LEG_CACHE:-$HOME/.cache/ampcourse/torch-legs}"
VENV="$CACHE/torch-$TORCH"
mkdir -p "$CACHE"
# The lock's pins minus torch and torchao: the constraints of this leg. Passed as PIP_CONSTRAINT, which
# replaces any machine-wide pip constraint (one capping torch below the version asked for would refuse it).
CONSTRAINTS="$CACHE/constraints-$TORCH.txt"
grep -v -E '^(torch|torchao)==' requirements.lock > "$CONSTRAINTS"
WANT="torch==$TORCH torchao==$TORCHAO lock=$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"

elapsed() { echo $(( $(date +%s) - $1 )); }
failed=()
step() {  # step NAME COMMAND...: run, time, remember a failure
    local name="$1"; shift
    local t0; t0=$(date +%s)
    echo "=== torch $TORCH leg: $name"
    if "$@"; then
        echo "=== torch $TORCH leg: $name ok ($(elapsed "$t0") s)"
    else
        echo "=== torch $TORCH leg: $name FAILED ($(elapsed "$t0") s)"
        failed+=("$name")
    fi
}

# pyproject's runtime and test requirements, one per array element (torch and torchao are pinned above)
mapfile -t DEPS < <("$PYTHON" -c '
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for d in p["dependencies"] + p["optional-dependencies"]["test"]:
    if not d.startswith(("torch>", "torch=", "torchao")):
        print(d.split(";")[0].strip())
')

install() {
    if [ -f "$VENV/.leg" ] && [ "$(cat "$VENV/.leg")" = "$WANT" ]; then
        echo "reusing $VENV ($WANT)"
    else
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV" || return 1
        # the test extra (pytest, nbval, ...) and a kernel for nbval; ampcourse itself comes from this clone
        # through PYTHONPATH below, so a cached venv serves any clone
        PIP_CONSTRAINT="$CONSTRAINTS" "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            "torch==$TORCH" "torchao==$TORCHAO" ipykernel \
            "${DEPS[@]}" || return 1
        echo "$WANT" > "$VENV/.leg"
    fi
}

export PYTHONPATH="$ROOT" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES=
PY="$VENV/bin/python"
T0=$(date +%s)
# As `make test`: one pytest-xdist worker per core (at most 4), a notebook's cells in one worker.
WORKERS="${TEST_WORKERS:-$("$PYTHON" tools/test_workers.py)}"
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder); fi

step "install (torch $TORCH, torchao $TORCHAO)" install || true
if [ "$INSTALL_ONLY" = 1 ]; then
    [ ${#failed[@]} -eq 0 ]
    exit
fi
if [ ! -x "$PY" ]; then
    echo "torch $TORCH leg: no environment, nothing else to run" >&2
    exit 1
fi
step "import check" "$PY" -c '
import importlib, pkgutil, torch, torchao, ampcourse
mods = [m.name for m in pkgutil.walk_packages(ampcourse.__path__, "ampcourse.") if not m.name.endswith("__main__")]
for m in mods:
    importlib.import_module(m)
print(f"torch {torch.__version__}, torchao {torchao.__version__}: {len(mods)} ampcourse modules import from {ampcourse.__path__[0]}")
'
# Not torch-dependent, or re-running chapters that the lax nbval step runs: test_environments (files only),
# test_gpu_tool (tools/gpu_test.py is stdlib-only; its torch-side tests live in test_gpu_pretend, which a leg runs:
# ~100 s per leg under load, telling nothing about torch), test_browser, test_student (learner copies),
# test_make_lab; and the slow marker (multi-process runs, the wheel build). Only what a leg can tell that
# `make test` cannot: what depends on the torch version.
step "unit tests (torch-dependent; not slow, browser, learner-copy, make-lab)" \
    "$PY" -m pytest "${XDIST[@]}" tests -p no:cacheprovider -q -m "not slow and not gpu" \
    --ignore tests/course/test_browser.py --ignore tests/course/test_student.py --ignore tests/course/test_make_lab.py \
    --ignore tests/course/test_environments.py --ignore tests/tools/test_gpu_tool.py --ignore tests/gpu
# AMPCOURSE_CHECKERS_RAISE=1: a checker that rejects a chapter's own solution fails its cell (lax mode compares no
# outputs, and in a kernel a checker only prints its verdict)
step "every chapter, nbval lax" env AMPCOURSE_CHECKERS_RAISE=1 \
    "$PY" -m pytest "${XDIST[@]}" chapters -o addopts="" -p no:cacheprovider -q --nbval-lax --nbval-current-env \
    --nbval-cell-timeout=300

echo "=== torch $TORCH leg: $(elapsed "$T0") s in all"
if [ ${#failed[@]} -gt 0 ]; then
    printf '=== torch %s leg FAILED: %s\n' "$TORCH" "${failed[*]}"
    exit 1
fi
echo "=== torch $TORCH leg passed"
