# Two commands a user needs (README): `make demo` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DILOCO := $(VENV)/bin/diloco

.PHONY: demo test test-fast bench benchmarks gpu-check image install clean

install: $(VENV)/.installed

# torch is pinned to the CPU build this machine type carries (constraints.txt);
# the package itself accepts a range.
# helm is not packaged by Debian: scripts/install-helm.sh fetches a pinned binary.
$(VENV)/.installed: pyproject.toml constraints.txt scripts/install-helm.sh services/contract/_codec_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,plot,hf]'
	scripts/install-helm.sh $(VENV)/bin
	touch $@

# Two pytest workers: most tests wait on the processes they start, so two keep 2 cores busy.
# Tests that change the host's network share one worker (xdist_group "host_network").
PYTEST := $(PY) -m pytest -n 2 --dist loadgroup

# Debian packages the tests use (docker-compose validates docker-compose.yml, docker.io and
# debootstrap run it: tests/test_compose_up.py); a no-op when they are installed, else it
# needs root or sudo.
test: install
	scripts/install-debian-packages.sh
	$(PYTEST)

# The suite without the tests that start clusters of real processes (marked slow): under 3
# minutes on 2 cores, for between edits. `make test` is the whole suite, what CI runs.
test-fast: install
	scripts/install-debian-packages.sh
	$(PYTEST) -m "not slow"

# 2 shards and 4 learners in four regions as local processes; prints a summary and
# writes .diloco/sim/report.json and .diloco/sim/demo.png.
demo: install
	$(DILOCO) sim --config examples/local-4-regions.yaml --plot .diloco/sim/demo.png

bench: install
	$(PY) bench/codecs.py
	$(PY) bench/overlap.py
	$(PY) bench/syncer_push.py
	$(PY) bench/syncer_scale.py

# Every figure of BENCHMARKS.md, fresh on this machine (about two hours on 2 cores); also
# writes bench/results.json and bench/plots/. `$(PY) bench/run_all.py --quick` takes minutes.
benchmarks: install
	$(PY) bench/run_all.py

# The GPU paths on this machine's GPUs, in minutes (docs/gpus.md): CUDA tests, device memory of a
# sync, a checkpoint, an export and a restore, two bf16 learners, a NCCL island, the user loop.
# Says so in one line where there is no GPU. `make gpu-check PY=python3` uses a Python that
# already has CUDA torch and this package installed instead of .venv; ARGS="--json F" keeps the figures.
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),install)
	$(PY) scripts/gpu_check.py $(ARGS)

# The image docker-compose.yml and the Helm chart run (its default image.repository and
# appVersion); push it to your registry (docs/helm.md). BASE_IMAGE=diloco-base:bookworm
# (scripts/make-base-images.sh) where no registry can be reached.
IMAGE ?= ghcr.io/decoupled-diloco/diloco:0.1.0
image:
	scripts/fill-wheelhouse.sh
	docker build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE) .

clean:
	rm -rf $(VENV) .diloco .pytest_cache
