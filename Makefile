# Each target sets itself up from a fresh clone: a .venv is created and the requirements installed, with every
# extra the test suite needs, the first time (and again whenever requirements.txt or pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Offline-safe defaults: img2dataset's albumentations import checks for updates unless told not to,
# wandb never needs the network in tests.
export NO_ALBUMENTATIONS_UPDATE := 1

.PHONY: setup test test-demo test-order test-threads test-margins check demo docs studio clean

setup: $(STAMP)

# TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the CPU build of the pinned torch first (on a
# CPU-only Linux machine the package index's torch is the CUDA build, with several GB of NVIDIA packages).
TORCH_INDEX ?=

# pyproject.toml's extras: the studio, the WD14 tagger, the download stage's engines, the test tools.
EXTRAS := studio,caption,engines,test

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --index-url $(TORCH_INDEX) "$$(grep '^torch==' requirements.txt)")
	$(PY) -m pip install --quiet --no-compile -e ".[$(EXTRAS)]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true  # as pip's own pass, past files of newer Pythons
	touch $(STAMP)

# The bytecode of the repository's own modules, written once before a run (and again for what changed since):
# the suite starts hundreds of Python processes, and with PYTHONDONTWRITEBYTECODE set each one would compile
# every module it imports. (The packages' bytecode is compiled above on all cores, pip's own pass being serial.)
BYTECODE := $(PY) -m compileall -q -j 0 sd pipeline bench demo tests $(wildcard *.py) > /dev/null

# Both targets spread test files over two pytest-xdist workers (--dist loadfile keeps a file's module
# fixtures in one worker) in the order tests/conftest.py sets: the demo chain first, beside the rest.
# XDIST=0 runs everything in this process instead.
XDIST ?= 2
PYTEST := $(PY) -m pytest $(if $(filter 0,$(XDIST)),,-n $(XDIST) --dist loadfile --no-loadscope-reorder)

# The whole suite (what CI runs): every tier, the demo chain included.
test: $(STAMP)
	$(BYTECODE)
	$(PYTEST)

# The learned demo chains: at 32 px (steps 1-6, about 3 minutes) and at 64 px with every step (about 40 minutes
# on 2 cores), besides the rest of tests/e2e; make test runs the chain's smoke (a few iterations a step).
test-demo: $(STAMP)
	$(PY) -m pytest --full-demo tests/e2e

# The fast tier for the edit-test loop: tests/unit and the short tests of tests/integration.
check: $(STAMP)
	$(BYTECODE)
	$(PYTEST) -m "not slow" tests/unit tests/integration

# Tests independent of the machine and the order (docs/testing.md): the suite in a shuffled order
# (ORDER=reverse or random:SEED), in one process with two threads, and the learned outcomes' margins on
# AVX2 and AVX-512 kernels at one and two threads (MARGINS_ARGS=--full-demo adds the demo chains, 32 and 64 px).
ORDER ?= random:1
test-order: $(STAMP)
	$(PYTEST) --test-order $(ORDER)

test-threads: $(STAMP)
	OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 $(PY) -m pytest

test-margins: $(STAMP)
	$(PY) tests/margins.py $(MARGINS_ARGS)

# The whole system on built-in synthetic data: outputs under runs/demo/ (see demo/run.sh).
demo: $(STAMP)
	PY=$(PY) bash demo/run.sh

# The web studio on http://127.0.0.1:7860 (docs/studio.md); STUDIO_ARGS passes flags (--port, --root, --listen).
studio: $(STAMP)
	$(PY) SD_Studio.py $(STUDIO_ARGS)

# docs/config.md from the config fields' own docs (a test fails while it is out of date).
docs: $(STAMP)
	$(PY) -m sd.train.config_docs docs/config.md

clean:
	rm -rf $(VENV) .pytest_cache
