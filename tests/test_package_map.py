"""Every public module of ampcourse is on the package's map and in the README's package table."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

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


def _imports() -> dict[str, set[str]]:
    """Every ampcourse module (file) and the ampcourse modules it imports, at module level or inside a function
    (not those under ``if TYPE_CHECKING:``, which never run)."""
    import ast

    pkg = ROOT / "ampcourse"
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in pkg.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        tree = ast.parse(path.read_text())
        # imports under `if TYPE_CHECKING:` never run (annotations only): they make no floor and no cycle
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                for alias in node.names:
                    deps.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in names else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in names and d != name and d != "ampcourse"}
    return graph


def test_no_import_cycles():
    """The package stays a stack of floors: following imports (lazy ones included) never comes back to a module."""
    graph, state = _imports(), {}

    def visit(node, path):
        state[node] = "open"
        for dep in graph[node]:
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, node, dep])}"
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_checkpoint_and_the_scaler_settings_do_not_climb():
    """checkpoint is imported by distributed and train, never the other way; GradScaler's settings owner sits lowest."""
    graph = _imports()
    for name, deps in graph.items():
        if name.startswith("ampcourse.checkpoint"):
            climbing = {d for d in deps if not d.startswith(("ampcourse.checkpoint", "ampcourse._args", "ampcourse._scaler"))}
            assert not climbing, f"{name} imports {sorted(climbing)}"
    assert graph["ampcourse._scaler"] == {"ampcourse._args"}


#: ampcourse.doctor's passes, split along their sections (issue 31): each file imports only the floors below it
#: (and the histograms); the module hooks and the op watcher call each other, so they share one floor (watch).
DOCTOR_FLOORS = {
    "ampcourse.doctor.calls": set(),
    "ampcourse.doctor.snapshot": set(),
    "ampcourse.doctor.watch": {"ampcourse.doctor.calls"},
    "ampcourse.doctor.passes": {"ampcourse.doctor.calls", "ampcourse.doctor.snapshot", "ampcourse.doctor.watch"},
}


def test_the_doctors_passes_are_a_stack_of_floors():
    graph = _imports()
    for name, below in DOCTOR_FLOORS.items():
        climbing = {d for d in graph[name] if d.startswith("ampcourse.doctor.") and d not in below
                    and d != "ampcourse.doctor.hist"}
        assert not climbing, f"{name} imports {sorted(climbing)}"
    assert "ampcourse.doctor.capture" not in graph  # split into the four above: nothing imports it


def test_no_doctor_file_passes_900_lines():
    long = {p.name: n for p in (ROOT / "ampcourse" / "doctor").glob("*.py")
            if (n := p.read_text().count("\n")) > 900}
    assert not long, f"split these along their sections: {long}"


CONCEPT_MODULES = ("formats", "fp8", "policy", "memory", "autocast_ops", "device", "models", "scaling", "bench", "plots",
                   "optim", "reduce_sim", "emulate", "trial", "course", "distributed")


@pytest.mark.parametrize("name", CONCEPT_MODULES)
def test_each_concept_module_says_which_chapter_teaches_it(name):
    """As d2l's library does: a module's first docstring sentence names the chapter(s) that teach it."""
    doc = importlib.import_module(f"ampcourse.{name}").__doc__ or ""
    first = doc.strip().split("\n\n")[0]
    assert re.search(r"\bchapters? \d", first), f"ampcourse.{name}'s first paragraph names no chapter: {first[:100]!r}"
