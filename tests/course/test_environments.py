"""pyproject.toml, requirements.lock, environment.yml and binder/ must describe one environment."""

import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    """The parsed pyproject.toml."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements(lines: list[str]) -> dict[str, Requirement]:
    """Requirement lines (no options, no comments) keyed by canonical name."""
    reqs = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in reqs}


def pinned(reqs: dict[str, Requirement]) -> dict[str, Version]:
    """name -> the exact version each requirement pins (fails on an unpinned one)."""
    out = {}
    for name, r in reqs.items():
        specs = list(r.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{name} is not pinned with ==: {r}"
        out[name] = Version(specs[0].version)
    return out


def lock() -> dict[str, Version]:
    """requirements.lock as name -> version."""
    lines = [ln for ln in (ROOT / "requirements.lock").read_text().splitlines() if ln and not ln.startswith("#")]
    return pinned(requirements(lines))


def project_reqs(*extras: str) -> dict[str, Requirement]:
    """pyproject's dependencies plus the named optional extras."""
    proj = pyproject()["project"]
    lines = list(proj["dependencies"])
    for e in extras:
        lines += proj["optional-dependencies"][e]
    return requirements(lines)


def conda_env() -> dict:
    """The parsed environment.yml."""
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def conda_pip() -> dict[str, Requirement]:
    """The pip section of environment.yml."""
    deps = conda_env()["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    return requirements([p for p in pip if not p.startswith("-")])


def binder_reqs() -> dict[str, Requirement]:
    """binder/requirements.txt without its index options."""
    lines = [ln.strip() for ln in (ROOT / "binder/requirements.txt").read_text().splitlines()]
    return requirements([ln for ln in lines if ln and not ln.startswith(("#", "-"))])


def without_local(v: Version) -> Version:
    """2.13.0+cpu -> 2.13.0."""
    return Version(v.public)


def test_lock_satisfies_pyproject_ranges():
    locked = lock()
    for name, req in project_reqs("lab", "test").items():
        assert name in locked, f"{name} is in pyproject.toml but not pinned in requirements.lock"
        assert req.specifier.contains(locked[name], prereleases=True), f"lock pins {name}=={locked[name]}, outside {req}"


def test_environment_yml_lists_exactly_the_project_dependencies_at_the_locked_versions():
    env = conda_pip()
    assert set(env) == set(project_reqs("lab", "test")), "environment.yml and pyproject.toml list different packages"
    locked = lock()
    for name, v in pinned(env).items():
        assert v == locked[name], f"environment.yml pins {name}=={v}, requirements.lock {locked[name]}"


def test_binder_lists_the_runtime_and_lab_dependencies_at_the_locked_versions():
    binder = binder_reqs()
    assert set(binder) == set(project_reqs("lab")), "binder/requirements.txt and pyproject.toml list different packages"
    locked = lock()
    for name, v in pinned(binder).items():
        assert without_local(v) == locked[name], f"binder pins {name}=={v}, requirements.lock {locked[name]}"


def test_binder_takes_cpu_torch_from_the_cpu_index():
    text = (ROOT / "binder/requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    assert pinned(binder_reqs())["torch"].local == "cpu", "binder must pin the +cpu build (the CUDA one is GBs)"


def test_python_version_agrees_everywhere():
    runtime = (ROOT / "binder/runtime.txt").read_text().strip()
    m = re.fullmatch(r"python-(\d+\.\d+)", runtime)
    assert m, f"binder/runtime.txt should read python-X.Y, not {runtime!r}"
    conda_py = next(d for d in conda_env()["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert conda_py == f"python={m.group(1)}"
    assert SpecifierSet(pyproject()["project"]["requires-python"]).contains(f"{m.group(1)}.0")


def test_binder_postbuild_fails_fast_and_installs_the_package():
    post = (ROOT / "binder/postBuild").read_text()
    assert "set -e" in post and "pip install --no-deps -e ." in post


@pytest.mark.parametrize("path", ["pyproject.toml", "environment.yml", "binder/requirements.txt", "requirements.lock"])
def test_no_deprecated_or_cuda_only_names(path):
    text = (ROOT / path).read_text()
    assert "apex" not in text and "nvidia-" not in text


# --- binder/: a valid repo2docker (mybinder.org) configuration ----------------------------------
# With a binder/ folder repo2docker reads only the files in it (the root environment.yml and
# pyproject.toml are ignored). requirements.txt + runtime.txt + postBuild selects the Python
# buildpack: Python from runtime.txt, one environment for JupyterLab and the kernel,
# `pip install -r requirements.txt` into it, then postBuild.
BINDER_FILES = {"requirements.txt", "runtime.txt", "postBuild"}
# Files that would switch repo2docker to another buildpack (and make it ignore requirements.txt).
OTHER_BUILDPACKS = {"environment.yml", "Pipfile", "Pipfile.lock", "setup.py", "pyproject.toml", "Project.toml",
                    "install.R", "DESCRIPTION", "default.nix", "Dockerfile", "apt.txt", "start"}


def test_every_binder_file_is_one_this_module_checks():
    present = {p.name for p in (ROOT / "binder").iterdir()}
    assert present == BINDER_FILES, (
        f"binder/ holds {sorted(present)}; this module checks {sorted(BINDER_FILES)}: add a check for "
        f"any new file (and keep it out of {sorted(OTHER_BUILDPACKS)}, which change the buildpack)")
    assert not present & OTHER_BUILDPACKS


def test_binder_postbuild_is_executable_and_needs_no_extension_step():
    post = ROOT / "binder/postBuild"
    assert post.read_text().startswith("#!/bin/bash\n"), "repo2docker runs postBuild as a program: it needs a shebang"
    assert os.access(post, os.X_OK), "postBuild must be executable (git update-index --chmod=+x binder/postBuild)"
    text = post.read_text()
    assert "labextension install" not in text and "jupyter lab build" not in text, \
        "ipywidgets 8 needs no extension build: jupyterlab_widgets is prebuilt"
    assert "@jupyter-widgets/jupyterlab-manager" in text, "postBuild should fail the build if widgets cannot render"


def test_binder_widgets_render_without_an_extension_step():
    """ipywidgets 8 (whose jupyterlab_widgets ships the prebuilt extension) and JupyterLab 4 are what binder installs."""
    binder = pinned(binder_reqs())
    assert binder["ipywidgets"].major == 8 and binder["jupyterlab"].major == 4
    assert lock()["jupyterlab-widgets"].major == 3, "ipywidgets 8 pairs with jupyterlab_widgets 3"


def test_binder_requirements_have_no_local_references():
    """A `-e .` in requirements.txt would defeat repo2docker's caching; postBuild installs the package."""
    lines = (ROOT / "binder/requirements.txt").read_text().splitlines()
    assert not [ln for ln in lines if ln.strip() in (".", "-e .") or ln.strip().startswith(("-e", "file:"))]


# --- the supported torch range: one declaration, stated the same everywhere -------------------------------

def torch_tested() -> list[str]:
    """pyproject's [tool.ampcourse] torch-tested, oldest first."""
    return pyproject()["tool"]["ampcourse"]["torch-tested"]


def minor(v: str) -> str:
    """'2.11.0' -> '2.11'."""
    return ".".join(v.split(".")[:2])


def test_the_declared_floor_is_the_oldest_tested_torch_and_the_lock_is_tested():
    tested = torch_tested()
    assert tested == sorted(tested, key=Version), "torch-tested must be oldest first"
    floor = project_reqs()["torch"].specifier
    assert str(floor) == f">={minor(tested[0])}", f"pyproject's torch{floor} should be the oldest tested, {tested[0]}"
    assert str(lock()["torch"]) in tested, "the lock's torch must be one of torch-tested"
    for v in tested:
        assert floor.contains(v), v


def test_each_tested_torch_has_a_torchao_within_pyprojects_range():
    cfg = pyproject()["tool"]["ampcourse"]
    pairs = cfg["torchao-for-torch"]
    assert set(pairs) == set(torch_tested())
    torchao = project_reqs()["torchao"].specifier
    assert all(torchao.contains(v) for v in pairs.values()), f"torchao{torchao} excludes one of {pairs}"
    assert pairs[str(lock()["torch"])] == str(lock()["torchao"]), "the lock's torch must get the lock's torchao"
    low = min(pairs.values(), key=Version)
    assert str(torchao) == f">={minor(low)}", f"torchao's floor should be the floor torch's torchao, {low}"


def test_the_environment_check_warns_outside_the_declared_range(monkeypatch):
    from ampcourse import device
    tested = torch_tested()
    assert device.TORCH_RANGE == (minor(tested[0]), minor(tested[-1]))
    amp = device.pick("cpu")
    for version, inside in [(tested[0], True), (tested[-1] + "+cu130", True), ("2.10.1", False),
                            ("2.16.0", False), ("3.0.0", False)]:
        monkeypatch.setattr(device.torch, "__version__", version)
        line = amp.summary()
        assert ("outside the course's tested range" in line) is not inside, (version, line)
        if not inside:
            assert f"torch {version}" in line and "2.11 to 2.15" in line.replace(device.TORCH_RANGE[0], "2.11")
    monkeypatch.setattr(device.torch, "__version__", "2.9.1")
    assert "install a newer torch" in amp.summary()


def test_every_file_that_states_the_range_states_the_declared_one():
    low, high = (minor(v) for v in (torch_tested()[0], torch_tested()[-1]))
    statement = f"{low} to {high}"
    for path in ["README.md", "environment.yml", "binder/requirements.txt"]:
        text = (ROOT / path).read_text()
        assert statement in text, f"{path} should state the supported torch range as '{statement}'"
        assert not re.search(r"torch\s*>=\s*2\.(?!%s\b)\d+" % low.split(".")[1], text), f"{path} states another floor"
    readme = (ROOT / "README.md").read_text()
    assert f"torch>={low}" in readme and f"tools/torch_leg.sh {torch_tested()[0]}" in readme
    assert f"tools/torch_leg.sh {torch_tested()[-1]}" in readme


def test_ci_runs_the_floor_and_the_newest_torch_through_the_leg_script():
    tested = torch_tested()
    flow = yaml.safe_load((ROOT / ".github/workflows/torch-matrix.yml").read_text())
    job = flow["jobs"]["torch"]
    assert job["strategy"]["matrix"]["torch"] == [tested[0], tested[-1]]
    assert any("tools/torch_leg.sh" in step.get("run", "") for step in job["steps"])
    run = (ROOT / ".ci/run").read_text()
    assert "make test" in run and "tools/torch_leg.sh" in run and "torch-tested" in run
    code = [line.strip() for line in run.splitlines() if not line.lstrip().startswith("#")]
    at = {what: next(i for i, line in enumerate(code) if line.startswith(what))
          for what in ("make test ||", 'tools/torch_leg.sh --install-only', 'tools/torch_leg.sh "$torch_version" ||')}
    # the legs' venvs build beside make test; the legs' tests run after it (the lock's torch first)
    assert at['tools/torch_leg.sh --install-only'] < at["make test ||"] < at['tools/torch_leg.sh "$torch_version" ||']
    assert "wait" in " ".join(code[at["make test ||"]:at['tools/torch_leg.sh "$torch_version" ||']])
    leg = (ROOT / "tools/torch_leg.sh").read_text()
    for what in ["--nbval-lax", "not slow", "test_browser.py", "test_student.py", "test_make_lab.py",
                 "torchao-for-torch", "requirements.lock", "import"]:
        assert what in leg, f"tools/torch_leg.sh should mention {what!r}"
    assert os.access(ROOT / "tools/torch_leg.sh", os.X_OK) and os.access(ROOT / ".ci/run", os.X_OK)


def test_the_leg_scripts_install_only_builds_or_reuses_the_venv_and_runs_nothing_else(tmp_path):
    import hashlib
    import subprocess
    torch = torch_tested()[0]
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ampcourse"]
    digest = "".join(f"{hashlib.sha256((ROOT / f).read_bytes()).hexdigest()}  {f}\n"
                     for f in ("requirements.lock", "pyproject.toml"))
    want = (f"torch=={torch} torchao=={cfg['torchao-for-torch'][torch]} "
            f"lock={hashlib.sha256(digest.encode()).hexdigest()[:16]}")
    venv = tmp_path / f"torch-{torch}"
    venv.mkdir()
    (venv / ".leg").write_text(want + "\n")  # a built venv (its python absent: a leg past install would say so)
    out = subprocess.run(["bash", "tools/torch_leg.sh", "--install-only", torch], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "TORCH_LEG_CACHE": str(tmp_path)}, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"reusing {venv}" in out.stdout and "install" in out.stdout
    assert "import check" not in out.stdout and "no environment" not in out.stderr


def test_the_leg_script_refuses_an_untested_torch():
    import subprocess
    out = subprocess.run(["bash", str(ROOT / "tools/torch_leg.sh"), "2.6.0"], capture_output=True, text=True,
                         env={**os.environ, "TORCH_LEG_CACHE": "/nonexistent/never-created"})
    assert out.returncode == 2 and "not in pyproject.toml's [tool.ampcourse] torch-tested" in out.stderr


#: What a test module must not touch at import time: optional packages and dtypes newer than the floor torch
#: (2.7+ e8m0 and 2.8+ fp4 exist on 2.11, but the rule keeps an old torch from turning a module into one
#: collection error that hides every other result; issue 19).
VERSION_SPECIFIC = {"modules": ("torchao",), "attributes": ("float4_e2m1fn_x2", "float8_e8m0fnu")}


def module_level_uses(tree) -> list[str]:
    """Imports of VERSION_SPECIFIC modules and reads of its attributes outside any function or class body."""
    import ast
    found = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"line {node.lineno}: import {n}" for n in names
                      if n.split(".")[0] in VERSION_SPECIFIC["modules"]]
            if isinstance(node, ast.Attribute) and node.attr in VERSION_SPECIFIC["attributes"]:
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_test_module_imports_version_specific_things_at_module_level():
    import ast
    bad = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        uses = module_level_uses(ast.parse(path.read_text(), str(path)))
        if uses:
            bad[str(path.relative_to(ROOT))] = uses
    assert not bad, f"import these inside the tests that need them (skip with the version when absent): {bad}"


def test_the_module_level_check_finds_what_it_looks_for():
    import ast
    caught = module_level_uses(ast.parse("import torch\nwith x():\n    from torchao.float8 import A\n"
                                         "D = {'a': torch.float4_e2m1fn_x2}\n"
                                         "def f():\n    import torchao\n    return torch.float8_e8m0fnu\n"))
    assert caught == ["line 3: import torchao.float8", "line 4: .float4_e2m1fn_x2"]
