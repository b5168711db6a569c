"""Chapter 9 where torchao cannot be imported (Colab after `pip install --no-deps`): it runs to the end and says what it skipped.

torchao is hidden by a ``sitecustomize`` on PYTHONPATH that makes every ``import torchao...`` raise
ModuleNotFoundError, the way a runtime without it does; the notebook runs in a fresh kernel (nbclient) in a
subprocess, so nothing imported in this test process leaks in.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = ROOT / "chapters" / "09_below_16_bits.ipynb"

HIDE_TORCHAO = '''
import importlib.abc
import sys


class _NoTorchao(importlib.abc.MetaPathFinder):
    """Refuse torchao and its submodules, as an interpreter without it does."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorchao())
'''

RUN = '''
import json, sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
texts = []
for cell in nb.cells:
    if cell.cell_type == "code":
        texts.append("".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream"))
print(json.dumps(texts))
'''


def env_without_torchao(tmp_path: Path) -> dict:
    """This environment with the torchao-hiding sitecustomize first on PYTHONPATH (then the checkout, for ampcourse)."""
    shim = tmp_path / "hide_torchao"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_TORCHAO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg", CUDA_VISIBLE_DEVICES="")
    return env


def test_the_shim_hides_torchao(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from ampcourse import fp8; print(fp8.torchao_unavailable()); "
                          "print(fp8.recipe_unavailable('float8')); import torchao"],
                         env=env_without_torchao(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "No module named 'torchao'" in out.stderr  # the import itself fails
    reason, recipe = out.stdout.splitlines()[:2]
    assert "torchao" in reason and "pip install torchao" in reason
    assert "torchao cannot be imported" in recipe and "pip install torchao" in recipe


@pytest.mark.slow
def test_chapter_9_runs_to_the_end_without_torchao(tmp_path):
    out = subprocess.run([sys.executable, "-c", RUN, str(CHAPTER), str(CHAPTER.parent)], env=env_without_torchao(tmp_path),
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]  # a CellExecutionError (an ImportError in a cell) fails here
    texts = json.loads(out.stdout.strip().splitlines()[-1])
    everything = "\n".join(texts)
    assert "torchao: torchao's MX formats cannot be imported" in everything  # the setup cell says which case this is
    assert "the comparison with torchao skipped" in everything and "equal to torchao" not in everything  # 9.3
    assert "float8: skipped: torchao cannot be imported" in everything  # 9.6
    assert "mxfp8: skipped" in everything and "training bf16, 30 steps" in everything
    assert "training float8" not in everything
