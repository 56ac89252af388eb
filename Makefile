# Two entry points, each safe to run on a fresh machine: `make quickstart` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup quickstart test benchmark clean

setup: $(STAMP)

# torch is pinned to the CPU build that lies on this machine's disk; an unpinned torch would
# pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The main job: the quick-start notebook, headless, on scikit-learn's digits.
quickstart: setup
	cd notebooks && ../$(VENV)/bin/ipython --colors=nocolor 01_quickstart.ipynb

test: setup
	$(PY) -m pytest -ra

benchmark: setup
	$(PY) benchmarks/resize_and_throughput.py
	$(PY) benchmarks/fault_recovery.py

clean:
	rm -rf $(VENV) notebooks/checkpoints
