"""The package's shape rules: no class over 300 lines, no function over 80, no import circle anywhere (lazy
imports included), and imports flowing one way down the layers, inside the swarm's rooms too."""
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
    {"library", "api", "origin"},
    {"loaders", "hf"},
    {"ops", "demo", "agent"},
    {"cli", "__main__"},
)
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}

# The swarm's rooms, bottom to top (``swarm.simulate`` sits above them all).
ROOMS = ("policy", "tracker", "node", "simulate")
# What a pure room never imports: the standard library's and ZeroMQ's I/O.
IO_MODULES = {"zmq", "socket", "_socket", "select", "selectors", "threading", "subprocess", "os", "mmap", "io",
              "shutil", "asyncio", "multiprocessing"}
PURE_ROOMS = ("swarm.policy",)


def _name(path: Path) -> str:
    """Dotted module name under the package: ``swarm.node.node``, ``failpoints``, ``api``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees():
    return {_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _packages():
    return {_name(p) for p in PACKAGE.rglob("__init__.py")}


def _imports(name: str, tree, module_level: bool, packages=None):
    """Dotted names under the package that module ``name`` imports (relative imports only); for ``from X import
    y`` both ``X`` and ``X.y`` (which of them is a module is the caller's to tell)."""
    packages = _packages() if packages is None else packages
    package = name.split(".") if name in packages else name.split(".")[:-1]
    nodes = tree.body if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            mod = [*base, *(node.module.split(".") if node.module else [])]
            if node.module:
                yield ".".join(mod)
            yield from (".".join([*mod, a.name]) for a in node.names)


def _absolute_imports(tree):
    """Top-level names of the modules ``tree`` imports absolutely (``import zmq``, ``from os import path``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.split(".")[0]


def _graph(trees, module_level: bool) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's ``__init__`` counts as a module; a name imported
    from a module is that module)."""
    packages = _packages()
    deps = {}
    for name, tree in trees.items():
        found = set()
        for t in _imports(name, tree, module_level, packages):
            if t in trees:
                found.add(t)
            elif t.rsplit(".", 1)[0] in trees:
                found.add(t.rsplit(".", 1)[0])
        deps[name] = {d for d in found if d != name and not name.startswith(d + ".")}
    return deps


def circles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``deps``: each strongly connected set of two or more modules (Tarjan's)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(deps.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


def _room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "swarm" and parts[1] in ROOMS else None


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
    swarm = sorted(n for n in _trees() if n.startswith("swarm.") and _room(n) is None)
    assert not swarm, f"swarm modules in no room ({', '.join(ROOMS)}): {swarm}"


def upward_imports(trees) -> list[str]:
    """Imports that go up the layers, or up the swarm's rooms."""
    upward = []
    for name, targets in _graph(trees, module_level=False).items():
        if not name:
            continue  # the package's own __init__ re-exports lazily, by name
        for target in sorted(targets):
            top = target.split(".")[0]
            if top in RANK and RANK[top] > RANK[name.split(".")[0]]:
                upward.append(f"{name} imports {target}")
            mine, theirs = _room(name), _room(target)
            if mine and theirs and ROOMS.index(theirs) > ROOMS.index(mine):
                upward.append(f"{name} imports {target} (room {theirs} is above {mine})")
    return upward


def impure_imports(trees) -> list[str]:
    """I/O modules that a pure room's modules import."""
    return [f"{name} imports {m}" for name, tree in trees.items() if name.startswith(PURE_ROOMS)
            for m in sorted(set(_absolute_imports(tree)) & IO_MODULES)]


def test_imports_flow_down_the_layers_and_the_rooms():
    assert not upward_imports(_trees())


def test_pure_policy_imports_no_io():
    assert not impure_imports(_trees())


def test_no_import_circle_anywhere_lazy_imports_included():
    assert not circles(_graph(_trees(), module_level=False))


def test_each_check_fails_on_a_planted_violation():
    """The checks above catch what they are for: a circle through a lazy import, an upward import inside the
    swarm, an I/O import in the pure policy."""
    trees = _trees()
    planted = dict(trees)
    planted["storage.sizes"] = ast.parse(trees["storage.sizes"]) if "storage.sizes" in trees else ast.parse("")
    planted["storage.sizes"].body.append(ast.parse("def f():\n    from .store import memory_budget\n").body[0])
    assert any("storage.sizes" in c and "storage.store" in c for c in circles(_graph(planted, module_level=False)))
    up = dict(trees)
    up["swarm.policy.serve"] = ast.parse("from ..node.node import Node\n")
    assert any("room node is above policy" in u for u in upward_imports(up))
    impure = dict(trees)
    impure["swarm.policy.link"] = ast.parse("import zmq\n")
    assert impure_imports(impure) == ["swarm.policy.link imports zmq"]
