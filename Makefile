# One virtual environment for everything; `make test` and `make demo` build it on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch (pip finds it on the build machines' local wheel store; elsewhere it downloads).
TORCH  ?= torch==2.13.0

.PHONY: venv demo test clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/lwm demo

test: venv
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) .pytest_cache
