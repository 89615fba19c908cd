# kvstore: `make run` starts a local cluster and shows it working; `make test` runs everything.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit integration chart proto clean venv e2e gpu-bundle

$(STAMP): pyproject.toml client/pyproject.toml
	@echo "== $(VENV): installing kvstore-client and kvstore-cache (editable) with the dev and bench extras; about a minute the first time"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# venvs made before the rename hold the old distribution name: drop it
	$(BIN)/python -m pip uninstall -q -y kvstore 2>/dev/null || true
	$(BIN)/python -m pip install --progress-bar on -e ./client -e '.[dev,bench]'
	touch $(STAMP)
	@echo "== installed: $(BIN)/kvstore"

venv: $(STAMP)

run: $(STAMP)
	@echo "== kvstore demo: a local cluster, a turn, its repeat and a follow-up turn"
	$(BIN)/kvstore --log-level warning demo
	@echo "== kvstore bench replay: 4 synthetic agent sessions, one at a time, in 2 MiB blocks (512 tokens), against a fresh local cluster whose cache is sized to evict"
	@echo "   (the verdict weighs this machine's load bandwidth against a GPU prefilling 10,000 tokens/s of a Llama-3-8B)"
	$(BIN)/kvstore --log-level warning bench replay --synth 4 --quick --sessions 1 \
	  --bytes-per-token 4096

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Pure state machines and codecs, no processes: seconds.
unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# Real daemons on 127.0.0.1: integration, reliability, security (tests/e2e needs the
# engines' venv: `make e2e`).
integration: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/unit --ignore=tests/e2e

chart: $(STAMP)
	$(BIN)/python scripts/check_chart.py

test: lint typecheck chart unit integration

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

e2e:
	bash scripts/e2e.sh

# dist/gpu-bundle/: the GPU check with its code and wheels, for a bare CUDA machine
# with no network (tests/gpu/README.md): `dist/gpu-bundle/run.sh` there.
gpu-bundle: $(STAMP)
	PY=$(BIN)/python bash scripts/gpu_bundle.sh

clean:
	rm -rf $(VENV) .venv-e2e build *.egg-info .mypy_cache .ruff_cache .pytest_cache
