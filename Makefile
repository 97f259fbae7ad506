# The two user commands: `make serve` and `make test` (both set up .venv when needed).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: serve test venv lint

venv:
	@bash scripts/setup-venv.sh

serve: venv
	$(PY) -m orchestrator.cli serve --demo --baseline

test: venv lint
	$(PY) -m pytest -ra

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
