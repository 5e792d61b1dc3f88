# Two set-up commands that work on a fresh machine (see README.md):
#   make demo   create .venv, install speedkit, run the embedded default recipe on the CPU
#   make test   create .venv, install speedkit with its test extra, run the tests
VENV   ?= .venv
PYTHON ?= python3
# torch 2.13.0: on this project's CPU machines pip takes the CPU build from local disk.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: demo test gpu-test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m speedkit.cli optimize --out runs/tiny-cpu

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
