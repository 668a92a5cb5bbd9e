#!/usr/bin/env bash
# The checks that need a GPU, in one go (about 6 minutes on one H100; the sections' timeouts add up to 10): the
# CUDA-parametrized tests (the Triton kernels compiled, the one-process step under sync debug mode "error", the
# Trainer's captured step: 50 steps with a checkpoint and a resume, bitwise the eager fit), a Lightning fit on one
# GPU (NCCL), the GPU benchmark (benchmarks/gpu.py) into a copy of benchmarks/results/bench.json, a CUDA-graph
# capture of a one-process step against the eager step (benchmarks/gpu_capture.py), a step's host time against its
# device time, with Python and kernel profiles (benchmarks/gpu_host.py), and Trainer.fit throughput captured, eager
# and with Lightning's ddp and torch's sparse tables (benchmarks/gpu_trainer.py, $OUT/trainer.json).
# It exits 1 if a test failed or a section failed or ran out of time (each says so: "FAILED: ...").
# Run from the repository root on a machine with CUDA, torch and lightning installed:
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
#
# then `python benchmarks/report.py $OUT/bench.json` here renders the page from what came back.
# Wheels in .whl/ (e.g. jsonargparse for LightningCLI, where the machine lacks it) are installed first;
# fetch them here with `.venv/bin/python -m pip download -q -d .whl jsonargparse docstring_parser typeshed_client`
# and carry .whl to the GPU machine.
set -u -o pipefail
FAILED=()
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"

echo "== CUDA tests"
timeout "${TESTS_S:-170}" python3 -m pytest -q -n "${WORKERS:-8}" -k cuda -p no:cacheprovider -o addopts="-ra" --timeout 100 tests 2>&1 \
    | tee "$OUT/tests.log" | tail -40 || FAILED+=("CUDA tests")

echo "== Lightning fit on one GPU (sparse_ddp, NCCL)"
(cd examples && timeout "${FIT_S:-50}" python3 recommender.py fit --config recommender.yaml --trainer.accelerator gpu \
    --trainer.devices 1 --trainer.max_epochs 2 --trainer.logger false --trainer.enable_progress_bar false) 2>&1 \
    | tee "$OUT/fit.log" | tail -15 || FAILED+=("Lightning fit")

echo "== GPU benchmarks"
cp benchmarks/results/bench.json "$OUT/bench.json"
timeout "${BENCH_S:-140}" python3 benchmarks/bench.py --only gpu --out "$OUT/bench.json" --no-report 2>&1 | tail -20 \
    || FAILED+=("GPU benchmarks")

echo "== CUDA graph capture of a one-process step (benchmarks/gpu_capture.py)"
timeout "${CAPTURE_S:-90}" python3 benchmarks/gpu_capture.py 2>&1 | tee "$OUT/capture.json" | tail -40 || FAILED+=("capture")

echo "== Host and device time of a step, where the host's time goes (benchmarks/gpu_host.py)"
(cd benchmarks && timeout "${HOST_S:-60}" python3 gpu_host.py > "$OUT/host.json" 2> "$OUT/host_profile.txt") || FAILED+=("host")
cat "$OUT/host.json"

echo "== Trainer.fit throughput: captured, eager, Lightning's ddp with torch's sparse tables (benchmarks/gpu_trainer.py)"
timeout "${TRAINER_S:-100}" python3 benchmarks/gpu_trainer.py --steps "${TRAINER_STEPS:-30}" --warmup 6 --out "$OUT/trainer.json" \
    > "$OUT/trainer.log" 2>&1 || FAILED+=("Trainer throughput")
tail -c 3000 "$OUT/trainer.log"

if ((${#FAILED[@]})); then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "all GPU checks passed"
