"""Every public module of ampcourse is on the package's map and in the README's package table."""

import pkgutil
from pathlib import Path

import ampcourse

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.iter_modules(ampcourse.__path__) if not m.name.startswith("_"))


def test_every_module_is_on_the_lazy_map_and_in_the_docstring():
    assert set(MODULES) == set(ampcourse._SUBMODULES)
    listed = {line.split()[0] for line in ampcourse.__doc__.splitlines()[2:] if line.startswith("    ")}
    assert set(MODULES) <= listed, f"not in ampcourse/__init__.py's map: {set(MODULES) - listed}"


def test_every_module_is_in_the_readme_package_table():
    readme = (ROOT / "README.md").read_text()
    missing = [m for m in MODULES if f"| `ampcourse.{m}` |" not in readme]
    assert not missing, f"README's package table lacks {missing}"
