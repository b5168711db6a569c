"""The command-line front doors agree (audit /tmp/audit2/frontdoor): --help states pick()'s real default and every
other default, one reader of precision names, flags (not Python argument names) in errors, aliases for the names
that differ between CLIs, trial's --model package.module:factory, checkpoint files as open() would make them, and
``python -m ampcourse <tool>``. torch 2.13 CPU; nothing here needs a GPU (the CUDA cases are the refusals)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampcourse import _args, bench, checkpoint, device
from ampcourse.checkpoint import saving
from ampcourse.doctor import cli as doctor_cli
from ampcourse.train import cli as train_cli
from ampcourse.trial import cli as trial_cli
from clirun import run_cli

ROOT = Path(__file__).resolve().parents[1]
PARSERS = {"train": lambda: train_cli._parser(), "trial": lambda: trial_cli._parser(),
           "doctor": lambda: doctor_cli._parser(), "bench": lambda: bench._parser()}
TINY_TRAIN = ["--steps", "1", "--samples", "32", "--global-batch-size", "32", "--no-progress"]


def _flat(text: str) -> str:
    return " ".join(text.split())


# 1. --help says pick()'s rule, from device.py's one description of it

def test_train_help_states_picks_rule_not_bf16_on_every_cpu(monkeypatch):
    monkeypatch.setenv(device.CPU_FLAGS_ENV, "sse4_2 avx avx2 fma")  # an AVX2-only CPU, as the audit's
    assert device.pick("cpu").precision == "fp32" and "fp32 on other CPUs" in device.default_rule()
    monkeypatch.setenv(device.CPU_FLAGS_ENV, "avx2 avx512_bf16")
    assert device.pick("cpu").precision == "bf16" and "AVX512-BF16" in device.default_rule()
    text = _flat(train_cli._parser().format_help())
    assert device.default_rule() in text and "bf16 on CPU and" not in text
    assert device.amp_rule() in _flat(bench._parser().format_help())  # the benchmark's default is the AMP dtype


# 2. one reader of precision names, one error

@pytest.mark.parametrize("spelling,want", [("BF16", "bf16"), ("half", "fp16"), ("float32", "fp32")])
def test_train_takes_every_spelling_pick_takes(spelling, want, capsys):
    assert device.pick("cpu", spelling).precision == want
    assert train_cli.main([*TINY_TRAIN, "--precision", spelling]) == 0
    assert f'"precision": "{want}"' in capsys.readouterr().out


def test_an_unknown_precision_is_the_same_line_in_every_cli(tmp_path):
    tail = re.compile(r"precisions?: unknown precision 'fp64'; choose from [a-z0-9, -]+ "
                      r"\(dtype names such as 'bfloat16' work too\)")
    for main, argv in [(train_cli.main, [*TINY_TRAIN, "--precision", "fp64"]),
                       (bench.main, ["--out", str(tmp_path / "b"), "--precision", "fp64"]),
                       (trial_cli.main, ["--model", "mlp", "--precisions", "fp64", "--steps", "1"]),
                       (doctor_cli.main, ["--model", "mlp", "--precisions", "fp64", "--steps", "0"])]:
        code, err = run_cli(main, argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and tail.search(err), err
        assert ": error: --precision" in err, err  # the flag, not the Python argument
    code, err = run_cli(bench.main, ["--out", str(tmp_path / "b"), "--precision", "fp61"])
    assert code == 2 and "choose from fp16, bf16 " in err  # fp32 is not offered: the benchmark refuses it
    code, err = run_cli(bench.main, ["--out", str(tmp_path / "b"), "--precision", "FP32"])
    assert code == 2 and "fp32 is always measured, as the baseline" in err and "precision='" not in err


# 3. checkpoint.load on the run directory says which file

def test_loading_the_run_directory_names_the_file(tmp_path):
    run = tmp_path / "run a"
    run.mkdir()
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(run)
    assert "it is a directory; give a file path such as" in str(info.value)
    assert repr(str(run / checkpoint.FILENAME)) in str(info.value)


# 4. flags, not Python argument names; the device as given

@pytest.mark.parametrize("main,argv", [
    (train_cli.main, [*TINY_TRAIN, "--device", "cuda:7"]),
    (trial_cli.main, ["--model", "mlp", "--steps", "1", "--device", "cuda:7"]),
    (doctor_cli.main, ["--model", "mlp", "--steps", "0", "--device", "cuda:7"]),
])
def test_a_missing_gpu_is_named_as_given_with_advice_for_a_shell(main, argv, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run_cli(main, argv)
    assert code == 2 and "'cuda:7'" in err and "leave --device out" in err and "device=None" not in err, err


@pytest.mark.parametrize("argv,flag", [(["--steps", "0"], "--steps must"), (["--batch-size", "0"], "--batch-size must"),
                                       (["--lr", "-1"], "--lr must"), (["--tolerance", "0"], "--tolerance must")])
def test_trial_names_its_flags(argv, flag):
    code, err = run_cli(trial_cli.main, ["--model", "mlp", *argv])
    assert code == 2 and f"error: {flag}" in err, err


def test_as_flags_renames_argument_names_not_prose():
    flags = {**_args.COMMON_FLAGS, "resume": "--resume"}
    assert _args.as_flags("steps must be an int >= 1, got 0") == "--steps must be an int >= 1, got 0"
    assert _args.as_flags("pass precision='fp16' or 'bf16'") == "pass --precision fp16 or 'bf16'"
    assert _args.as_flags("resume=True needs a checkpoint", flags) == "--resume needs a checkpoint"
    assert _args.as_flags("seed=None in the checkpoint, 3 now") == "no --seed in the checkpoint, 3 now"
    assert _args.as_flags("the steps of the first run differ") == "the steps of the first run differ"


# 5. every default in --help; the other CLIs' names as aliases; trial's package.module:factory

@pytest.mark.parametrize("tool", PARSERS)
def test_help_states_every_default(tool):
    parser = PARSERS[tool]()
    formatter = parser._get_formatter()
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and not a.required
               and not isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction))
               and "default" not in formatter._format_action(a).lower()]
    assert not missing, f"{tool} --help gives no default for {missing}"


def test_the_other_clis_names_are_aliases():
    train = train_cli._parser()
    for flag in ("--global-batch-size", "--batch-size", "--batch"):
        assert train.parse_args([flag, "16"]).global_batch_size == 16
    assert train.parse_args(["--precisions", "bf16"]).precision == "bf16"
    trial = trial_cli._parser()
    for flag in ("--batch-size", "--batch", "--global-batch-size"):
        assert trial.parse_args(["--model", "mlp", flag, "8"]).batch_size == 8
    assert trial.parse_args(["--model", "mlp", "--precision", "fp16"]).precisions == "fp16"
    doctor = doctor_cli._parser()
    for flag in ("--batch", "--batch-size", "--global-batch-size"):
        assert doctor.parse_args(["--model", "mlp", flag, "8"]).batch == 8
    assert bench._parser().parse_args(["--out", "x", "--precisions", "bf16"]).precision == "bf16"
    from ampcourse.plan import cli as plan_cli

    plan = plan_cli._parser()
    for flag in ("--batch", "--batch-size", "--global-batch-size"):
        assert plan.parse_args(["--model", "mlp", flag, "8"]).batch == 8
    assert plan.parse_args(["--model", "mlp", "--precision", "bf16"]).precisions == "bf16"


def test_trial_takes_a_factory_as_the_doctor_does(tmp_path, monkeypatch, capsys):
    (tmp_path / "trial_factories.py").write_text(textwrap.dedent("""
        import torch
        def make():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
            return model, torch.randn(12, 8), torch.randint(0, 3, (12,)), torch.nn.functional.cross_entropy
        def make_sgd():
            model, x, y, loss = make()
            return model, x, y, loss, torch.optim.SGD(model.parameters(), lr=0.05)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("trial_factories:make", "trial_factories:make_sgd"):
        assert trial_cli.main(["--model", spec, "--steps", "2", "--no-progress"]) == 0
        assert "trial: 2 steps" in capsys.readouterr().out
    code, err = run_cli(trial_cli.main, ["--model", "trial_factories:nothing", "--steps", "2"])
    assert code == 2 and "has no attribute 'nothing'" in err


# 6. checkpoints get the mode a plain open() would give

def test_checkpoint_files_follow_the_umask(tmp_path):
    model = torch.nn.Linear(2, 2)
    state = checkpoint.capture(0, model, torch.optim.SGD(model.parameters(), lr=0.1),
                               torch.amp.GradScaler("cpu", enabled=False))
    old = os.umask(0o027)
    try:
        assert os.stat(checkpoint.save(state, tmp_path / "a.pt")).st_mode & 0o777 == 0o640
        assert os.stat(saving.replace_atomically(tmp_path / "latest", b"x\n")).st_mode & 0o777 == 0o640
        os.umask(0o022)
        assert os.stat(saving.replace_atomically(tmp_path / "new", b"x\n")).st_mode & 0o777 == 0o644
        os.chmod(tmp_path / "latest", 0o600)  # an existing file keeps its mode, as open(..., "wb") keeps it
        assert os.stat(saving.replace_atomically(tmp_path / "latest", b"y\n")).st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


# 7. python -m ampcourse <tool>

def _module(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "ampcourse", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_one_front_door_lists_and_runs_every_tool():
    from ampcourse.__main__ import TOOLS
    assert list(TOOLS) == ["train", "doctor", "trial", "plan", "widgets", "bench"]
    shown = _module("--help")
    assert shown.returncode == 0 and all(re.search(rf"^  {t} +\S", shown.stdout, re.M) for t in TOOLS), shown
    bad = _module("trian")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "ampcourse: error: unknown tool 'trian'; choose one of train, doctor, trial, plan, widgets, bench "
        "(python -m ampcourse --help)"]
    ran = _module("train", "--steps", "0")  # the tool's own line and exit status
    assert ran.returncode == 2 and ran.stderr.strip() == "ampcourse.train: error: --steps must be an int >= 1, got 0"
    helped = _module("doctor", "--help")
    assert helped.returncode == 0 and "python -m ampcourse.doctor" in helped.stdout
