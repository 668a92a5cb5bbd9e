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


# ---------------------------------------------------------------- composition, not mixins
# Classes that mix in, being recomposed by the lead (issue 44, item 3): remove an entry with its mixin.
KNOWN_MIXINS: set[str] = set()  # (all gone: a class's helpers are objects it holds)


def _is_protocol(node: ast.ClassDef) -> bool:
    """A typing Protocol (an interface that may extend others), not a class with behaviour to mix in."""
    return any(isinstance(base, ast.Name) and base.id == "Protocol" for base in node.bases)


def test_classes_compose_instead_of_mixing_in():
    """A class has one base and holds its helpers (as Lightning's DDPStrategy does); none is a mixin (``...Mixin``)."""
    found = {
        f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and not _is_protocol(node) and (len(node.bases) > 1 or node.name.endswith("Mixin"))
    }
    assert not found - KNOWN_MIXINS, f"classes that mix in (hold a helper object instead): {sorted(found - KNOWN_MIXINS)}"
    assert not KNOWN_MIXINS - found, (
        f"KNOWN_MIXINS entries that match nothing any more (remove them): {sorted(KNOWN_MIXINS - found)}"
    )


# ---------------------------------------------------------------- no patch outside the compat modules
# Where Lightning or torch must be bent, these modules do it, with the versions they were checked against.
COMPAT_MODULES = ("lightning_sparse/lightning/compat.py", "lightning_sparse/lookup/torch_compat.py")
# Names that are the function's own object: a method's instance and class, and torch's autograd context (``ctx``,
# where an autograd.Function keeps what its backward needs, as torch documents it).
OWN_NAMES = frozenset({"self", "cls", "ctx"})
# Attributes whose assignment is the object's own interface: torch's ``Tensor.data`` (a Parameter keeps its identity
# while its storage moves, as nn.Module._apply does) and every property with a setter in the package (found by the scan).
INTERFACE_ATTRIBUTES = frozenset({"data"})
# Calls that make a new object besides a class's (a CapWords name): cls(...), type(x)(...), copy, deepcopy, replace.
FRESH_CALLS = frozenset({"cls", "copy", "deepcopy", "replace"})
DICT_WRITES = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"})
# Known patches, being removed (issue 44, items 1-3): (module, function, what is patched). The test fails on a patch
# not listed and on an entry that no longer matches, so the list only shrinks: remove an entry with its patch.
KNOWN_PATCHES: set[tuple[str, str, str]] = set()  # (all gone: an object changes its own attributes, or a compat shim does)


def _scopes(node: ast.AST):
    """The nodes of ``node``'s own scope: not those of the functions, lambdas and classes inside it."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(child))


def _makes_new_object(value: ast.AST) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Call):  # type(x)(...)
        return isinstance(func.func, ast.Name) and func.func.id == "type"
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name[:1].isupper() or name in FRESH_CALLS


def _patches(tree: ast.Module, setters: frozenset[str]) -> list[tuple[str, str]]:
    """(function, target) of every patch in ``tree``: see test_nothing_is_patched_outside_the_compat_modules."""
    found: list[tuple[str, str]] = []

    def own(node: ast.AST, made: set[str]) -> bool:
        return isinstance(node, ast.Name) and (node.id in OWN_NAMES or node.id in made)

    def dict_of_other(node: ast.AST, made: set[str]) -> bool:  # obj.__dict__ or vars(obj), obj not our own
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            return not own(node.value, made)
        is_vars = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args
        return bool(is_vars) and not own(node.args[0], made)

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, (ast.Assign, ast.Delete)):
            return node.targets
        if isinstance(node, (ast.AnnAssign, ast.For, ast.AsyncFor)):
            return [node.target]
        if isinstance(node, ast.withitem) and node.optional_vars is not None:
            return [node.optional_vars]
        return []  # an augmented assignment adds to a value the object keeps (a counter): not a patch

    def visit(scope: ast.AST, where: str, made: set[str]) -> None:
        made = set(made)
        for node in _scopes(scope):
            if isinstance(node, ast.Assign) and _makes_new_object(node.value):
                made |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and isinstance(scope, ast.Module):
                made.add(node.name)  # module-level code may set up what the module defines
        for node in _scopes(scope):
            for target in targets(node):
                for part in ast.walk(target):
                    if not isinstance(getattr(part, "ctx", None), (ast.Store, ast.Del)):
                        continue
                    if isinstance(part, ast.Attribute) and not own(part.value, made) and part.attr not in setters:
                        found.append((where, ast.unparse(part)))
                    elif isinstance(part, ast.Subscript) and dict_of_other(part.value, made):
                        found.append((where, ast.unparse(part)))
            if isinstance(node, ast.Call):
                func, args = node.func, node.args
                if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and args and not own(args[0], made):
                    found.append((where, f"{func.id}({ast.unparse(args[0])}, ...)"))
                elif (isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__") and args
                      and not own(args[0], made)):  # fmt: skip
                    found.append((where, f"{ast.unparse(func)}({ast.unparse(args[0])}, ...)"))
                elif isinstance(func, ast.Attribute) and func.attr in DICT_WRITES and dict_of_other(func.value, made):
                    found.append((where, ast.unparse(func)))
        for node in _scopes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node, node.name if isinstance(scope, ast.Module) else f"{where}.{node.name}", made)

    visit(tree, "<module>", set())
    return found


def _package_setters() -> frozenset[str]:
    """The names of the package's properties that have a setter (``@name.setter``): assigning one calls the object's code."""
    return frozenset(
        decorator.value.id
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for decorator in node.decorator_list
        if isinstance(decorator, ast.Attribute) and decorator.attr == "setter" and isinstance(decorator.value, ast.Name)
    )


def test_nothing_is_patched_outside_the_compat_modules():
    """No module outside COMPAT_MODULES binds or deletes an attribute of an object that is not its own.

    A patch is ``obj.attr = value`` (also as a for or with target), ``del obj.attr``, ``setattr(obj, ...)``,
    ``delattr(obj, ...)``, ``object.__setattr__(obj, ...)``, or a write to ``obj.__dict__`` or ``vars(obj)`` (an item
    assigned or deleted, update, setdefault, pop, ...), where ``obj`` is not a name of OWN_NAMES and not a name that the
    same function (or an enclosing one; for module-level code, the module) bound to a new object: a class called,
    or a call of FRESH_CALLS. ``self.helper.attr = value`` is a patch of the helper: give it a method. Not patches:
    assigning an attribute of INTERFACE_ATTRIBUTES or a property with a setter of the package's own classes
    (its code runs), an augmented assignment (``stats.bytes_sent += n``: a counter the object keeps), method calls
    and container items. Exceptions: KNOWN_PATCHES, each to be removed with its patch.
    """
    setters = _package_setters() | INTERFACE_ATTRIBUTES
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        if name not in COMPAT_MODULES:
            found |= {(name, where, target) for where, target in _patches(ast.parse(path.read_text()), setters)}
    unknown, gone = sorted(found - KNOWN_PATCHES), sorted(KNOWN_PATCHES - found)
    assert not unknown, "patched from outside (move it to a compat module, or give the object a method):\n" + "\n".join(
        f"{module} {where}: {target}" for module, where, target in unknown
    )
    assert not gone, "KNOWN_PATCHES entries that match nothing any more (remove them):\n" + "\n".join(map(str, gone))


# What issue 44 found patched (their shape, in short), and what is no patch.
PATCHES = """
def wrap(loop):
    run = loop.run
    loop.run = lambda: run()
def collect(trainer, full):
    module = trainer.lightning_module
    module.state_dict = lambda: full
    del module.state_dict
def cache(collection, entries):
    collection.__dict__["_cached"] = entries
    vars(collection).update(cached=entries)
def outputs(outputs):
    handle = torch.zeros(())
    handle.lookup_outputs = outputs
def fields(self, table, records):
    record = records[0]
    record.tables = [table]
    self.pending.route = None
    table.placement = object()
    setattr(table, "placement", None)
    object.__setattr__(table, "placement", None)
    for table.row in range(3):
        pass
"""
NOT_PATCHES = """
class Stats:
    def __init__(self):
        self.count = 0
        object.__setattr__(self, "frozen", True)
    def add(self, stats, tensors, table, ctx):
        stats.count += 1
        header = Header(count=1)
        header.count = 2
        copied = copy(header)
        copied.count = 3
        tensors[0].data = tensors[1]
        table.clock = 4
        ctx.saved = tensors
        def inner():
            header.extra = 5
Stats.label = "a class's own module sets it up"
"""


def test_the_patch_rule_catches_the_patches_of_issue_44_and_leaves_the_rest():
    found = _patches(ast.parse(PATCHES), frozenset({"clock", "data"}))
    assert sorted(found) == sorted(
        [
            ("wrap", "loop.run"),
            ("collect", "module.state_dict"),
            ("collect", "module.state_dict"),
            ("cache", "collection.__dict__['_cached']"),
            ("cache", "vars(collection).update"),
            ("outputs", "handle.lookup_outputs"),
            ("fields", "record.tables"),
            ("fields", "self.pending.route"),
            ("fields", "table.placement"),
            ("fields", "table.row"),
            ("fields", "setattr(table, ...)"),
            ("fields", "object.__setattr__(table, ...)"),
        ]
    ), found
    assert _patches(ast.parse(NOT_PATCHES), frozenset({"clock", "data"})) == []
