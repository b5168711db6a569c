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

ROOT = Path(__file__).resolve().parents[1]


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
