"""Every public module of ampcourse is on the package's map and in the README's package table."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import ampcourse

ROOT = Path(__file__).resolve().parents[2]
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


# --- ampcourse/widgets/ (issue 31): one file per explorer, the PNG encoder and the figure plumbing apart ------------
# Each file's floor: it imports only files of the package on lower floors (other ampcourse modules freely, within
# test_no_import_cycles). The four explorers share a floor, so none imports another.
WIDGETS_FLOORS = {
    "common": 0,  # _Guarded, STORED_HINT, parse_*, small formatters
    "png": 0,  # the PNG encoder: numpy and zlib only
    "figure": 1,  # _FigureImage (its PNGs from png)
    "bits": 2, "ranges": 2, "scaler": 2, "outlier": 2,  # the explorers of chapters 1, 6, 6 and 9
    "cli": 3,  # python -m ampcourse.widgets: benchmark, simulation_benchmark, main
    "__init__": 4, "__main__": 4,
}
WIDGETS = "ampcourse.widgets"


def _widgets_file(module: str) -> str | None:
    """'ampcourse.widgets.png' -> 'png', 'ampcourse.widgets' -> '__init__', anything else -> None."""
    if module == WIDGETS:
        return "__init__"
    return module.removeprefix(f"{WIDGETS}.") if module.startswith(f"{WIDGETS}.") else None


def test_the_widgets_package_keeps_its_floors():
    graph = _imports()
    files = {_widgets_file(m) for m in graph} - {None}
    assert files == set(WIDGETS_FLOORS), f"put every file of ampcourse/widgets/ on WIDGETS_FLOORS: {files ^ set(WIDGETS_FLOORS)}"
    for module, deps in graph.items():
        here = _widgets_file(module)
        if here is None:
            continue
        for dep in filter(None, map(_widgets_file, deps)):
            assert WIDGETS_FLOORS[dep] < WIDGETS_FLOORS[here], f"{module} imports {dep} (floor {WIDGETS_FLOORS[dep]}), " \
                                                               f"not below its own floor {WIDGETS_FLOORS[here]}"


@pytest.mark.parametrize("name", sorted(WIDGETS_FLOORS))
def test_each_widgets_file_says_which_chapter_it_serves_and_stays_small(name):
    import ast

    path = ROOT / "ampcourse" / "widgets" / f"{name}.py"
    text = path.read_text()
    first = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]  # read, not imported: __main__ would run
    assert re.search(r"\bchapters? \d", first), f"ampcourse/widgets/{name}.py's first paragraph names no chapter"
    assert len(text.splitlines()) <= 900, f"ampcourse/widgets/{name}.py has grown past 900 lines: split it"


def test_every_name_imported_from_the_widgets_package_is_there():
    """What chapters, tests, benchmarks and tools take from ampcourse.widgets (a `from ampcourse.widgets import`, or an
    attribute of `widgets` where they import the package) is still there: a move inside the package keeps old paths."""
    import json

    import ampcourse.widgets as widgets

    sources = {p: p.read_text() for d in ("tests", "benchmarks", "tools") for p in (ROOT / d).rglob("*.py")}
    for nb in (ROOT / "chapters").glob("*.ipynb"):
        sources[nb] = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"]
                                if c["cell_type"] == "code")
    used = {}
    for path, text in sources.items():
        for paren, line in re.findall(r"^\s*from ampcourse\.widgets import (?:\(([^)]*)\)|([^\n#]*))", text, flags=re.M):
            used.update((n.split()[0], path.name) for n in (paren or line).split(",") if n.strip())
        if re.search(r"^\s*(from ampcourse import .*\bwidgets\b|import ampcourse\.widgets as widgets)", text, flags=re.M):
            used.update((n, path.name) for n in re.findall(r"(?<![\w.])widgets\.(\w+)", text))
    assert {"format_explorer", "range_explorer", "scaler_simulator", "outlier_explorer", "_main"} <= set(used)
    missing = {n: f for n, f in used.items() if not hasattr(widgets, n)}
    assert not missing, f"ampcourse.widgets lacks names these files import: {missing}"


# What each part of ampcourse.trial may import of the others: monitors at the bottom, then the result, the runs, the
# command line; the package's __init__ gathers them. One concern per file, and no circle between them.
TRIAL_FLOORS = {
    "ampcourse.trial.monitors": set(),
    "ampcourse.trial.result": {"ampcourse.trial.monitors"},
    "ampcourse.trial.runs": {"ampcourse.trial.monitors", "ampcourse.trial.result"},
    "ampcourse.trial.cli": {"ampcourse.trial.result", "ampcourse.trial.runs"},
    "ampcourse.trial.__main__": {"ampcourse.trial.cli"},
    "ampcourse.trial": {"ampcourse.trial.cli", "ampcourse.trial.monitors", "ampcourse.trial.result",
                        "ampcourse.trial.runs"},
}


def test_the_trial_package_stacks_its_parts():
    graph = _imports()
    parts = {name for name in graph if name == "ampcourse.trial" or name.startswith("ampcourse.trial.")}
    assert parts == set(TRIAL_FLOORS), f"a part of ampcourse.trial is not on its floors: {parts ^ set(TRIAL_FLOORS)}"
    for name, floor in TRIAL_FLOORS.items():
        assert {d for d in graph[name] if d.startswith("ampcourse.trial")} == floor, name
        # the doctor confirms its recipes with a trial: nothing of the trial may import the doctor back
        assert not any(d.startswith("ampcourse.doctor") for d in graph[name]), name


@pytest.mark.parametrize("path", sorted((ROOT / "ampcourse" / "trial").glob("*.py")), ids=lambda p: p.name)
def test_each_part_of_the_trial_names_chapter_10_and_stays_a_room(path):
    """The package convention: a file's first docstring paragraph names its chapter; no file over 900 lines."""
    import ast

    text = path.read_text()
    first = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
    assert re.search(r"\bchapter 10\b", first), f"{path.name}: {first[:100]!r}"
    assert len(text.splitlines()) <= 900, f"{path.name} has {len(text.splitlines())} lines"
