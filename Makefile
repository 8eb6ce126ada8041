# One virtual environment for everything; `make test` and `make demo` build it on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch: the build machines' local wheel store has its CPU build. Elsewhere pip's default index gives the CUDA
# build on Linux x86_64 (several GB); TORCH_INDEX=https://download.pytorch.org/whl/cpu asks for the CPU one.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: venv demo test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/lwm demo

test: venv
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) .pytest_cache
