"""vitkit's imports form a tree: no circle between its packages (layers, models, checkpoints, lit, ...) or
between the modules inside one, counting every import statement, those inside functions included."""

import ast
from pathlib import Path

import vitkit

PACKAGE = Path(vitkit.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _target(name: str) -> str | None:
    """The vitkit module an imported name lives in (the longest module prefix), or None outside vitkit."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """Every vitkit module ``module`` imports, at the top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        out |= {t for t in map(_target, names) if t and t != module}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph``, as the nodes along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _room(module: str) -> str:
    """A package directly under vitkit (vitkit.models), a top-level module (vitkit.cli), or vitkit itself."""
    return ".".join(module.split(".")[:2])


def test_no_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        graph.setdefault(_room(module), set()).update(_room(t) for t in imports(module) if _room(t) != _room(module))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_circle_between_modules():
    graph = {module: imports(module) for module in MODULES}
    # a package's __init__ re-exports its modules; a module importing a sibling through the package is the same
    # edge as importing the sibling itself, so __init__ files stand for their package only as targets
    graph = {m: {t for t in targets if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
             for m, targets in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert imports("vitkit.models.vit") >= {"vitkit.layers", "vitkit.models.config"}


def test_every_module_imports():
    """Every module of the package imports on its own (the quick tier, `make test-fast`, reaches each one here)."""
    import importlib

    for name in sorted(MODULES):
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)


def test_no_task_imports_another_and_the_shared_base_imports_none():
    """A reader of one task (vitkit/tasks/<task>/) opens no other task's files; vitkit/training, which every task
    uses, and the data modules know no task."""
    def task(module: str) -> str | None:  # a task is a package under vitkit/tasks (protocol.py and registry.py: none)
        parts = module.split(".")
        is_package = len(parts) > 2 and (Path(vitkit.__file__).parent / "tasks" / parts[2]).is_dir()
        return parts[2] if is_package and parts[1] == "tasks" else None

    crossing = [f"{m} -> {t}" for m in MODULES for t in imports(m)
                if task(t) and (task(m) not in (None, task(t)) or _room(m) in ("vitkit.training", "vitkit.data"))]
    assert not crossing, crossing
    assert {task(m) for m in MODULES} >= {"classification", "pretraining", "text"}
