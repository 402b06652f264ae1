# paramserver: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODE ?= sync
SHARDS ?= 2
WORKERS ?= 2
PORT ?= 50051
DEMO_ARGS ?=

.PHONY: install demo test lint proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel (an open range would pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## demo: 2 shards + 2 workers train the CNN on scikit-learn's digits (MODE=sync|async)
demo: $(STAMP)
	$(PY) -m worker.demo --mode $(MODE) --shards $(SHARDS) --workers $(WORKERS) --port $(PORT) $(DEMO_ARGS)

## test: the whole suite (unit, servicer, end-to-end with real servers on port 0)
test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check paramserver worker tests
	$(VENV)/bin/ruff format --check paramserver worker tests
	$(VENV)/bin/mypy paramserver worker

## proto: regenerate paramserver/v1 from protos/ (committed; tests check it is current)
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/paramserver/v1/ps.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
