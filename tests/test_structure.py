"""The package's shape rules: no class over 300 lines, no function over 80, no import cycles, and
imports flowing one way down the layers."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "p2pweights"

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    {"errors", "failpoints"},
    {"wire"},
    {"sources"},
    {"storage"},
    {"swarm"},
    {"api", "origin"},
    {"loaders", "hf"},
    {"cli", "ops", "demo", "agent", "__main__"},
)
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _name(path: Path) -> str:
    """Dotted module name under the package: ``swarm.node``, ``failpoints``, ``api``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees():
    return {_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, tree, module_level: bool):
    """Dotted names under the package that module ``name`` imports (relative imports only)."""
    package = name.split(".") if name in _packages() else name.split(".")[:-1]
    nodes = tree.body if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            mod = [*base, *(node.module.split(".") if node.module else [])]
            if node.module:
                yield ".".join(mod)
            else:
                yield from (".".join([*mod, a.name]) for a in node.names)


def _packages():
    return {_name(p) for p in PACKAGE.rglob("__init__.py")}


def test_no_class_over_300_lines_and_no_function_over_80():
    long = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > 300:
                long.append(f"class {name}.{node.name}: {size} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                long.append(f"function {name}.{node.name}: {size} lines")
    assert not long, long


def test_every_module_sits_in_a_layer():
    unplaced = sorted(n for n in _trees() if n and n.split(".")[0] not in RANK)
    assert not unplaced, f"modules in no layer of tests/test_structure.py: {unplaced}"


def test_imports_flow_down_the_layers():
    upward = []
    for name, tree in _trees().items():
        if not name:
            continue  # the package's own __init__ re-exports lazily, by name
        for target in _imports(name, tree, module_level=False):
            top = target.split(".")[0]
            if top in RANK and RANK[top] > RANK[name.split(".")[0]]:
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_no_import_cycles_between_modules_at_import_time():
    trees = _trees()
    deps = {}
    for name, tree in trees.items():
        found = {t if t in trees else t.rsplit(".", 1)[0] for t in _imports(name, tree, module_level=True)}
        deps[name] = {d for d in found if d in trees and d != name and not name.startswith(d + ".")}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            mod, path = stack.pop()
            for d in deps[mod]:
                if d == start:
                    return path + [d]
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))
        return None

    cycles = [c for c in map(cycle_from, sorted(deps)) if c]
    assert not cycles, cycles
