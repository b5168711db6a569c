#!/usr/bin/env bash
# Wheels that `make gpu-test` needs on a GPU machine whose image has torch, pytest, numpy and matplotlib
# but no Jupyter stack and no network (the course's GPU image: Python 3.12, torch 2.11): the notebook
# runner (nbval, nbclient, nbformat), the kernel (ipykernel, IPython, pyzmq, tornado, ...), ipywidgets at
# the versions of requirements.lock, and torchao at the release built for the image's torch (not the lock's:
# torchao's compiled parts and its MXFP8 recipe check the torch they run on), for CPython 3.12 on manylinux
# x86-64.
#
#   tools/gpu_wheels.sh .whl                         # here, with network: ~40 wheels, ~15 MB
#   GPU_WHEELS_TORCH=2.13 tools/gpu_wheels.sh .whl   # for an image with another torch (see TORCHAO_FOR below)
#   # there, in the repository root (the .whl folder carried along):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   make gpu-test GPU_PYTHON=python3 GPU_TEST_ARGS="--require-cuda --out $OUT"
# The smoke step of `make gpu-test` (its first 30 s) imports torchao (and nbval, ipykernel, ipywidgets) in a
# child process and records the version or the error in smoke.json before any notebook needs it.
set -euo pipefail
out="${1:?usage: tools/gpu_wheels.sh DIR}"
pyver="${GPU_WHEELS_PYTHON:-3.12}"
torch_minor="${GPU_WHEELS_TORCH:-2.11}"
# torchao release per torch minor (torchao/__init__.py says which torch a release was built against):
# 0.17.0 is the torch 2.11 build (0.18.0 asserts a newer torch in its MXFP8 training); 0.18.0 the torch 2.13 one.
declare -A TORCHAO_FOR=([2.11]=0.17.0 [2.13]=0.18.0)
torchao="${TORCHAO_FOR[$torch_minor]:-}"
if [[ -z "$torchao" ]]; then
    echo "gpu_wheels.sh: no torchao pin for torch $torch_minor; add one to TORCHAO_FOR after checking which torch" \
         "that torchao release was built against" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
names=(nbval nbformat nbclient fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
       ipykernel ipython ipython_pygments_lexers jupyter_client jupyter_core traitlets pyzmq tornado comm debugpy
       matplotlib-inline nest-asyncio2 platformdirs jedi parso pexpect ptyprocess prompt_toolkit wcwidth
       stack-data asttokens executing pure_eval ipywidgets widgetsnbextension jupyterlab_widgets)
pins=("torchao==$torchao")  # chapter 9; the device image has transformers, ml-dtypes and torchvision, not torchao
for name in "${names[@]}"; do
    pin=$(grep -i "^${name}==" requirements.lock || true)
    pins+=("${pin:-$name}")
done
echo "gpu_wheels.sh: torch $torch_minor image -> torchao $torchao; the rest at requirements.lock's versions"
mkdir -p "$out"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out" "${pins[@]}"
ls "$out" | wc -l
du -sh "$out"
