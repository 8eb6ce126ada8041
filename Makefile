# One virtual environment for everything; `make test` and `make demo` build it on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch: the build machines' local wheel store has its CPU build. Elsewhere pip's default index gives the CUDA
# build on Linux x86_64 (several GB); TORCH_INDEX=https://download.pytorch.org/whl/cpu asks for the CPU one.
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: venv browser demo test test-fast clean

# the package for `make demo`; its test extras (the VAE, Atari and play paths, pytest) for `make test`
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/lwm demo

# lwm play's browser tests drive Debian's chromium (Playwright, no browser download): installed here where this is
# root with apt-get; elsewhere the tests are skipped and say why
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
	  >/dev/null; } || echo "make: chromium not installed (needs root and apt-get): lwm play's browser tests are skipped"

test: $(VENV)/.dev browser
	$(PY) -m pytest -n 2 -q tests

# the unit tier, for the edit-test loop: the tests not marked slow (under 3 minutes on 2 cores)
test-fast: $(VENV)/.dev
	$(PY) -m pytest -n 2 -q -m unit tests

clean:
	rm -rf $(VENV) .pytest_cache
