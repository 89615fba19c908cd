# kvstore: `make run` starts a local cluster and shows it working; `make test` runs everything.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit chart proto clean venv e2e

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/kvstore --log-level warning demo
	$(BIN)/kvstore --log-level warning bench replay --synth 4 --quick --sessions 4

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests

chart: $(STAMP)
	$(BIN)/python scripts/check_chart.py

test: lint typecheck chart unit

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

e2e:
	bash scripts/e2e.sh

clean:
	rm -rf $(VENV) .venv-e2e build *.egg-info .mypy_cache .ruff_cache .pytest_cache
