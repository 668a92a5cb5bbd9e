"""What only a GPU shows, held on a CPU: by the source where the interpreter cannot show it, by behaviour where it can.

Triton's interpreter runs a program as one, in float64, on the current thread: it divides exactly,
has no current device, no stream to capture and no order among atomics. So the rules a compiled
kernel needs (issue 42, docs/design.md "What only a GPU shows") are checked on the package's
source here, and what a CPU can show is run.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from test_kernels import KERNEL_DEVICES

import lightning_sparse as ls
from lightning_sparse.kernels import backend, host
from lightning_sparse.tables.slot_map import SlotMap

PACKAGE = Path(ls.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_jit(node: ast.AST) -> bool:
    """A function decorated with ``triton.jit`` (or ``@triton.jit(...)``)."""
    if not isinstance(node, ast.FunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _jit_functions() -> dict[str, ast.FunctionDef]:
    return {f"{name}:{node.name}": node for name, tree in _modules().items() for node in ast.walk(tree) if _is_jit(node)}


def test_no_kernel_divides_with_a_plain_slash():
    """``/`` compiles to ``div.full.f32`` (2 ulp); torch divides rounded to nearest: kernels use ``tl.div_rn``.

    A quotient of two literals is folded by Triton in Python (exactly, then rounded once) and may stay.
    """
    kernels = _jit_functions()
    assert len(kernels) > 20, sorted(kernels)  # the check reaches every kernel file
    slashes = []
    for name, function in kernels.items():
        for node in ast.walk(function):
            divides = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            if divides and not (isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant)):
                slashes.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
                slashes.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
    assert not slashes, slashes


def _name(node: ast.AST) -> str:
    """The last name of ``a.b.c`` or ``c``."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _inside(node: ast.AST, parents: dict[ast.AST, ast.AST], context: str) -> bool:
    """Whether ``node`` sits in a ``with`` whose item calls ``context`` with one argument (a device)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _name(call.func) == context and len(call.args) == 1:
                    return True
    return False


def _calls(where: dict[str, ast.Module], wanted) -> list[tuple[str, ast.Call, dict]]:
    found = []
    for name, tree in where.items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        found += [(name, node, parents) for node in ast.walk(tree) if isinstance(node, ast.Call) and wanted(node)]
    return found


def test_every_triton_launch_and_cuda_event_is_under_its_tensors_device():
    """Triton launches on the current device and stream, and an event records on the current device's stream: each
    ``kernel[grid](...)`` sits in ``launches.launch(device)``, each event's ``record()`` in ``on_device(device)``."""
    modules = _modules()
    launches = _calls(modules, lambda call: isinstance(call.func, ast.Subscript))  # the package calls a subscript only so
    records = _calls(modules, lambda call: _name(call.func) == "record" and "event" in ast.unparse(call.func).lower())
    assert len(launches) >= 10 and len(records) >= 2, (len(launches), len(records))  # the check reaches them
    unguarded = [f"{name} line {call.lineno}: {ast.unparse(call.func)}" for name, call, parents in launches
                 if not _inside(call, parents, "launch")]  # fmt: skip
    unguarded += [f"{name} line {call.lineno}: {ast.unparse(call.func)}" for name, call, parents in records
                  if not _inside(call, parents, "on_device")]  # fmt: skip
    assert not unguarded, unguarded


def test_a_launch_makes_its_tensors_cuda_device_current(monkeypatch):
    entered = []

    class Device:  # stands in for torch.cuda.device, which needs a GPU to enter
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)

        def __exit__(self, *exc) -> None:
            entered.append("left")

    monkeypatch.setattr(torch.cuda, "device", Device)
    with backend.launches.launch(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with backend.launches.launch(torch.device("cpu")):  # a CPU tensor (the interpreter): no CUDA device to make current
        pass
    assert entered == [torch.device("cuda", 1), "left"]


# ---------------------------------------------------------------- risk 1: what a captured step reads stays put
@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setenv(backend.ENV, "triton")


def _collection(device: str) -> ls.SparseEmbeddingCollection:
    tables = {
        name: ls.SparseEmbedding(rows, 8, seed=seed, device=device) for name, rows, seed in (("users", 30, 1), ("tags", 20, 2))
    }
    return ls.SparseEmbeddingCollection(tables, features={"user": "users", "tags": "tags"}, pooling={"tags": "sum"})


def _spy_on_the_gather(monkeypatch) -> list[torch.Tensor]:
    """The table of features each launch of the collection gather reads."""
    from lightning_sparse.kernels import triton_bags

    seen, real = [], triton_bags.gather_bags

    class Spy:
        def __getitem__(self, grid):
            def launch(features, *args, **kwargs):
                seen.append(features)
                return real[grid](features, *args, **kwargs)

            return launch

    monkeypatch.setattr(triton_bags, "gather_bags", Spy())
    return seen


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_collection_reads_one_kept_table_of_features_while_its_inputs_stay(gpu_path, monkeypatch, device):
    """The same input tensors: the same device tensor, made once (a new pinned host copy each call is what a captured
    step must not follow); new input tensors: a new table with their addresses."""
    collection, seen = _collection(device), _spy_on_the_gather(monkeypatch)
    static = {"user": torch.tensor([1, 29, 3], device=device), "tags": torch.tensor([[0, 19], [4, 4]], device=device)}
    for _ in range(3):
        collection(static)
    assert seen[0] is seen[1] is seen[2]
    collection({name: ids.clone() for name, ids in static.items()})
    assert seen[3] is not seen[2] and not torch.equal(seen[3], seen[2])


def test_no_host_copy_while_a_graph_is_captured(monkeypatch):
    """``to_device`` (every host-to-device copy of the package) refuses while the device's stream captures."""
    monkeypatch.setattr(host, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"inside a CUDA graph being captured.*HINT: run the step once before capturing"):
        host.to_device(torch.tensor([1, 2]), torch.device("cuda"))


def test_values_that_change_during_a_capture_are_written_on_the_device(monkeypatch):
    """A capture-time change of values (an input that is a new tensor each call): the last tensor with the changes filled
    in by device ops, no host copy; every tensor a capture read is kept."""
    kept, device = host.KeptValues(), torch.device("cpu")
    warm = kept.get([7, 8, 9], device)
    assert kept.get([7, 8, 9], device) is warm
    monkeypatch.setattr(host, "capturing", lambda device: True)  # from here on, to_device raises (the test above)
    changed = kept.get([7, -5, 9], device)
    assert changed.tolist() == [7, -5, 9] and warm.tolist() == [7, 8, 9]
    longer = kept.get([1, 0, 3, 4], device)  # no tensor of that length: zeros, then the values
    assert longer.tolist() == [1, 0, 3, 4]
    assert [t.tolist() for t in kept._held] == [[7, 8, 9], [7, -5, 9], [1, 0, 3, 4]]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_round_whose_inputs_are_new_at_capture_trains_as_eager_without_a_host_copy(gpu_path, monkeypatch, device):
    """Bags given by lengths make new offsets every call: the capture's table of features is made on the device."""
    lengths, values = torch.tensor([2, 0, 1], device=device), torch.tensor([0, 19, 4], device=device)
    features = {"user": torch.tensor([1, 29, 3], device=device), "tags": ls.JaggedIds(values, lengths=lengths)}
    eager, captured = _collection(device), _collection(device)
    for collection in (eager, captured):
        collection(features)["tags"].sum().backward()  # the warm-up
    monkeypatch.setattr(host, "capturing", lambda device: True)
    out = captured(features)  # (a copy from the host would raise: the test above)
    monkeypatch.setattr(host, "capturing", lambda device: False)
    torch.testing.assert_close(out["tags"], eager(features)["tags"], rtol=0, atol=0)


def test_only_to_device_copies_pinned_host_memory_to_a_device():
    """A graph can capture a copy only from pinned host memory (a pageable copy waits, which a capture refuses). Pinned
    buffers live in two places: ``kernels/host.py`` (``to_device``, which refuses during a capture, and ``LateRead``'s
    device-to-host copy) and the range check (device to host, standing aside during a capture). So no other code can
    leave a host address in a captured graph."""

    def pins(call: ast.Call) -> bool:
        return _name(call.func) == "pin_memory" or any(k.arg == "pin_memory" for k in call.keywords)

    found = sorted({name for name, _, _ in _calls(_modules(), pins)})
    assert found == ["kernels/host.py", "lookup/range_check.py"], found


CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not backend.triton_available(), reason="needs CUDA and triton")


@CUDA
def test_a_host_copy_inside_a_cuda_graph_capture_raises():
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph being captured"), torch.cuda.graph(graph):
        host.to_device(torch.tensor([1, 2]), torch.device("cuda"))


@CUDA
def test_a_collection_step_captured_in_a_cuda_graph_replays_as_eager_while_pinned_memory_is_reused():
    """Bags by lengths (new offsets at every call, so the capture makes its own table of features), captured, then each
    replay after pinned host memory was allocated, filled with garbage and freed (as a DataLoader's pinning does)."""
    from test_capturable import _captured, _collection_step
    from test_capturable import _collection as capturable

    gen = torch.Generator().manual_seed(0)

    def batch() -> dict:
        lengths = torch.tensor([0, 1, 2, 3] * 8)[torch.randperm(32, generator=gen)]  # 48 ids in 32 bags, every batch
        tags = ls.JaggedIds(torch.randint(0, 50, (48,), generator=gen).cuda(), lengths=lengths.cuda())
        users, items = (
            (300 * torch.rand(32, generator=gen) ** 3).long().cuda(),
            torch.randint(0, 120, (32,), generator=gen).cuda(),
        )
        return {"user": users, "item": items, "tags": tags}

    batches = [batch() for _ in range(6)]
    eager = capturable("adagrad", True, "cuda")
    for features in batches:
        _collection_step(*eager, features)
    first = batches[0]
    static = {"user": first["user"].clone(), "item": first["item"].clone(),
              "tags": ls.JaggedIds(first["tags"].values.clone(), lengths=first["tags"].lengths.clone())}  # fmt: skip
    captured = capturable("adagrad", True, "cuda")
    graph = _captured(lambda: _collection_step(*captured, static))
    for features in batches[1:]:
        for name in ("user", "item"):
            static[name].copy_(features[name])
        static["tags"].values.copy_(features["tags"].values)
        static["tags"].lengths.copy_(features["tags"].lengths)
        junk = [torch.full((size,), -1, dtype=torch.int64).pin_memory() for size in (8, 16, 24, 32, 64, 128, 256) * 8]
        for piece in junk:
            piece.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        del junk
        graph.replay()
    torch.cuda.synchronize()
    for name, table in captured[0].tables.items():
        torch.testing.assert_close(table.full_weight(), eager[0].tables[name].full_weight(), rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- risk 4: admissions whatever the order of the claims
def _crowded_map(occupied: dict[int, int], num_slots: int, device: str) -> SlotMap:
    """A map whose group ``g`` holds ``occupied[g]`` slots (in its first entries)."""
    slots = SlotMap(num_slots, device)
    for group, count in occupied.items():
        slots.buckets[group, :count] = torch.arange(1, count + 1, dtype=torch.int32)
    return slots


def _entries(kernels: str, monkeypatch, occupied: dict, num_slots: int, keys: torch.Tensor, valid=None) -> dict[int, int]:
    monkeypatch.setenv(backend.ENV, kernels)
    entries = _crowded_map(occupied, num_slots, keys.device).reserve(keys, valid)
    return dict(zip(keys.tolist(), entries.tolist()))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_two_keys_for_one_free_entry_get_in_whatever_their_order(monkeypatch, device):
    """A and B both try group 3 first (one free entry); A's other group is full, B's has room. Smallest key first: A takes
    group 3 and B its other group, in either order of the batch (first come, first served rejected A in the order B, A)."""
    slots = SlotMap(64)
    assert slots.mask == 31
    a, b = (1 << 40) | (6 << 32) | 3, (2 << 40) | (15 << 32) | 3  # groups (3, 10) and (3, 19)
    assert slots.groups(torch.tensor([a, b])).tolist() == [[3, 10], [3, 19]]
    occupied = {3: 7, 10: 8, 19: 7}
    got = {(kernels, order): _entries(kernels, monkeypatch, occupied, 64, torch.tensor(order, device=device))
           for kernels in ("torch", "triton") for order in ((a, b), (b, a))}  # fmt: skip
    assert all(entries == {a: 3 * 8 + 7, b: 19 * 8 + 7} for entries in got.values()), got


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_crowded_batch_gets_the_same_entries_in_every_order_on_both_paths(monkeypatch, device):
    """50 keys (5 not valid) for 8 groups of 8 entries, 21 taken: most groups overflow, and each order of the batch (the
    interpreter's order of the claims) gives the same entries, on the torch path and in the kernels."""
    gen = torch.Generator().manual_seed(3)
    occupied = {group: count for group, count in enumerate(torch.randint(0, 6, (8,), generator=gen).tolist())}
    keys = torch.randint(-(2**62), 2**62, (50,), generator=gen).to(device)
    valid = (torch.arange(50) % 10 != 4).to(device)
    orders = [torch.arange(50), torch.arange(49, -1, -1), torch.randperm(50, generator=gen)]
    expected = {key: entry for key, entry in _entries("torch", monkeypatch, occupied, 16, keys, valid).items()}
    assert 0 < sum(entry >= 0 for entry in expected.values()) < 45  # room for some, not all
    for kernels in ("torch", "triton"):
        for order in orders:
            got = _entries(kernels, monkeypatch, occupied, 16, keys[order.to(device)], valid[order.to(device)])
            assert got == expected, (kernels, order[:5])


# ---------------------------------------------------------------- the versions the GPU path ran on
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_triton_older_than_the_kernels_need_raises_at_their_first_use(monkeypatch, device):
    import triton

    monkeypatch.setenv(backend.ENV, "triton")
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    backend._versions_checked.cache_clear()
    with pytest.raises(
        RuntimeError, match=r"need Triton 3\.6 or later; this is triton 3\.5\.1\. HINT: pip install 'triton>=3\.6'"
    ):
        ls.SparseEmbedding(10, 4, device=device)(torch.tensor([1], device=device))


def test_a_gpu_path_on_versions_it_has_not_run_on_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.check_versions("2.11.0+cu128", "3.6.0", compiled=True)  # what ran on a GPU
        backend.check_versions("2.13.0", "3.9.0", compiled=False)  # the suite's interpreter
        assert not caught
        backend.check_versions("2.13.0+cu130", "3.9.0", compiled=True)
    assert len(caught) == 1, caught
    message = str(caught[0].message)
    assert "has run on torch 2.11 with Triton 3.6 only; this is torch 2.13.0+cu130 with Triton 3.9.0. HINT:" in message
