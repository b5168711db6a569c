"""`python -m ampcourse.doctor`: reference models, a factory of your own, and one clear line for bad input."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FACTORIES = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
        return model, torch.randn(32, 8), torch.randint(0, 3, (32,)), F.cross_entropy

    def with_optimizer():
        model, x, y, loss = make()
        return model, x, y, loss, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def three():
        return make()[:3]

    def misfit():
        model, x, y, loss = make()
        return model, torch.randn(32, 5), y, loss

    def broken():
        raise RuntimeError("no data here")

    not_callable = 3

    class Lookup(nn.Module):
        def forward(self, x):
            return {"logits": x}["labels"]  # a KeyError from the learner's own forward

    def key_error():
        return Lookup(), torch.randn(4, 8), None, None
''')


def doctor(*args, cwd=None, path=None):
    """Run the command line; returns the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(path or ""), str(ROOT)) if p))
    return subprocess.run([sys.executable, "-m", "ampcourse.doctor", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd or ROOT, env=env)


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("factories")
    (d / "my_models.py").write_text(FACTORIES)
    return d


def test_reference_model_writes_json_and_html(tmp_path):
    out, page = tmp_path / "report.json", tmp_path / "report.html"
    run = doctor("--model", "transformer", "--out", str(out), "--html", str(page))
    assert run.returncode == 0, run.stderr
    assert "AMP doctor on cpu" in run.stdout
    data = json.loads(out.read_text())
    v = data["verdicts"]
    from ampcourse.device import pick
    want = min(v, key=lambda p: (v[p]["status"] != "clean", not v[p].get("native", False), p != pick("cpu").precision, p))
    assert data["recommended_precision"] == want and data["device"] == "cpu"
    assert all(f["severity"] == "info" for f in data["findings"])  # the reference transformer is healthy
    assert page.read_text().startswith("<!doctype html>") and "<table>" in page.read_text()


def test_factory_of_your_own(factories, tmp_path):
    out = tmp_path / "r.json"
    run = doctor("--model", "my_models:with_optimizer", "--precisions", "fp16", "--out", str(out), "--steps", "0",
                 path=factories)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert list(data["verdicts"]) == ["fp16"] and data["optimizer"]["class"] == "AdamW"
    assert data["steps"] == 0 and data["verdicts"]["fp16"]["confirmation"]["status"] == "unconfirmed"
    assert "unconfirmed" in run.stdout.splitlines()[0]


BAD = [
    (["--model", "no_such_pkg.mod:make"], "cannot import 'no_such_pkg.mod'"),
    (["--model", "my_models:nothing"], "has no attribute 'nothing'"),
    (["--model", "my_models:not_callable"], "is not callable"),
    (["--model", "my_models:three"], "must return (model, inputs, targets, loss_fn)"),
    (["--model", "my_models:misfit"], "cannot run on this data"),
    (["--model", "my_models:broken"], "the factory raised RuntimeError: no data here"),
    (["--model", "transformr"], "reference model name or 'package.module:factory'"),
    (["--model", "mlp", "--precisions", "fp32"], "fp32 is always run"),
    (["--model", "mlp", "--device", "tpu"], "device"),
    # issue 12: flags argparse refuses, numbers beyond range, files that cannot be written, any error of the model
    (["--model", "mlp", "--batch", "x"], "argument --batch/--batch-size/--global-batch-size: invalid int value: 'x'"),
    (["--model", "mlp", "--bogus"], "unrecognized arguments: --bogus"),
    (["--model", "mlp", "--steps", "-1"], "--steps must be >= 0 (0: the forensic pass), got -1"),
    (["--model", "mlp", "--seed", str(2**64)], "--seed must be an int >= 0 and < 2**64"),
    (["--model", "mlp", "--batch", "10000000000000"], "--batch 10000000000000: dataset size (n_samples) must be"),
    (["--model", "mlp", "--precisions", "fp64"], "unknown precision 'fp64'; choose from fp16, bf16"),
    (["--model", "mlp", "--precisions", ","], "non-empty sequence of 'fp16' and/or 'bf16'"),
    (["--model", "mlp", "--out", "/proc/ampcourse-doctor.json"], "cannot write --out '/proc/ampcourse-doctor.json'"),
    (["--model", "mlp", "--html", "/no-such-folder/r.html"], "its folder does not exist"),
    (["--model", "my_models:key_error"], "failed with KeyError: 'labels'"),
    (["--model", "../f.py:make"], "--model '../f.py:make': the part before ':' must be a module name"),
    (["--model", "mlp", "--out", "/dev/full"], "cannot write --out '/dev/full'"),
]


def one_error_line(stderr: str, message: str) -> None:
    """No traceback: exactly one line, prefixed, containing message."""
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampcourse.doctor: error:") and message in lines[0], stderr


@pytest.mark.parametrize("args, message", BAD)
def test_bad_input_in_process(factories, monkeypatch, capsys, args, message):
    from ampcourse.doctor import main
    monkeypatch.syspath_prepend(str(factories))
    assert main(args) == 2
    one_error_line(capsys.readouterr().err, message)


def test_out_is_checked_before_the_work(factories, monkeypatch, capsys):
    """--out /dev/full fails at once, not after the whole examination (which would run examine)."""
    import ampcourse.doctor.cli as cli
    called = []
    monkeypatch.setattr(cli, "examine", lambda *a, **k: called.append(1))
    assert cli.main(["--model", "mlp", "--out", "/dev/full"]) == 2
    assert called == []
    one_error_line(capsys.readouterr().err, "No space left on device")


@pytest.mark.parametrize("case", [0, 3, 4, 9, 17, 18])  # import fails, wrong shape, inputs that do not fit, argparse, KeyError
def test_bad_input_from_the_shell(factories, case):
    args, message = BAD[case]
    run = doctor(*args, path=factories)
    assert run.returncode == 2
    one_error_line(run.stderr, message)


def test_report_to_html_is_public_and_a_page_wraps_the_fragment():
    """The CLI's --html writes Report.to_html(page=True) (it once called the private _repr_html_)."""
    import torch

    from ampcourse.doctor import examine
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    report = examine(model, torch.randn(8, 4), torch.randint(0, 3, (8,)), loss_fn=torch.nn.functional.cross_entropy,
                     steps=0)
    fragment, page = report.to_html(), report.to_html(page=True)
    assert fragment == report._repr_html_() and "<html" not in fragment
    assert page.startswith("<!doctype html>") and fragment in page


def test_out_and_html_naming_one_file_is_refused_before_the_work(tmp_path):
    """The shared check of the CLIs' output files (_args.output_files): the HTML page overwrote the JSON report."""
    same = tmp_path / "report"
    run = doctor("--model", "mlp", "--out", str(same), "--html", str(same))
    assert run.returncode == 2 and "--out and --html name the same file" in run.stderr and not same.exists()
