# Two set-up commands that work on a fresh machine (see README.md):
#   make demo   create .venv, install speedkit, run the embedded default recipe on the CPU
#   make test   create .venv, install speedkit with its test extra, run the tests
VENV   ?= .venv
PYTHON ?= python3
# The model zoo's tests need torchvision, whose PyPI build imports only beside the matching torch:
# torch 2.14.1 + torchvision 0.29.1 (on this project's x86_64 machines pip takes both from local
# disk; a CUDA build that runs on the CPU). TORCH=torch==2.13.0 gives a small CPU-only install that
# runs everything but the zoo's torchvision/timm tests.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
PY      = $(VENV)/bin/python

.PHONY: demo test gpu-test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m speedkit.cli optimize --out runs/tiny-cpu

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
