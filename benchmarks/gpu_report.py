"""The GPU section of the report: its targets (the GPU issue's acceptance figures) and its tables."""

from __future__ import annotations

from collections.abc import Callable

LABEL = {"adagrad": "Adagrad", "rowwise_adagrad": "row-wise Adagrad", "adam": "Adam (global bias correction)",
         "adagrad_bf16": "Adagrad, bf16 table"}  # fmt: skip
MAX_KERNELS = 20  # the library's kernels in a one-process step (the loss's own counted apart)

Add = Callable[..., None]


def targets(gpu: dict, add: Add) -> None:
    """Add each GPU target, per workload and draw of ids, then the many-tables ones."""
    collection_targets(gpu, add)
    if "workloads" not in gpu:
        for name in ("Adagrad step / torch sparse Adagrad", "update bandwidth / device copy"):
            add(f"1 GPU: {name}", "see docs/benchmarks.md", None, None)
        return
    for w in gpu["workloads"]:
        step, where = w["step_ms"], f"1 GPU, {_size(w)}, {w['ids']} ids"
        if w["rows"] >= 10_000_000:
            _ratio(
                add, f"{where}: Adagrad step / torch sparse Adagrad", "<= 0.5x", step, "ours/adagrad", "torch_sparse/adagrad", 0.5
            )
            continue
        _ratio(
            add, f"{where}: Adagrad step / torch sparse Adagrad", "<= 0.33x", step, "ours/adagrad", "torch_sparse/adagrad", 1 / 3
        )
        _ratio(add, f"{where}: Adam step / torch SparseAdam", "<= 0.33x", step, "ours/adam", "torch_sparse/adam", 1 / 3)
        _ratio(add, f"{where}: Adam step / torch fused dense Adam", "< 1x", step, "ours/adam", "torch_dense/adam", 0.999)
        _ratio(add, f"{where}: row-wise Adagrad step / Adagrad step", "<= 1x", step, "ours/rowwise_adagrad", "ours/adagrad", 1.0)
        _ratio(add, f"{where}: bf16 Adagrad step / float32", "<= 1.2x", step, "ours/adagrad_bf16", "ours/adagrad", 1.2)
        lookup = w.get("lookup_ms", {})
        _ratio(add, f"{where}: lookup (grad mode) / F.embedding", "<= 1.5x", lookup, "ours, grad mode", "torch F.embedding", 1.5)
        for u in w.get("update", []):
            add(f"{where}: fused {LABEL[u['family']]} update bandwidth / device copy", ">= 50%", 100 * u["fraction_of_copy"],
                u["fraction_of_copy"] >= 0.5, unit="%")  # fmt: skip
        if w.get("syncs"):
            syncs = max(w["syncs"][name] for name in w["syncs"] if name.startswith("ours/"))
            add(f"{where}: host syncs in a one-process step (most of any optimizer)", "0", syncs, syncs == 0, unit="")
        if w.get("kernels") and w.get("loss_kernels") is not None:
            kernels = w["kernels"]["ours/adagrad"] - w["loss_kernels"]
            add(f"{where}: CUDA kernels of an Adagrad step, the loss's apart", f"<= {MAX_KERNELS}", kernels,
                kernels <= MAX_KERNELS, unit="")  # fmt: skip


def collection_targets(gpu: dict, add: Add) -> None:
    """Issue 32's many-tables targets."""
    many = gpu.get("collection")
    if not many:
        return
    where = f"1 GPU, {many['tables']} tables of {many['rows'] / 1e3:g}k x {many['dim']}"
    _ratio(add, f"{where}: collection step (row-wise Adagrad) / {many['tables']} torch sparse tables (Adagrad)", "<= 0.2x",
           many["step_ms"], "ours/rowwise_adagrad", "torch_sparse/adagrad", 0.2)  # fmt: skip
    kernels = many.get("kernels", {})
    many_tables, two = "ours/rowwise_adagrad", "ours/rowwise_adagrad, 2 tables"
    if many_tables in kernels and two in kernels:
        loss = many.get("loss_kernels") or {}  # results before it was measured count the loss in
        ours = {label: kernels[label] - loss.get(label, 0) for label in (many_tables, two)}
        if min(ours.values()) <= 0:  # 2026-11-27: a sum per feature, whose backward on the collection's views
            ours, apart = {label: kernels[label] for label in ours}, ""  # launched fewer kernels than on plain tensors
        else:
            apart = ", the loss's apart" if loss else ""
        ratio = ours[many_tables] / ours[two]
        add(f"{where}: kernels of a step / a 2-table collection's{apart}", "<= 1.2x", ratio, ratio <= 1.2)
    if "ours/rowwise_adagrad" in many.get("syncs", {}):
        syncs = many["syncs"]["ours/rowwise_adagrad"]
        add(f"{where}: host syncs in a collection step", "0", syncs, syncs == 0, unit="")


def _ratio(add: Add, name: str, goal: str, times: dict, ours: str, theirs: str, most: float) -> None:
    if ours in times and theirs in times:
        ratio = times[ours] / times[theirs]
        add(name, goal, ratio, ratio <= most)


def _size(w: dict) -> str:
    return f"{w['rows'] / 1e6:g}M x {w['dim']}, {w['batch']:,} ids"


def markdown(gpu: dict) -> list[str]:
    lines = ["", "### One GPU", ""]
    if "skipped" in gpu:
        return [*lines, f"Not run: {gpu['skipped']}."]
    if "workloads" not in gpu:
        return [*lines, "Measured with an earlier version of the GPU benchmark: run `bench.py --only gpu` again."]
    lines.append(f"{gpu['device_name']}, torch {gpu['torch']}, triton {gpu['triton']}. A step is forward + backward + "
                 "optimizer step + zero_grad, median of CUDA-event times; kernels per step count the loss's own apart.")  # fmt: skip
    for w in gpu["workloads"]:
        step = w["step_ms"]
        lines += ["", f"**{_size(w)}, {w['ids']} ids** ({w['distinct']:,} distinct; the loss alone: "
                      f"{w.get('loss_kernels', 'n/a')} kernels)", "",
                  "| method | step (ms) | / torch sparse | kernels | host syncs |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        for name, ms in step.items():
            family = name.split("/")[1].removesuffix("_bf16")
            base = step.get(f"torch_sparse/{family}")
            vs = f"{ms / base:.2f}x" if base else "-"
            lines.append(f"| {name} | {ms:.3f} | {vs} | {w['kernels'].get(name, 'n/a')} | {w['syncs'].get(name, 'n/a')} |")
        if "lookup_ms" in w:
            lines += ["", "| lookup | ms |", "|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in w["lookup_ms"].items()]
        if w.get("update"):
            lines += ["", "| fused update alone | distinct rows | bytes it must move | ms | GB/s | copy GB/s | share of copy |",
                      "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
            for u in w["update"]:
                lines.append(f"| {LABEL[u['family']]} | {u['distinct_rows']:,} | {u['bytes'] / 2**20:.1f} MiB | "
                             f"{u['update_ms']:.3f} | {u['update_gbps']:.0f} | {u['copy_gbps']:.0f} | "
                             f"{100 * u['fraction_of_copy']:.0f}% |")  # fmt: skip
        if w.get("profile_ours_adagrad"):
            lines += ["", "<details><summary>Profile of our Adagrad step</summary>", "", "```",
                      *w["profile_ours_adagrad"], "```", "", "</details>"]  # fmt: skip
        for name, table in w.get("host_profile", {}).items():
            lines += ["", f"<details><summary>Host side of a step, {name} (by own CPU time)</summary>", "", "```",
                      *table, "```", "", "</details>"]  # fmt: skip
    many = gpu.get("collection")
    if many:
        lines += ["", f"**{many['tables']} tables of {many['rows'] / 1e3:g}k x {many['dim']}, {many['batch']:,} ids per table "
                      "per step** (one collection, or as many torch tables)", "",
                  "| method | step (ms) | kernels | host syncs |", "|---|---:|---:|---:|"]  # fmt: skip
        for name in sorted(set(many["step_ms"]) | set(many.get("kernels", {}))):
            ms = many["step_ms"].get(name)
            lines.append(f"| {name} | {f'{ms:.3f}' if ms is not None else '-'} | {many['kernels'].get(name, 'n/a')} | "
                         f"{many['syncs'].get(name, 'n/a')} |")  # fmt: skip
    return lines
