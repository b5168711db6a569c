#!/usr/bin/env bash
# Wheels that `make gpu-test` needs on a GPU machine whose image has torch, pytest, numpy and matplotlib
# but no Jupyter stack and no network (the course's GPU image: Python 3.12, torch 2.11): the notebook
# runner (nbval, nbclient, nbformat), the kernel (ipykernel, IPython, pyzmq, tornado, ...), ipywidgets at
# the versions of requirements.lock, and torchao at the release built for the image's torch (not the lock's:
# torchao's compiled parts and its MXFP8 recipe check the torch they run on), for CPython 3.12 on manylinux
# x86-64.
#
#   tools/gpu_wheels.sh .whl                         # here, with network: ~40 wheels, ~15 MB
#   GPU_WHEELS_TORCH=2.13 tools/gpu_wheels.sh .whl   # for an image with another torch (pyproject's table, below)
#   # there, in the repository root (the .whl folder carried along; no make needed):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 tools/gpu_test.py --require-cuda --out /tmp/gpu-evidence --archive $OUT/gpu-evidence.tar.gz
# The smoke step of `make gpu-test` (its first 30 s) imports torchao (and nbval, ipykernel, ipywidgets) in a
# child process and records the version or the error in smoke.json before any notebook needs it.
set -euo pipefail
out="${1:?usage: tools/gpu_wheels.sh DIR}"
pyver="${GPU_WHEELS_PYTHON:-3.12}"
torch_minor="${GPU_WHEELS_TORCH:-2.11}"
cd "$(dirname "$0")/.."
# The torchao release for the image's torch: pyproject.toml's [tool.ampcourse] torchao-for-torch, the one home of
# that table (tools/torch_leg.sh reads it too), looked up by the torch minor (2.11 -> the "2.11.x" entry).
torchao="$(python3 -c '
import sys, tomllib
table = tomllib.load(open("pyproject.toml", "rb"))["tool"]["ampcourse"]["torchao-for-torch"]
minor = sys.argv[1]
found = [ao for torch, ao in table.items() if torch == minor or torch.startswith(minor + ".")]
print(found[0] if found else "")
' "$torch_minor")"
if [[ -z "$torchao" ]]; then
    echo "gpu_wheels.sh: no torchao pin for torch $torch_minor in pyproject.toml's [tool.ampcourse] torchao-for-torch;" \
         "add one after checking which torch that torchao release was built against" >&2
    exit 2
fi
# pytest-timeout: tools/gpu_test.py limits each GPU test with --timeout (the image has pytest, not the plugin)
names=(pytest-timeout nbval nbformat nbclient fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
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
