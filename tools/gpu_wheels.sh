#!/usr/bin/env bash
# Wheels that `make gpu-test` needs on a GPU machine whose image has torch, pytest, numpy and matplotlib
# but no Jupyter stack and no network (e.g. a CUDA container image with Python 3.12 and torch):
# the notebook runner (nbval, nbclient, nbformat), the kernel (ipykernel, IPython, pyzmq, tornado, ...)
# and ipywidgets, at the versions of requirements.lock, for CPython 3.12 on manylinux x86-64.
#
#   tools/gpu_wheels.sh .whl                  # here, with network: ~40 wheels, ~15 MB
#   # there, in the repository root (the .whl folder carried along):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   make gpu-test GPU_PYTHON=python3 GPU_TEST_ARGS=--require-cuda
set -euo pipefail
out="${1:?usage: tools/gpu_wheels.sh DIR}"
pyver="${GPU_WHEELS_PYTHON:-3.12}"
cd "$(dirname "$0")/.."
names=(nbval nbformat nbclient fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
       ipykernel ipython ipython_pygments_lexers jupyter_client jupyter_core traitlets pyzmq tornado comm debugpy
       matplotlib-inline nest-asyncio2 platformdirs jedi parso pexpect ptyprocess prompt_toolkit wcwidth
       stack-data asttokens executing pure_eval ipywidgets widgetsnbextension jupyterlab_widgets
       torchao)  # chapter 9; the device image has transformers, ml-dtypes and torchvision, not torchao
pins=()
for name in "${names[@]}"; do
    pin=$(grep -i "^${name}==" requirements.lock || true)
    pins+=("${pin:-$name}")
done
mkdir -p "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out" "${pins[@]}"
ls "$out" | wc -l
du -sh "$out"
