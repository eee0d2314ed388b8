"""The package's shape rules (issue 9): no class over 300 lines, no function over 80, no import cycles."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "p2pweights"


def _trees():
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


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


def test_no_import_cycles_between_modules_at_import_time():
    trees = _trees()
    deps = {}
    for name, tree in trees.items():
        found = set()
        for node in tree.body:  # module level only: an import inside a function is deferred on purpose
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
        deps[name] = {d for d in found if d in trees and d != name}

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
