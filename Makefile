# Two commands on a fresh machine:  `make demo` (install, pull smollm2-135m, generate)  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: install demo test lint bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(VENV)/bin/specdecode pull $(MODEL)
	$(VENV)/bin/specdecode generate --model $(MODEL) --chat --max-tokens 128 --prompt "$(PROMPT)"

test: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: install
	$(PY) benchmarks/plain_decode.py --models smollm2-135m,qwen2.5-coder-1.5b
