# ampcourse: two commands for learners (`make lab`, `make test`), the rest for maintainers.
# Everything lives in a local virtual environment (.venv) built from requirements.lock.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ampcourse-installed
PORT   ?= 8888

.PHONY: setup lab test unit notebooks nbclean student bench gpu-test clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# One kernel: "python3" (the name every notebook asks for), shown as "ampcourse" (tools/nbtool.py KERNELSPEC),
# in .venv, with one OpenMP thread. Installed by setup, so `make test`'s JupyterLab (tests/course/test_browser.py) finds
# the kernel the stored chapters name and does not rewrite their metadata; again by `make lab` (under a second),
# so a .venv from before gets it too. The lab config hides any other kernel.
KERNEL_INSTALL = $(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name ampcourse --env OMP_NUM_THREADS 1 >/dev/null

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[lab,test]'
	$(KERNEL_INSTALL)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv with pinned dependencies and ampcourse (editable)

# JupyterLab listens on loopback only; as root (containers) it needs --allow-root to start at all.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

# The learner's own copies (git ignores them): made on the first `make lab`, never overwritten after;
# a chapter added later is copied in. JupyterLab (tools/lab_config.py) serves the repository root and
# opens on $(WORKSPACE)/00_index.ipynb; the full chapters (solutions, stored outputs) are read-only there,
# so a Run All in chapters/ is never written to disk and `git pull` never conflicts.
# WORKSPACE may hold spaces: every use below is quoted.
WORKSPACE ?= workspace
# Kernels inherit the server's environment: one OpenMP thread, as under `make test` (TEST_ENV below),
# so a busy machine does not slow a chapter tenfold (benchmarks/README.md, "Busy machine").
LAB_ENV := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}

lab: setup  ## set up, copy the chapters you have no copy of yet into workspace/, open JupyterLab on its index
	$(BIN)/python tools/make_student.py -o "$(WORKSPACE)"
	$(KERNEL_INSTALL)
	AMPCOURSE_WORKSPACE="$(WORKSPACE)" $(LAB_ENV) $(BIN)/jupyter lab --config=tools/lab_config.py --notebook-dir=. --ip=127.0.0.1 --port=$(PORT) $(ALLOW_ROOT) $(LAB_ARGS)

# Tests run with one OpenMP thread per process unless OMP_NUM_THREADS is set: the course's models are
# tiny, and on a busy 2-core machine two spinning OpenMP threads per process made chapter 2 take 148 s
# instead of 13 s (benchmarks/README.md, "Notebook suite wall time").
# CUDA_VISIBLE_DEVICES= hides every GPU from the CPU suite: otherwise, on a GPU machine, pick() would choose
# CUDA, unit tests that expect a CPU would fail, strict nbval would compare GPU numbers with the stored CPU
# outputs, and `make notebooks` would store CUDA outputs that then fail CPU CI. The GPU suite is `make gpu-test`.
TEST_ENV := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=
# pytest-xdist: with one OpenMP thread per process a single pytest keeps one core busy, so the suite runs in
# TEST_WORKERS processes, one per core and at most 4 (a distributed test starts 2-4 processes of its own);
# --dist loadscope keeps each notebook's cells (and each test module's fixtures) in one worker, and
# --no-loadscope-reorder keeps tests/conftest.py's order (the long modules first, so none ends the run alone).
# TEST_WORKERS=0 runs everything in this process (for a debugger).
TEST_WORKERS ?= $(shell $(PYTHON) tools/test_workers.py)
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

test: setup  ## set up, then run unit tests and every notebook through nbval
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST)

unit: setup  ## the edit loop: unit tests without notebooks and without the slow (multi-process) ones
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST) tests -m "not slow and not gpu"

notebooks: setup  ## re-execute every chapter and store clean outputs (after changing code or prose)
	$(TEST_ENV) $(BIN)/python tools/nbtool.py execute chapters/*.ipynb

nbclean: setup  ## strip noisy metadata from the chapters without executing them
	$(BIN)/python tools/nbtool.py clean chapters/*.ipynb

student: setup  ## learner copies in workspace/ (solutions stubbed, outputs cleared); existing copies are kept
	$(BIN)/python tools/make_student.py -o "$(WORKSPACE)"

# GPU_PYTHON=python3: use a Python that already has torch (CUDA) instead of building .venv; GPU_WHEELS=.whl: first
# install those wheels (tools/gpu_wheels.sh) into GPU_SITE and put it on PYTHONPATH: for GPU machines without
# network. A wrapper: the device session's prepared command needs no make (tools/gpu_test.py's docstring):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#   PYTHONPATH=/tmp/site python3 tools/gpu_test.py --require-cuda --out /tmp/gpu-evidence --archive $OUT/gpu-evidence.tar.gz
GPU_PYTHON ?=
GPU_WHEELS ?=
GPU_SITE   ?= /tmp/ampcourse-gpu-site
GPU_PY     := $(or $(GPU_PYTHON),$(BIN)/python)
GPU_INSTALL := $(if $(GPU_WHEELS),$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$(GPU_SITE)" "$(GPU_WHEELS)"/*.whl && PYTHONPATH="$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}" ,)

gpu-test: $(if $(GPU_PYTHON),,setup)  ## on a CUDA machine: smoke, GPU-only tests, notebooks (nbval lax), benchmark; evidence + report in benchmarks/gpu/ (else a dry run)
	$(GPU_INSTALL)$(GPU_PY) tools/gpu_test.py $(GPU_TEST_ARGS)

clean:  ## remove the virtual environment and build leftovers
	rm -rf $(VENV) build *.egg-info
