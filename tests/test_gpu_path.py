"""A one-process step on the GPU's code path: no host read, a bounded number of ops, ids checked on the device.

On CPU these run the Triton kernels through Triton's interpreter (``LIGHTNING_SPARSE_KERNELS=triton``):
the same Python, the same torch ops and the same kernels as on a GPU, so the op count and the
host reads seen here are the GPU's. On a GPU they run compiled, and the step also runs under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from host_reads import CopyInFlight, HostReads
from test_kernels import GPU_PATH_TOLERANCE, KERNEL_DEVICES
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_sparse as ls
from lightning_sparse.kernels import backend

# The most ops a one-process step of one table may take on the GPU's path, forward + backward + step
# + zero_grad: aten ops that launch work on the device plus Triton launches (see the count test).
MAX_STEP_OPS = 12
NOT_KERNELS = {"empty", "empty_strided", "new_empty", "view", "_unsafe_view", "alias", "as_strided", "detach", "t", "expand",
               "split", "split_with_sizes",
               "reshape", "slice", "select", "unsqueeze", "squeeze", "permute", "lift_fresh", "set_", "is_pinned",
               "_record_function_enter_new", "_record_function_exit"}  # fmt: skip


class AtenOps(TorchDispatchMode):
    """The aten ops that would launch device work, by name.

    Left out: allocations, views, queries and profiler labels (no kernel), ops on ``host`` tensors only (a
    host counter), and ops while a Triton kernel launches (the interpreter moving its arguments).
    """

    def __init__(self, host: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._host = {t.untyped_storage().data_ptr() for t in host}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        on_host = bool(tensors) and all(t.untyped_storage().data_ptr() in self._host for t in tensors)
        if name not in NOT_KERNELS and not on_host and not backend.launches.running:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setenv(backend.ENV, "triton")


def _table_and_ids(device: str, optimizer: str = "SparseAdagrad", **table_kwargs):
    emb = ls.SparseEmbedding(1000, 16, seed=3, device=device, **table_kwargs)
    opt = getattr(ls, optimizer)([emb], lr=0.1)
    ids = (1000 * torch.rand(256, generator=torch.Generator().manual_seed(0)) ** 4).long().to(device)
    return emb, opt, ids


def _step(emb, opt, ids) -> None:
    emb(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("optimizer", ["SparseSGD", "SparseAdagrad", "SparseRowWiseAdagrad", "SparseAdam"])
def test_a_one_process_step_reads_the_host_never(gpu_path, device, optimizer):
    emb, opt, ids = _table_and_ids(device, optimizer)
    _step(emb, opt, ids)  # the first step makes the table's buffers
    with HostReads(ignore=[opt.state[emb.shard]["step"]]) as reads:
        _step(emb, opt, ids)
    assert reads.calls == []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(emb, opt, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_the_host_reads_harness_sees_a_number_written_at_an_int_index():
    """``x[i] = 0`` copies a host scalar on CUDA (a CUDA graph's capture refuses it); a slice's fill does not."""
    x = torch.zeros(4) + 0  # made outside the harness: a device tensor, as it sees them
    with HostReads() as reads:
        x[1:2].fill_(1)
        x[2:3] = 1
    assert reads.calls == []
    with HostReads() as reads:
        x[0] = 1
    assert reads.calls == ["__setitem__ of a number at an int index (a copy from the host)"]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("optimizer", ["SparseAdagrad", "SparseAdam"])
def test_a_one_process_step_takes_a_bounded_number_of_ops(gpu_path, device, optimizer):
    """forward: the gather kernel and the verdict's copy to the host; backward: nothing to sum; step: one sort, 2 kernels."""
    emb, opt, ids = _table_and_ids(device, optimizer)
    grad = torch.ones(len(ids), 16, device=device)
    emb(ids).backward(grad)
    opt.step()
    launches = backend.launches.count
    with AtenOps(host=[opt.state[emb.shard]["step"]]) as aten:
        emb(ids).backward(grad)  # the loss's own ops are the user's: a given gradient has none
        opt.step()
        opt.zero_grad()
    triton = backend.launches.count - launches
    assert len(aten.ops) + triton <= MAX_STEP_OPS, f"{len(aten.ops)} aten ops {aten.ops} + {triton} Triton launches"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_ids_out_of_range_raise_at_the_step_and_update_nothing(gpu_path, device):
    emb, opt, ids = _table_and_ids(device)
    before = emb.full_weight().clone()
    bad = ids.clone()
    bad[7] = 1003
    out = emb(bad)  # no host read: the ids are checked on the device
    out.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()  # the verdict's copy is on the host (else a later step raises: the next test)
    with pytest.raises(IndexError, match=r"got id 1003 on this rank; valid ids are 0\.\.999 .*HINT"):
        opt.step()
    assert torch.equal(emb.full_weight(), before), "no row may change"
    _step(emb, opt, ids)  # the error is reported once; training goes on
    assert not torch.equal(emb.full_weight(), before)


@pytest.mark.skipif(not (backend.interpreting() and backend.triton_available()), reason="needs triton's interpreter")
def test_bad_ids_not_yet_seen_by_the_host_leave_the_table_untouched_until_they_raise(gpu_path):
    """A GPU far behind its host: the step cannot raise yet, so its update kernel skips the table (no host read)."""
    emb, opt, ids = _table_and_ids("cpu")
    _step(emb, opt, ids)
    before = emb.full_weight().clone()
    emb.range_check._event = event = CopyInFlight()  # stands in for the GPU's event
    bad = ids.clone()
    bad[3] = -1
    emb(bad).sum().backward()
    opt.step()
    _step(emb, opt, ids)  # still not on the host: this step must not touch the table either
    assert torch.equal(emb.full_weight(), before)
    event.done = True
    with pytest.raises(IndexError, match=r"got id -1 on this rank"):
        emb(ids)  # the next lookup that finds the copy done raises, once
    _step(emb, opt, ids)
    assert not torch.equal(emb.full_weight(), before)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_lookup_without_grad_raises_at_once(gpu_path, device):
    emb, _, _ = _table_and_ids(device)
    with torch.no_grad(), pytest.raises(IndexError, match=r"got id -4 on this rank"):
        emb(torch.tensor([1, -4, 2], device=device))
    assert emb(torch.tensor([1, 2], device=device)).shape == (2, 16)  # reported once


@pytest.mark.skipif(not (backend.interpreting() and backend.triton_available()), reason="needs triton's interpreter")
def test_a_lookup_without_grad_waits_for_its_verdict_in_flight_and_raises_for_the_first_id_past_the_table(gpu_path):
    """Without grad no step follows to raise at: the lookup waits for its own verdict's copy, one the GPU has not finished
    too, and raises for an id equal to num_embeddings (the first past the table)."""
    emb, _, ids = _table_and_ids("cpu")
    with torch.no_grad():
        emb(ids)  # the verdict is made
    emb.range_check._event = event = CopyInFlight()  # stands in for the GPU's event
    bad = ids.clone()
    bad[5] = 1000
    with torch.no_grad(), pytest.raises(IndexError, match=r"got id 1000 on this rank; valid ids are 0\.\.999"):
        emb(bad)
    assert event.done, "the lookup did not wait for its verdict"


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("wide_keys", [False, True])
def test_ids_changed_in_place_after_the_lookup_train_the_rows_looked_up(monkeypatch, kernels, wide_keys):
    """A lookup keeps its own copy of the ids: a loader reusing its buffer cannot move the gradient. ``wide_keys``: int64
    keys, as a table of more than 2**31 rows keeps (int64 ids then need no conversion: the copy must be explicit)."""
    if kernels == "triton" and not (backend.interpreting() and backend.triton_available()):
        pytest.skip("needs triton's interpreter")
    monkeypatch.setenv(backend.ENV, kernels)
    if wide_keys:
        from lightning_sparse.kernels import rows as kernel_rows

        monkeypatch.setattr(kernel_rows, "_INT32_LIMIT", 10)
    emb = ls.SparseEmbedding(20, 4, seed=1)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight().clone()
    ids = torch.tensor([1, 2, 3])
    out = emb(ids)
    ids += 6
    out.sum().backward()
    opt.step()
    changed = (emb.full_weight() != before).any(1).nonzero().view(-1).tolist()
    assert changed == [1, 2, 3]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_one_table_step_counts_its_distinct_ids(monkeypatch, kernels):
    if kernels == "triton" and not (backend.interpreting() and backend.triton_available()):
        pytest.skip("needs triton's interpreter")
    monkeypatch.setenv(backend.ENV, kernels)
    emb = ls.SparseEmbedding(20, 4)
    opt = ls.SparseSGD([emb], lr=1.0)
    emb(torch.tensor([[4, 4, 9], [1, 4, 9]])).sum().backward()
    opt.step()
    assert (emb.stats.ids_looked_up, int(emb.stats.unique_ids)) == (6, 3)


# ---------------------------------------------------------------- a collection on one GPU: all tables at once
def _collection(num_tables: int = 3, pooled: bool = True, device: str = "cpu") -> ls.SparseEmbeddingCollection:
    tables = {f"t{i}": ls.SparseEmbedding(40 + 7 * i, 8, seed=i, device=device) for i in range(num_tables)}
    features = {"ids": "t0", "bags": "t1", "means": "t2", "more": "t0"} if pooled else {name: name for name in tables}
    pooling = {"bags": "sum", "means": "mean"} if pooled else "none"
    return ls.SparseEmbeddingCollection(tables, features=features, pooling=pooling)


def _features(step: int, pooled: bool = True, num_tables: int = 3, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(step)
    if not pooled:
        return {f"t{i}": torch.randint(0, 40, (5,), generator=gen).to(device) for i in range(num_tables)}
    return {"ids": torch.randint(0, 40, (6,), generator=gen).to(device),
            "bags": ls.JaggedIds(torch.randint(0, 47, (9,), generator=gen).to(device), lengths=torch.tensor([2, 0, 4, 3]).to(device),
                                 weights=torch.rand(9, generator=gen).to(device)),
            "means": torch.randint(0, 54, (4, 3), generator=gen).to(device),
            "more": torch.randint(0, 40, (2, 3), generator=gen).to(device)}  # fmt: skip


def _loss(out: dict) -> torch.Tensor:
    return sum((value * (index + 1)).pow(2).sum() for index, value in enumerate(out.values()))


def _train_collection(monkeypatch, kernels: str, optimizer: str, kwargs: dict, also_direct: bool = False,
                      device: str = "cpu", rest: str | None = None) -> dict:  # fmt: skip
    """3 steps; ``rest``: a feature left out of the first step (its table's step count falls behind the others')."""
    monkeypatch.setenv(backend.ENV, kernels)
    collection = _collection(device=device)
    opt = getattr(ls, optimizer)([collection], **kwargs)
    for step in range(3):
        features = _features(step, device=device)
        if step == 0 and rest is not None:
            del features[rest]
        loss = _loss(collection(features))
        if also_direct:  # a table of the collection also looked up on its own: the round is split per table
            loss = loss + collection.tables["t1"](torch.tensor([3, 3, 9], device=device)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: table.full_weight().cpu() for name, table in collection.tables.items()}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("optimizer, kwargs", [("SparseSGD", dict(lr=0.1)), ("SparseAdagrad", dict(lr=0.1, lr_decay=0.1)),
                                               ("SparseRowWiseAdagrad", dict(lr=0.1)),
                                               ("SparseAdam", dict(lr=0.01, bias_correction="global", weight_decay=0.1,
                                                                   decoupled_weight_decay=True))])  # fmt: skip
@pytest.mark.parametrize("also_direct", [False, True])
def test_a_collection_on_one_gpu_trains_as_on_a_cpu(monkeypatch, device, optimizer, kwargs, also_direct):
    """Ids, weighted sum bags and mean bags of 3 tables in one kernel, one sort and one update launch for all tables."""
    expected = _train_collection(monkeypatch, "torch", optimizer, kwargs, also_direct)  # the CPU's torch path
    got = _train_collection(monkeypatch, "triton", optimizer, kwargs, also_direct, device)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name, **GPU_PATH_TOLERANCE)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("optimizer, kwargs", [("SparseAdagrad", dict(lr=0.1, lr_decay=0.5)),
                                               ("SparseAdam", dict(lr=0.01, bias_correction="global"))])  # fmt: skip
def test_tables_at_different_steps_take_each_their_own_learning_rate_in_one_launch(monkeypatch, device, optimizer, kwargs):
    """Table t2 rests at the first step: in the one launch of the later steps its decayed lr (step size) is its own."""
    expected = _train_collection(monkeypatch, "torch", optimizer, kwargs, rest="means")
    got = _train_collection(monkeypatch, "triton", optimizer, kwargs, device=device, rest="means")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name, **GPU_PATH_TOLERANCE)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_collection_step_takes_the_same_ops_for_26_tables_as_for_2(gpu_path, device):
    """forward: the gather; backward: one concatenation; step: one sort, one gather of the bags, two update launches,
    and the verdict's copy. A GPU also shows the copy of the step's host-built table entries, which a CPU does not (the
    features' entries are kept on the device while the input tensors stay the same)."""
    counts = {}
    for num_tables in (2, 26):
        collection = _collection(num_tables, pooled=False, device=device)
        opt = ls.SparseAdagrad([collection], lr=0.1)
        features = _features(0, pooled=False, num_tables=num_tables, device=device)
        _loss(collection(features)).backward()
        opt.step()
        host = [opt.state[t.shard]["step"] for t in collection.table_list]
        grads = [
            torch.ones(5, 8, device=device) for _ in range(num_tables)
        ]  # the loss's ops are the user's: given gradients have none
        launches = backend.launches.count
        with HostReads(ignore=host) as reads, AtenOps(host=host) as aten:
            out = collection(features)
            torch.autograd.backward(list(out.values()), grads)
            opt.step()
            opt.zero_grad()
        counts[num_tables] = (len(aten.ops) + backend.launches.count - launches, aten.ops)
        assert reads.calls == []
    assert counts[26][0] == counts[2][0], counts
    if device == "cpu":  # (a GPU adds the entries' copy, whose aten ops this harness has not seen on one yet)
        assert counts[2][0] <= 7, counts  # a verdict copy, a cat, a sort, an index_select, 3 Triton launches


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("bad", ["id", "offsets"])
@pytest.mark.parametrize("also_direct", [False, True])
def test_bad_input_of_a_collection_on_one_gpu_raises_at_the_step_naming_the_feature(gpu_path, device, bad, also_direct):
    """Also when the round is split per table (a table also looked up on its own): its keys are trusted only after the check."""
    collection = _collection(device=device)
    opt = ls.SparseAdagrad([collection], lr=0.1)
    before = {name: t.full_weight().clone() for name, t in collection.tables.items()}
    features = _features(0, device=device)
    if bad == "id":
        features["means"][1, 2] = 54  # table t2 has 54 rows
        message = r"Feature 'means' \(table 't2'\) of SparseEmbeddingCollection got id 54 on this rank"
    else:
        offsets = torch.tensor([0, 2, 2, 6, 8], device=device)  # ends before 9
        features["bags"] = ls.JaggedIds(features["bags"].values, offsets=offsets)
        message = r"Feature 'bags' \(table 't1'\) of SparseEmbeddingCollection got bag offsets that do not fit"
    loss = _loss(collection(features))
    if also_direct:
        loss = loss + collection.tables["t1"](torch.tensor([3], device=device)).sum()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()  # the verdict's copy is on the host by the step (it raises at a later one otherwise)
    with pytest.raises((IndexError, ValueError), match=message):
        opt.step()
    assert all(torch.equal(t.full_weight(), before[name]) for name, t in collection.tables.items())
    _loss(collection(_features(1, device=device))).backward()  # reported once: training goes on
    opt.step()
