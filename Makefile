# One venv per checkout. torch is pinned first so pip never swaps in a different build; on a GPU
# machine, install your own torch into .venv first (or set TORCH_SPEC) and it is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4
CONFIG ?= train_configs/debug_paro.toml

.PHONY: install lint test test-all test-compat train estimate bench bench-compiled bench-fsdp2 clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test,train,torchtitan,hf,trl]'
	touch $@

install: $(VENV)/.installed

# pyflakes and pycodestyle over the whole repository (pyproject.toml [tool.ruff])
lint: install
	$(PY) -m ruff check .

# Two pytest workers, one test file each at a time (a file's worlds are module fixtures): the
# suite's 4-rank worlds leave a quarter of two cores idle (start-up, rank 0's references, waits),
# which a second file fills (711 s -> 586 s on 2 cores). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: install
	$(PY) -m pytest -q -m "not slow" $(XDIST) tests

test-all: install
	$(PY) -m pytest -q $(XDIST) tests

# The compatibility subset under another torch: `make test-compat TORCH_SPEC=torch==2.11.0` builds
# .venv-compat/torch-2.11.0 (releases other than 2.13.0 come as CUDA wheels, about 5 GB; they run
# on CPU with gloo) and runs the tests marked `compat`: all 27 strategies exact on 2x2 with
# accumulation, the trainer with a checkpoint resume and a compiled run, the torch workarounds.
COMPAT_VENV = .venv-compat/$(subst ==,-,$(TORCH_SPEC))
test-compat:
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_SPEC)'.split('==')[-1])" 2>/dev/null \
		|| $(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[test,train]' "$(TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pytest -q -m "compat and not slow" -p no:cacheprovider tests

# The trainer resumes from the latest checkpoint in its dump folder; `make train` starts the debug
# run afresh unless RESUME=1 (--job.fresh: the previous outputs go only once the config is valid).
# The config is checked for NPROC ranks before torchrun starts: a bad one is one line, status 2.
RESUME ?= 0
FRESH = $(if $(filter-out 1,$(RESUME)),$(if $(filter train_configs/debug_paro.toml,$(CONFIG)),--job.fresh))
train: install
	@$(PY) train.py --job.config_file $(CONFIG) --check-config --world $(NPROC)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py --job.config_file $(CONFIG) $(FRESH)

estimate: install
	$(PY) -m tools.estimate --model llama7b --world 64 --group 8

# The headline benchmark (README "Benchmark"): PaRO's strategies vs FSDP2 and DDP on an emulated
# 2 nodes x 2 ranks cluster at 200 Mbit/s (network namespaces: needs root), full training with
# A = 1 and 4, then partial training (1 of 4 layers trainable). About 4 minutes on 2 cores.
BENCH_OUT ?= outputs/bench
bench: install
	$(PY) -m tools.bench --out-dir $(BENCH_OUT)/full
	$(PY) -m tools.bench --quick --trainable 0.0625 --out-dir $(BENCH_OUT)/partial

# Compiled PaRO on the emulator at 1 Gbit/s: per strategy eager, compiled, each graph
# pass alone, all passes; FSDP2 eager and + per-block compile; a link timeline PNG per variant.
# Root; roughly half an hour on 2 cores (21 compiled variants' first steps; an estimate).
bench-compiled: install
	$(PY) -m tools.bench --compiled --out-dir $(BENCH_OUT)/compiled

# PaRO GGG / III vs FSDP2 full shard / HSDP on 4 plain gloo ranks (no emulator, no root)
bench-fsdp2: install
	$(PY) -m tools.bench.vs_fsdp2

clean:
	rm -rf $(VENV) .venv-compat outputs .pytest_cache
