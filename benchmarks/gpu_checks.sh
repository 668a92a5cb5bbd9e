#!/usr/bin/env bash
# The checks that need a GPU, in one go (about 7.5 minutes on one H200; the sections' time limits add up to 10): the
# CUDA tests (every test of a GPU path takes a device or has "cuda" in its name: the Triton kernels compiled, the
# one-process step under sync debug mode "error", 2 and 3 ranks sharing the GPU over gloo (tests/test_shared_gpu.py),
# the Trainer's captured step: 50 steps with a checkpoint and a resume, bitwise the eager fit) and the sm_90 compile
# check with the machine's Triton; Trainer.fit throughput captured, eager and with Lightning's ddp and torch's sparse
# tables (benchmarks/gpu_trainer.py, $OUT/trainer.json); a 2-rank step on the shared GPU against one rank's, with the
# host syncs per step (benchmarks/gpu_ranks.py, $OUT/ranks.json); a Lightning fit on one GPU (NCCL); a CUDA-graph
# capture of a one-process step against the eager step (benchmarks/gpu_capture.py); the GPU benchmark
# (benchmarks/gpu.py) into a copy of benchmarks/results/bench.json; and a step's host time against its device
# time, with Python and kernel profiles (benchmarks/gpu_host.py).
# Run from the repository root on a machine with CUDA, torch and lightning installed:
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
#
# then `python benchmarks/report.py $OUT/bench.json` here renders the page from what came back.
# Wheels in .whl/ (e.g. jsonargparse for LightningCLI, where the machine lacks it) are installed first;
# fetch them here with `.venv/bin/python -m pip download -q -d .whl jsonargparse docstring_parser typeshed_client`
# and carry .whl to the GPU machine.
#
# Every section runs; the script exits non-zero if any failed or ran out of its time (timeout's 124, or 137 where the
# section ignored the TERM and was killed 10 s later), and says which. SKIP="bench host" leaves those sections out
# (names: tests trainer ranks fit capture bench host), for a device budget that cannot hold them all.
set -u -o pipefail
failed=()
check() {  # check NAME: the last pipeline's status, recorded
    local status=$?
    if [ "$status" -ne 0 ]; then
        failed+=("$1 (exit $status$( (( status == 124 || status == 137 )) && echo ': out of time'))")
    fi
}
skip() {  # skip NAME: true (and says so) if SKIP names the section
    if [[ " ${SKIP:-} " == *" $1 "* ]]; then echo "== skipped: $1"; return 0; fi
    return 1
}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"

if ! skip tests; then
echo "== CUDA tests"
timeout -k 10 "${TESTS_S:-180}" python3 -m pytest -q -n "${WORKERS:-8}" -k "cuda or compiles_for_an_h100" -p no:cacheprovider \
    -o addopts="-ra" --timeout 150 tests 2>&1 | tee "$OUT/tests.log" | tail -40
check "CUDA tests"
fi

if ! skip trainer; then
echo "== Trainer.fit throughput: captured, eager, Lightning's ddp with torch's sparse tables (benchmarks/gpu_trainer.py)"
timeout -k 10 "${TRAINER_S:-90}" python3 benchmarks/gpu_trainer.py --steps "${TRAINER_STEPS:-30}" --warmup 6 \
    --out "$OUT/trainer.json" > "$OUT/trainer.log" 2>&1
check "Trainer throughput"
tail -c 3000 "$OUT/trainer.log"
fi

if ! skip ranks; then
echo "== 2 ranks sharing the GPU over gloo against 1 rank, host syncs per step (benchmarks/gpu_ranks.py)"
(cd benchmarks && timeout -k 10 "${RANKS_S:-60}" python3 gpu_ranks.py > "$OUT/ranks.json" 2> "$OUT/ranks.log")
check "shared-GPU ranks"
cat "$OUT/ranks.json"
fi

if ! skip fit; then
echo "== Lightning fit on one GPU (sparse_ddp, NCCL)"
(cd examples && timeout -k 10 "${FIT_S:-50}" python3 recommender.py fit --config recommender.yaml --trainer.accelerator gpu \
    --trainer.devices 1 --trainer.max_epochs 2 --trainer.logger false --trainer.enable_progress_bar false) 2>&1 \
    | tee "$OUT/fit.log" | tail -15
check "Lightning fit"
fi

if ! skip capture; then
echo "== CUDA graph capture of a one-process step (benchmarks/gpu_capture.py)"
timeout -k 10 "${CAPTURE_S:-50}" python3 benchmarks/gpu_capture.py > "$OUT/capture.json" 2> "$OUT/capture.log"
check "CUDA graph capture"
tail -40 "$OUT/capture.json"
fi

if ! skip bench; then
echo "== GPU benchmarks"
cp benchmarks/results/bench.json "$OUT/bench.json"
timeout -k 10 "${BENCH_S:-120}" python3 benchmarks/bench.py --only gpu --out "$OUT/bench.json" --no-report 2>&1 | tail -20
check "GPU benchmarks"
fi

if ! skip host; then
echo "== Host and device time of a step, where the host's time goes (benchmarks/gpu_host.py)"
(cd benchmarks && timeout -k 10 "${HOST_S:-50}" python3 gpu_host.py > "$OUT/host.json" 2> "$OUT/host_profile.txt")
check "host and device time"
cat "$OUT/host.json"
fi

if [ "${#failed[@]}" -gt 0 ]; then
    printf '== FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "== all sections passed"
