# `make demo` and `make test` set up a local virtual environment first.
PYTHON ?= python3
VENV ?= .venv
# torch is pinned through this variable; a CPU build of 2.13.0 is what CI installs.
TORCH_VERSION ?= 2.13.0
EXTRAS ?= test,dgl

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
# The GPU machine's Triton (torch 2.11 ships 3.6), apart from the venv's packages: the suite compiles the kernels for
# sm_90 with it as well as with its own (tests/test_kernels.py); nothing else imports it.
GPU_TRITON_VERSION ?= 3.6.0
GPU_TRITON_STAMP := $(VENV)/triton-3.6/.installed-$(GPU_TRITON_VERSION)

export OMP_NUM_THREADS ?= 1
export DGLBACKEND ?= pytorch

.PHONY: setup demo demo-plain dlrm graphs lint test docs bench clean

setup: $(STAMP) $(GPU_TRITON_STAMP)

# TorchRec, for the test of its KeyedJaggedTensor as a collection's input: torchrec 1.8.0 pins a torchmetrics and a CUDA
# fbgemm-gpu that this environment must not take, so it and what it imports go in without their dependencies
# (fbgemm-gpu-cpu 1.8.0 is the release built for torch 2.13; tensordict 0.15 loads with it).
TORCHREC := "torchrec==1.8.0" "fbgemm-gpu-cpu==1.8.0" "tensordict==0.15.3" "pyvers==0.2.3" "cloudpickle>=3" \
	"pyre-extensions==0.0.32" "typing-inspect==0.9.0" "mypy-extensions>=1"

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet --no-deps $(TORCHREC)
	touch $@

$(GPU_TRITON_STAMP): | $(STAMP)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/triton-3.6 "triton==$(GPU_TRITON_VERSION)"
	touch $@

demo: $(STAMP)
	cd examples && ../$(PY) recommender.py fit --config recommender.yaml

# The same kind of training without Lightning: DistMult on WN18RR with torch.distributed alone.
demo-plain: $(STAMP)
	$(PY) examples/train_plain_torch.py --world-size 2

# DLRM with 26 sparse features in one SparseEmbeddingCollection (examples/dlrm), 2 CPU processes.
dlrm: $(STAMP)
	cd examples/dlrm && ../../$(PY) main.py fit --config config.yaml

# GraphSAGE on learnable node rows and DeepWalk with DGL (examples/dgl), 2 CPU processes, about 2 minutes.
graphs: $(STAMP)
	cd examples/dgl && ../../$(PY) sage.py fit --config sage.yaml && ../../$(PY) deepwalk.py fit --config deepwalk.yaml

# ruff's rules and line length are in pyproject.toml; `ruff format .` fixes what format --check finds.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (pytest-xdist), each taking the next test as it finishes one; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2

test: lint $(GPU_TRITON_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1

# The documentation site (MkDocs, strict: any warning fails) into site/; `mkdocs serve` to browse it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# The benchmark suite (about 13 minutes on 2 cores; run it on an idle machine): writes
# benchmarks/results/bench.json, the plots and the results block of docs/benchmarks.md.
# BENCH_ARGS="--quick" for a smoke run, "--device cuda" to add the GPU section, "--only SECTION" to measure one section again.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS),bench]" "torch==$(TORCH_VERSION)"
	$(PY) -W ignore benchmarks/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build site *.egg-info
