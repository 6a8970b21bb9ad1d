# One venv per checkout. torch is pinned first so pip never swaps in a different build; on a GPU
# machine, install your own torch into .venv first (or set TORCH_SPEC) and it is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 4
CONFIG ?= train_configs/debug_paro.toml

.PHONY: install test test-all train estimate bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test,train]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -m "not slow" tests

test-all: install
	$(PY) -m pytest -q tests

# The trainer resumes from the latest checkpoint in its dump folder; `make train` starts the debug
# run afresh unless RESUME=1.
RESUME ?= 0
train: install
	@if [ "$(RESUME)" != 1 ] && [ "$(CONFIG)" = train_configs/debug_paro.toml ]; then rm -rf outputs/debug_paro; fi
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py --job.config_file $(CONFIG)

estimate: install
	$(PY) -m tools.estimate --model llama7b --world 64 --group 8

bench: install
	$(PY) -m tools.bench_vs_fsdp2

clean:
	rm -rf $(VENV) outputs .pytest_cache
