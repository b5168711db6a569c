"""examples/ddp_amp.py, the standalone DDP + AMP script of chapter 7: plain PyTorch, and the same run as
`python -m ampcourse.train` on the same config (final weights within the project's DDP tolerance, 4 ulps)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampcourse import checkpoint, distributed
from ampcourse.train import train
from test_distributed import assert_rounding_level

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_amp.py"
CONFIG = ["--steps", "8", "--global-batch-size", "32", "--samples", "256", "--seed", "0"]


def test_the_script_does_not_import_ampcourse():
    tree = ast.parse(SCRIPT.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "ampcourse" not in imported and "torch" in imported


def test_one_process_matches_the_package(tmp_path):
    """No torchrun: fp32 SGD, bit for bit the package's loop (the same model, data, batches and step)."""
    run = subprocess.run([sys.executable, str(SCRIPT), *CONFIG, "--precision", "fp32", "--optimizer", "sgd",
                          "--lr", "0.1", "--device", "cpu", "--out", "w.pt"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    mine = torch.load(tmp_path / "w.pt", weights_only=True)
    ref = train("mlp", None, "fp32", steps=8, optimizer="sgd", lr=0.1, seed=0, batch_size=32, n_samples=256,
                device="cpu", progress=False).model.state_dict()
    assert assert_rounding_level(mine, ref) == 0.0


@pytest.mark.slow
def test_ddp_fp16_under_torchrun_matches_ampcourse_train(tmp_path):
    """2 CPU processes, fp16 autocast + GradScaler + AdamW: the script and `python -m ampcourse.train --strategy ddp`
    end within 4 ulps of each other (the project's DDP tolerance)."""
    common = [*CONFIG, "--precision", "fp16", "--device", "cpu", "--lr", "1e-3"]
    script = distributed.launch([*common, "--out", "w.pt"], script=SCRIPT, cwd=tmp_path, timeout=120).check()
    assert script.stdout.count("step    7") == 1  # rank 0 logs, the others do not
    distributed.launch([*common, "--strategy", "ddp", "--model", "mlp", "--no-progress", "--checkpoint-dir", "ckpt"],
                       cwd=tmp_path, timeout=120).check()
    mine = torch.load(tmp_path / "w.pt", weights_only=True)
    ref = checkpoint.load(checkpoint.path_in(tmp_path / "ckpt"))["model"]
    assert_rounding_level(mine, ref, ulps=4)
    # and the tolerance is tight: another seed's run misses it by far
    other = train("mlp", None, "fp16", steps=8, seed=1, batch_size=32, n_samples=256, device="cpu",
                  progress=False).model.state_dict()
    with pytest.raises(AssertionError, match="ulps"):
        assert_rounding_level(mine, other)


@pytest.mark.parametrize("argv,says", [
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),  # was ZeroDivisionError in the loop
    (["--samples", "10"], "--global-batch-size 64 is larger than --samples 10"),  # ZeroDivisionError
    (["--lr", "nan"], "--lr must be a finite number > 0"),  # torch.optim's ValueError traceback
    (["--out", "."], "--out '.' is a folder"),  # RuntimeError from torch.save AFTER the whole run
    (["--out", "/dev/null"], "--out '/dev/null' exists and is not a regular file"),  # as root: /dev/null replaced
])
def test_bad_arguments_are_one_line_before_any_work(argv, says, tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--precision", "fp32", *argv],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""  # no step ran
    assert run.stderr.startswith("ddp_amp.py: error: ") and says in run.stderr and run.stderr.count("\n") == 1


def test_out_is_replaced_whole_and_no_temp_file_is_left(tmp_path):
    (tmp_path / "w.pt").write_bytes(b"old")
    run = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--precision", "fp32", "--out", "w.pt"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]
    assert "net.0.weight" in torch.load(tmp_path / "w.pt", weights_only=True)


def test_out_through_a_link_writes_its_file_and_keeps_the_link(tmp_path):
    (tmp_path / "real.pt").write_bytes(b"old")
    (tmp_path / "link.pt").symlink_to(tmp_path / "real.pt")
    run = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--precision", "fp32", "--out", "link.pt"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "link.pt").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link.pt", "real.pt"]
    assert "net.0.weight" in torch.load(tmp_path / "real.pt", weights_only=True)


def test_a_pipe_as_out_is_refused_before_any_work(tmp_path):
    """Issue 30 item 8: a temp file renamed over a node that is not a regular file would replace it."""
    os.mkfifo(tmp_path / "fifo")
    run = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--precision", "fp32", "--out", "fifo"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "is not a regular file" in run.stderr and run.stdout == ""
    assert (tmp_path / "fifo").is_fifo()
