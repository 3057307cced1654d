# The two commands of the README's Quickstart:
#   make demo   - the main job: the default model pair (auto engine, auto policy), a streamed completion with stats
#   make test   - the test suite (fast, hermetic: tiny random models, no network)
# Both create the virtualenv on first use (torch pinned to the CPU build 2.13.0).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test slow clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/disco demo --prompt 'def fib(n):' --max-new-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q

slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV)
