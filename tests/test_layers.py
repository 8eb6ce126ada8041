"""The package's layers: imports point down only, no import circle, no module name in two layers."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

LWM = Path(__file__).resolve().parents[1] / "lwm"
# bottom to top; a module may import its own layer's and the layers below
LAYERS = ("utils", "modules", "data", "training", "inference", "callbacks", "play", "cli")
SIDE_BY_SIDE = {frozenset(("callbacks", "play"))}  # neither imports the other
OLD_PATHS: set[str] = set()  # none: every module lives in its layer


def _modules() -> dict[str, Path]:
    out = {}
    for path in LWM.rglob("*.py"):
        parts = path.relative_to(LWM.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """``(imported lwm module, inside a function)`` for every import in the file."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.split(".")[0] == "lwm")
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "lwm":
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    found.append((full if full in modules else child.module, in_function))
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return [(target, inside) for target, inside in found if target != name]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {t for t, _ in _imports(name, path, modules)} for name, path in modules.items()}


def test_imports_point_down_only():
    wrong = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if here is None or there is None or here == there:
                continue
            if LAYERS.index(there) > LAYERS.index(here) or frozenset((here, there)) in SIDE_BY_SIDE:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_no_import_circle():
    """Among every import, at the top of a file or inside a function (Tarjan's strongly connected components)."""
    graph = _graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not circles, circles


def test_imports_inside_functions_are_of_heavy_optional_libraries_only():
    """lwm's own modules are imported at the top of a file; the exceptions keep `lwm --help` and the light verbs
    from importing Lightning or torch (the dispatcher's verbs) or an optional extra."""
    allowed = {"lwm.cli.main", "lwm.data.codecs", "lwm.data.h5", "lwm.data.convert", "lwm.data.atari"}
    modules = _modules()
    inside = sorted({name for name, path in modules.items() for _, in_function in _imports(name, path, modules)
                     if in_function} - allowed)
    assert not inside, inside


def test_no_module_name_in_two_layers():
    names = Counter(path.stem for path in LWM.rglob("*.py")
                    if path.stem not in ("__init__", "__main__") and path.parent != LWM)
    twice = sorted(name for name, n in names.items() if n > 1)
    assert not twice, twice
    top = sorted(path.stem for path in LWM.glob("*.py") if path.stem not in ("__init__", "__main__"))
    assert set(top) <= OLD_PATHS, top
