# Two entry points for a fresh machine (see README.md):
#   make demo   create .venv, install streamrl, run the demo
#   make test   create .venv, install streamrl with every extra, lint, type-check and run the tests, then
#               install the wheel into a fresh venv and run the smoke run from the shipped checkpoint
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS_TEST := alfworld,vllm,ray,dev,models

.PHONY: demo test install install-test lint typecheck pytest wheel-smoke clean

install:
	scripts/install.sh

install-test:
	scripts/install.sh $(EXTRAS_TEST)

demo: install
	$(VENV)/bin/streamrl demo

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck:
	$(VENV)/bin/mypy utils envs agents sft algorithms evaluation cli

pytest:
	scripts/pytest.sh

wheel-smoke:
	scripts/wheel_smoke.sh

test: install-test lint typecheck pytest wheel-smoke

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
