# The README's two set-up commands, each working on a fresh machine (Python >= 3.10, no GPU):
#   make demo   .venv with torch's CPU build and speedkit; the embedded tiny recipe optimized on the CPU
#   make test   .venv with speedkit and its test extra; ruff, then the tests (GPU tests skip without CUDA)
# Sizes and times measured on the project's 2-core machine are in README.md ("Set up").
VENV   ?= .venv
PYTHON ?= python3
# torch's CPU build: no CUDA libraries, no Triton (on this project's machines pip takes it from local disk).
DEMO_TORCH ?= torch==2.13.0
# The test extra brings the zoo's libraries; torchvision (and timm, which needs it) is on PyPI only as CUDA
# builds, each loading only beside the torch it was built with. So the tests install that pair, torch's CUDA
# build (it runs on the CPU; with its CUDA libraries and Triton it is the bulk of the install).
TEST_TORCH ?= torch==2.14.1 torchvision==0.29.1
PY      = $(VENV)/bin/python

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# a venv that already has a torch (make test's) keeps it
$(VENV)/.demo-installed: pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(DEMO_TORCH)
	$(PY) -m pip install -q -e .
	touch $@

# one resolver call, so the test extra's torchvision is the one that matches the pinned torch
$(VENV)/.test-installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TEST_TORCH) -e ".[test]"
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) -m speedkit optimize --out runs/tiny-cpu

# lint (ruff: rules and format, configured in pyproject.toml), then the tests (the layering check among them)
test: $(VENV)/.test-installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q --durations=25

clean:
	rm -rf $(VENV) runs .pytest_cache
