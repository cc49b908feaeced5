"""The house's floors: plumbing/ is what the teaching scripts stand on, so no plumbing module
imports a teaching script (nor tasks/, bench/, experiments/ or integrations/), at the top or inside
a function. And no circle among the experiments' modules: each one is also a script, and a module
that imports the script importing it runs half-initialised."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {p.stem for p in ROOT.glob("*.py")}            # train, eval, rollout, retriever, data, llds
ABOVE = SCRIPTS | {"tasks", "bench", "integrations", "experiments"}   # what stands on plumbing/
PLUMBING = sorted((ROOT / "plumbing").glob("*.py"))
EXPERIMENTS = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
               for p in sorted((ROOT / "experiments").rglob("*.py"))}     # dotted name -> file


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, wherever the import statement is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def imported_dotted(path: Path) -> set[str]:
    """The full dotted names `path` imports, wherever the statement is; `from a.b import c` gives
    both a.b and a.b.c (c may be a module). The experiments run as scripts: no relative imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> the modules it imports) as [a, b, ..., a], or None."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        found = next((c for c in map(visit, sorted(graph.get(node, ()))) if c), None)
        path.pop()
        done.add(node)
        return found

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_no_two_experiment_modules_import_each_other():
    graph = {name: imported_dotted(path) & EXPERIMENTS.keys() for name, path in EXPERIMENTS.items()}
    assert import_cycle(graph) is None, \
        f"import circle {' -> '.join(import_cycle(graph))}: move what both need into one module"


def test_the_cycle_finder_sees_circles(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from experiments.lab.lab import X\n\n"
                      "def f():\n    from experiments.lab import lab_study\n")
    assert imported_dotted(module) == {"experiments.lab.lab", "experiments.lab.lab.X",
                                       "experiments.lab", "experiments.lab.lab_study"}
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": {"b"}}) == ["b", "b"]


def test_the_scripts_are_the_ones_the_house_is_built_for():
    assert {"train", "eval", "rollout", "retriever", "data", "llds"} <= SCRIPTS
    assert len(PLUMBING) > 10


@pytest.mark.parametrize("path", PLUMBING, ids=lambda p: p.name)
def test_plumbing_imports_no_teaching_script(path):
    assert not imported_modules(path) & ABOVE, \
        f"plumbing/{path.name} imports a teaching script: pass what it needs as an argument instead"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from eval import evaluate\n    import rollout as r\n")
    assert imported_modules(module) == {"os", "eval", "rollout"}


def test_retriever_serve_loads_retriever_once():
    # python retriever.py serve used to load retriever.py twice: as __main__ and, through
    # plumbing/server.py, as `retriever`.
    code = ("import runpy, sys; sys.argv = ['retriever.py', '--help']\n"
            "try:\n    runpy.run_path('retriever.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('retriever' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
