# paramserver: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODE ?= sync
SHARDS ?= 2
WORKERS ?= 2
PORT ?= 0
MODEL ?= cnn
DATA ?= memory
DEMO_ARGS ?=
# make test's processes: most tests wait on servers, sockets and subprocesses, so two share two cores well
# (4.8 min against 6.8 in one on this 2-core machine); PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint proto clean bench bench-peers bench-smoke gpu-check stress deploy-check image image-test netns-test netns-clean monitoring-test js-test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU wheel (an open range would pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# deepctr-torch for tests/test_third_party.py, without its declared dependencies (it uses only torch, tqdm and
	# scikit-learn, all installed above; the others would pull more).
	$(PY) -m pip install -q --no-deps deepctr-torch==0.3.0
	touch $(STAMP)

install: $(STAMP)

## demo: 2 shards + 2 workers train the CNN on scikit-learn's digits (MODE=sync|async|ssp; DATA=sharded: streamed
## from shards over HTTP, warmup-cosine); MODEL=recsys: a recommendation job from the command line (planted click logs
## as Criteo files, ps-prepare --format criteo, ps-server, two ps-worker --model dlrm; AUC against local training);
## MODEL=online: continuous training (log files landing, ps-prepare --follow, two ps-worker --follow, ps-serve)
demo: $(STAMP)
	$(PY) -m worker.demos.demo --mode $(MODE) --shards $(SHARDS) --workers $(WORKERS) --port $(PORT) --model $(MODEL) --data $(DATA) $(DEMO_ARGS)

## test: the whole suite (unit, servicer, end-to-end with real servers on port 0)
test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

## lint: ruff, mypy, and the structure rules (tools/check_structure.py: no import circle in worker/, no test importing
## a test module, no function over 80 lines or module over 500 in paramserver/ and worker/)
lint: $(STAMP)
	$(VENV)/bin/ruff check paramserver worker tests bench deploy tools
	$(VENV)/bin/ruff format --check paramserver worker tests bench deploy tools
	$(VENV)/bin/mypy paramserver worker tools
	$(PY) tools/check_structure.py

## proto: regenerate paramserver/v1 from protos/ (committed; tests check it is current)
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/paramserver/v1/ps.proto

## bench-smoke: the benchmark suite's quick run (about a minute) checked by tests/test_bench_smoke.py
bench-smoke: $(STAMP)
	PS_BENCH_SMOKE=1 $(PY) -m pytest tests/test_bench_smoke.py -q

## gpu-check: the worker's CUDA path against the CPU's, on real shards (tests/test_gpu.py: dense, BatchNorm buffers,
## autocast, sparse rows, a host group, the trainer); every test skips without a CUDA device. Where the project is not installed:
## PYTHONPATH=. python -m pytest tests/test_gpu.py -v
gpu-check: $(STAMP)
	$(PY) -m pytest tests/test_gpu.py -v

## bench-peers: TorchRec 1.8.0 and FBGEMM 1.8.0 (CPU) for make bench's sparse_peer section (skipped without them).
## A target, not an extra: pip cannot leave out an extra's dependencies, and theirs would pull another torch (torchrec
## asks for fbgemm-gpu unpinned: the CUDA build). These load with torch 2.13.0 (1.7 and 1.9 fail with undefined
## symbols); the second line is what torchrec imports, pinned, also without dependencies (checked in a bare venv with
## torch alone). pip then warns that torchrec's fbgemm-gpu and torchmetrics are missing: neither is imported.
PEER_PINS := fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
PEER_IMPORT_PINS := tensordict==0.15.3 cloudpickle==3.1.3 pyvers==0.2.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	mypy-extensions==1.2.0
bench-peers: $(STAMP)
	$(PY) -m pip install -q --no-deps $(PEER_PINS)
	$(PY) -m pip install -q --no-deps $(PEER_IMPORT_PINS)

## bench: the benchmark suite against its baselines, in one run -> bench/results/latest.{json,md,png}
bench: $(STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)

## stress: SIGKILL shards and workers at random moments (async and sync, over shared memory and the data socket),
## then primaries, backups and workers of --replicas 2 jobs (a real etcd; failover times in the table); exact
## arithmetic checks that no acknowledged push is lost or applied twice (about 4 minutes; STRESS_ARGS=--seed N);
## then 50 shards stopping on an error under two busy loops, none printing a traceback (tests/test_stop_on_error.py)
stress: $(STAMP)
	$(PY) bench/stress_kills.py $(STRESS_ARGS)
	PS_STRESS=1 $(PY) -m pytest tests/test_stop_on_error.py -q

## deploy-check: render the k8s overlays, validate schemas offline, checkov, tests/test_manifests.py
deploy-check: $(STAMP)
	bash deploy/deploy-check.sh

IMAGE_TOOLS_OK = command -v podman >/dev/null && command -v buildah >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null
IMAGE_TOOLS = $(IMAGE_TOOLS_OK) || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y podman buildah runc debootstrap; }

## image: build the container image (deploy/Dockerfile) with podman, offline (root; see deploy/IMAGE.md)
image: $(STAMP)
	@$(IMAGE_TOOLS)
	bash deploy/image/build.sh

## image-test: build the image, then 2 shard + 2 worker containers train on digits (accuracy >= 0.95)
image-test: $(STAMP)
	@$(IMAGE_TOOLS)
	bash deploy/image-test.sh

## netns-test: multi-host tests on network namespaces (root; builds and removes its own psnt<pid>-* namespaces)
netns-test: $(STAMP)
	@command -v nft >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nftables; }
	PS_MULTIHOST=1 $(PY) -m pytest tests/test_multihost.py tests/test_bench_link.py tests/test_partition.py -v -s

## monitoring-test: promtool checks and unit-tests deploy/monitoring/alerts.yml; a real Prometheus scrapes a live
## 2-shard job (tests/test_monitoring.py). Installs Debian's prometheus package if prometheus/promtool are missing.
monitoring-test: $(STAMP)
	@{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; }
	promtool check rules deploy/monitoring/alerts.yml
	cd deploy/monitoring && promtool test rules alerts.test.yml
	PS_MONITORING=1 $(PY) -m pytest tests/test_monitoring.py -v -s

## js-test: the JavaScript client (clients/js/, written from protos/paramserver/v1/ alone) checks the contract's
## vectors and trains against real shards; installs Debian's nodejs and npm if node is missing.
js-test: $(STAMP)
	@command -v node >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs; }
	@# NodeSource's nodejs bundles npm (and conflicts with Debian's npm package); Debian's needs it separately.
	@command -v npm >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y npm; }
	cd clients/js && npm ci --no-audit --no-fund
	PS_JS=1 $(PY) -m pytest tests/test_js_client.py tests/test_contract.py -v

## netns-clean: remove namespaces and /etc/netns folders left by a crashed netns-test
netns-clean:
	$(PY) deploy/netns/netlab.py cleanup

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
