"""Compile every kernel lightning_sparse launches for an H100 (sm_90) with the Triton it imports; print JSON.

Each entry: ``registers`` per thread and ``stack`` bytes, from the cubin (``cuobjdump -res-usage``, shipped
with Triton); ``spill_stores`` and ``spill_loads`` (bytes), where there is a stack, from the report of
Triton's own ``ptxas`` run again on the kernel's PTX with Triton's options; ``local``: the bytes of local memory the PTX itself
declares (libdevice's, before ``ptxas``), and ``calls``: the functions it calls. No GPU needed. Run with
``TRITON_INTERPRET`` unset (tests/test_kernels.py does), with ``PYTHONPATH`` naming another Triton to
compile with that one (``make setup`` installs the GPU machine's, 3.6). The first line of the output
is the Triton version.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from lightning_sparse.kernels import bags as kernel_bags
from lightning_sparse.kernels import rows as kernel_rows
from lightning_sparse.kernels import runs as kernel_runs
from lightning_sparse.kernels import triton_bags, triton_rows, triton_slots
from lightning_sparse.kernels import triton_runs as k
from lightning_sparse.kernels.triton_update import FAMILIES, NEAREST, STOCHASTIC_BF16, Hyper, StepScalars
from lightning_sparse.tables import slot_map

FLOATS = {"dim_f", "divisor", *StepScalars._fields, *Hyper._fields}
NO_STATE = {"state_first": None, "state_second": None, "state_per_row": None}
CASES = {  # family, the flags that change the code, the pointers' types (None: not passed)
    "sgd": ("sgd", {}, NO_STATE),
    "adagrad": ("adagrad", {}, {"state_second": None, "state_per_row": None}),
    "adagrad, bf16, stochastic": ("adagrad", {"ROUNDING": STOCHASTIC_BF16.value},
                                  {"table": "*bf16", "state_second": None, "state_per_row": None}),
    "rowwise_adagrad, mean": ("rowwise_adagrad", {"MEAN": True, "HAS_COUNTS": True}, {"state_first": None, "state_second": None}),
    "adam, per-row bias": ("adam", {"ROW_BIAS": True, "WEIGHT_DECAY": True}, {"state_per_row": "*i64"}),
    "adamw, global bias": ("adam", {"WEIGHT_DECAY": True, "DECOUPLED": True}, {"state_per_row": None}),
    "segment sum, weighted": ("sum", {"HAS_WEIGHTS": True, "CHECK": False, "COUNT_UNIQUE": False},
                              {"table": None, **NO_STATE, "verdict": None, "unique": None}),
    "many tables, row-wise Adagrad": ("rowwise_adagrad", {"MANY": True, "HAS_WEIGHTS": True},
                                      {"state_first": None, "state_second": None, "tables": "*i64"}),
    "many tables, Adam, per-row bias": ("adam", {"MANY": True, "ROW_BIAS": True}, {"state_per_row": "*i64", "tables": "*i64"}),
}  # fmt: skip


def build(kernel, constexprs: dict, pointers: dict, num_warps: int = 4) -> dict:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs or (name in pointers and pointers[name] is None):
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            wide = name in ("salt", "row_multiplier", "m1", "m2") or name.endswith("_bits")  # float64 constants: int64 bits
            signature[name] = "fp32" if name in FLOATS else "i64" if wide else "i32"
    values = {**constexprs, **{name: None for name, kind in pointers.items() if kind is None}}
    options, target = {"num_warps": num_warps, "enable_fp_fusion": False}, GPUTarget("cuda", 90, 32)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=values), target=target, options=options)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    ptx = compiled.asm["ptx"]
    none = {"spill_stores": 0, "spill_loads": 0}  # no stack, no spill: ptxas's report is read only for a stack (1 s each)
    return {"registers": int(registers), "stack": int(stack), **(spills(ptx, target, options) if int(stack) else none),
            "local": sum(int(size) for size in re.findall(r"\.local .*__local_depot\d+\[(\d+)\]", ptx)),
            "calls": sorted(set(re.findall(r"call(?:\.uni)?\s+(?:\([^)]*\),\s*)?(\w+)", ptx)))}  # fmt: skip


def spills(ptx: str, target: GPUTarget, options: dict) -> dict:
    """Spill stores and loads of the kernel (all its functions), from ptxas's report of Triton's own ptxas command."""
    backend = make_backend(target)
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        backend.make_cubin(ptx, {}, backend.parse_options(dict(options)), target.arch)
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    assert found, log.getvalue()[-2000:]
    return {"spill_stores": sum(int(a) for a, _ in found), "spill_loads": sum(int(b) for _, b in found)}


def main() -> dict:
    builds = {}
    for dim in (64, 128):
        block_n, block_d = kernel_runs.hot_tile(dim)
        for case, (family, flags, pointers) in CASES.items():
            block_s, _ = kernel_runs.cold_tile(dim, family, flags.get("MANY", False))
            if dim == 128 and case.startswith(("segment sum", "many")):
                continue  # the same code at a wider tile; keeps the run short
            constexprs = dict(FAMILY=FAMILIES.index(family), HAS_PERM=True, HAS_WEIGHTS=False, HAS_COUNTS=False, MEAN=False, DIVIDE=False,
                              CHECK=True, COUNT_UNIQUE=True, WEIGHT_DECAY=False, DECOUPLED=False, ROW_BIAS=False,
                              LERP_FROM_END=False, ROUNDING=NEAREST.value, MANY=False, HOT_RUN=k.HOT, BLOCK_D=block_d)  # fmt: skip
            constexprs.update(flags)
            types = {"keys": "*i32", "perm": "*i64", "values": "*fp32", "weights": "*fp32" if flags.get("HAS_WEIGHTS") else None,
                     "counts": "*fp32" if flags.get("HAS_COUNTS") else None, "out": "*fp32" if family == "sum" else None,
                     "table": "*fp32", "state_first": "*fp32", "state_second": "*fp32", "state_per_row": "*fp32", "verdict": "*i64",
                     "unique": "*i64", "tables": None, **pointers}  # fmt: skip
            if dim == 64:
                builds[f"{case}, dim {dim}, hot"] = build(k.runs_hot, {**constexprs, "BLOCK_N": block_n}, types,
                                                          num_warps=kernel_runs.HOT_WARPS)  # fmt: skip
            builds[f"{case}, dim {dim}, cold"] = build(k.runs_cold, {**constexprs, "BLOCK_S": block_s}, types)
    block_b, block_d = kernel_bags.tile(64)
    bags = dict(SEARCH=5, STORE=True, SCALED=True, BLOCK_B=block_b, BLOCK_D=block_d)
    builds["gather of bags, dim 64"] = build(triton_bags.gather_bags, bags, num_warps=kernel_bags.NUM_WARPS, pointers={
        "features": "*i64", "entries": "*i64", "table": "*fp32", "out": "*fp32", "keys": "*i32", "sources": "*i32",
        "scales": "*fp32", "verdict": "*i64"})  # fmt: skip
    block_n, block_d = kernel_rows.tile(64)
    gather = dict(STORE_KEYS=True, CHECK=True, BLOCK_N=block_n, BLOCK_D=block_d)
    builds["gather, dim 64"] = build(triton_rows.gather_rows, gather, {"ids": "*i64", "table": "*fp32", "out": "*fp32", "keys": "*i32",
                                                            "verdict": "*i64"})  # fmt: skip
    put = {"BLOCK_N": block_n, "BLOCK_D": block_d}
    builds["put rows, dim 64"] = build(triton_rows.put_rows, put, {"rows": "*i64", "src": "*fp32", "dst": "*fp32"})
    builds["put rows, int64 per-row state"] = build(triton_rows.put_rows, {**put, "BLOCK_D": 16},
                                                    {"rows": "*i64", "src": "*i64", "dst": "*i64"})  # fmt: skip
    block_h = 32  # dim 64: half 32 (kernels/rows.py normal)
    normal = dict(HAS_MEAN=True, BLOCK_N=kernel_rows.NORMAL_TILE // block_h, BLOCK_H=block_h)
    builds["normal rows, dim 64"] = build(triton_rows.normal_rows, normal, {"ids": "*i64", "out": "*fp32"})
    width = {"WIDTH": slot_map.WIDTH, "BLOCK": triton_slots.BLOCK}
    builds["slot map find"] = build(triton_slots.find_slots, width, {"query": "*i64", "buckets": "*i32", "keys": "*i64",
                                                                     "out": "*i64"})  # fmt: skip
    for round_ in ("first", "second", "settle"):
        builds[f"slot map reserve, claim {round_}"] = build(getattr(triton_slots, f"claim_{round_}"), {**width, "HAS_VALID": True}, {
            "new": "*i64", "valid": "*i1", "buckets": "*i32", "out": "*i64"})  # fmt: skip
    builds["slot map write"] = build(triton_slots.write_entries, {"BLOCK": triton_slots.BLOCK}, {
        "entries": "*i64", "new": "*i64", "slots": "*i64", "buckets": "*i32", "keys": "*i64", "entry_of": "*i64"})  # fmt: skip
    builds["ids' keys (mix)"] = build(triton_slots.mix_keys, {"S1": 30, "S2": 27, "S3": 31, "BLOCK": triton_slots.BLOCK},
                                      {"ids": "*i64", "out": "*i64"})  # fmt: skip
    return builds


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()):  # the compiler's own prints (a ptxas log), not the JSON
        builds = main()
    print(triton.__version__)
    print(json.dumps(builds))
