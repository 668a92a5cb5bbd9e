"""The package's layout: its import graph has no cycle, no module imports another's private names, modules and classes stay small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_sparse"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module, names) for every import of a package module in ``path``, also under TYPE_CHECKING or in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_sparse":
            for alias in node.names:  # `from lightning_sparse import checkpoint` imports a module
                submodule = f"{node.module}.{alias.name}"
                found.append((submodule, []) if submodule in modules else (node.module, [alias.name]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "lightning_sparse"]
    return found


def test_import_graph_has_no_cycle():
    modules = _modules()
    graph = {
        name: sorted({target for target, _ in _imports(path, modules) if target in modules and target != name})
        for name, path in modules.items()
    }
    graph["lightning_sparse"] = []  # the package face imports everything; nothing may import it back but for names
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        stack.append(name)
        for target in graph[name]:
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    private = [
        f"{name} imports {target}.{imported}"
        for name, path in modules.items()
        for target, names in _imports(path, modules)
        for imported in names
        if imported.startswith("_") and target != name
    ]
    assert not private, "\n".join(private)


# The folders in data-path order: a module imports only from its own folder and the folders before it.
LAYERS = ("faults", "kernels", "wire", "lookup", "tables", "optim", "checkpoint", "lightning")
MAX_MODULES_PER_FOLDER = 12


def _layer(module: str) -> int | None:
    """The layer of ``lightning_sparse.<folder>...``; ``None`` for the package face and ``__main__``."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_folders_import_only_the_folders_before_them():
    """Also under TYPE_CHECKING and inside functions: a folder that needs a later one has the wrong place in the path."""
    modules = _modules()
    assert {m.split(".")[1] for m in modules if m.count(".") >= 2} <= set(LAYERS), "a folder outside LAYERS"
    upward = [
        f"{name} imports {target}"
        for name, path in modules.items()
        if _layer(name) is not None
        for target, _ in _imports(path, modules)
        if _layer(target) is not None and _layer(target) > _layer(name)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_folders_stay_small_and_their_inits_hand_names_on():
    modules = _modules()
    for layer in LAYERS:
        inside = [m for m in modules if m.startswith(f"lightning_sparse.{layer}.")]
        assert 0 < len(inside) <= MAX_MODULES_PER_FOLDER, f"{layer}: {len(inside)} modules"
        init = ast.parse(modules[f"lightning_sparse.{layer}"].read_text())
        body = [node for node in init.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert all(isinstance(node, (ast.ImportFrom, ast.Import, ast.Assign)) for node in body), f"{layer}/__init__.py does more"
    top = [m for m in modules if m.count(".") == 1]
    assert sorted(top) == ["lightning_sparse.__main__", *sorted(f"lightning_sparse.{layer}" for layer in LAYERS)], top


# A newcomer reads a module in one sitting and a class as one job: the sizes the house keeps to.
MAX_MODULE_LINES, MAX_CLASS_LINES = 300, 250


def test_modules_and_classes_stay_small():
    too_big = []
    for name, path in sorted(_modules().items()):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, f"over {MAX_MODULE_LINES} lines per module or {MAX_CLASS_LINES} per class: {too_big}"


# The figures the docs show are the only binary files the repository may hold (make bench regenerates them).
BINARY_ALLOWED = ("docs/benchmarks-distributed.png", "docs/benchmarks-single-kept.png", "docs/benchmarks-single.png")


def test_the_repository_tracks_sources_only():
    """No wheel, archive, compiled object or other binary is tracked: build outputs and downloads stay out of the tree."""
    import subprocess

    root = PACKAGE.parent
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.decode().split("\0")
    binary = []
    for name in filter(None, tracked):
        path = root / name
        if name in BINARY_ALLOWED or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head or name.endswith((".whl", ".so", ".tar.gz", ".zip", ".pt", ".ckpt")):
            binary.append(name)
    assert not binary, f"binary or build outputs tracked: {binary}"
