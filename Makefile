# Two entry points, each safe to run on a fresh machine: `make quickstart` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUNDLE := elastic_jupyter/static/dashboard.js
CHROMIUM ?= $(shell command -v chromium || echo /usr/bin/chromium)
SLURMD ?= $(shell command -v slurmd || echo /usr/sbin/slurmd)
SSHD ?= /usr/sbin/sshd
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup quickstart notebooks test benchmark clean

setup: $(STAMP) $(BUNDLE)

# torch is pinned to the CPU build that lies on this machine's disk; an unpinned torch would
# pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH jupyter labextension develop --overwrite .  # rebuilds show at once
	touch $(STAMP)

# `pip install` builds the front end; this rebuilds it when its TypeScript changed since.
$(BUNDLE): $(wildcard labextension/src/*.ts labextension/src/*/* labextension/style/* labextension/schema/*) package.json
	npm install --no-audit --no-fund
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH npm run build

# The browser tests drive Debian's Chromium (no browser download); install it if missing.
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq chromium

# The Slurm tests start a one-machine Slurm of Debian's packages (tests/slurm_cluster.py);
# the multi-host tests an sshd per network namespace (tests/netns_hosts.py).
$(SLURMD) $(SSHD):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq slurm-wlm munge openssh-server

# The main job: the quick-start notebook, headless, on scikit-learn's digits; it also writes
# the loss curve with its resize and checkpoint markers to notebooks/loss.png.
quickstart: setup
	cd notebooks && ../$(VENV)/bin/ipython --colors=nocolor 01_quickstart.ipynb

# Every teaching notebook, headless, each checking what it teaches (notebook 6 on a test Slurm).
notebooks: setup $(SLURMD)
	$(PY) -m pytest -q tests/test_notebooks.py \
		tests/test_slurm.py::test_the_slurm_notebook_drains_a_preempted_engine_job

test: setup $(CHROMIUM) $(SLURMD) $(SSHD)
	$(PY) -m pytest -ra --durations=30

benchmark: setup $(SLURMD) $(SSHD)
	$(PY) benchmarks/resize_and_throughput.py
	$(PY) benchmarks/fault_recovery.py
	$(PY) benchmarks/panel_resize.py
	$(PY) benchmarks/chart_render.py
	$(PY) benchmarks/auto_day.py
	$(PY) benchmarks/slurm_drain.py
	$(PY) benchmarks/cluster_sim.py
	$(PY) benchmarks/hosts_throughput.py

clean:
	rm -rf $(VENV) notebooks/elastic-checkpoints notebooks/loss.png node_modules elastic_jupyter/static artifacts
