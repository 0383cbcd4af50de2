#!/usr/bin/env bash
# GPU check of weft's Triton kernels and CUDA graphs, on a CUDA machine with this repo copied over:
#
#     scripts/gpu_check.sh
#
# 1. the kernel tests (tests/kernels) compiled for the GPU instead of interpreted,
# 2. end to end on the default model: greedy tokens of the Triton path with CUDA graphs
#    against the torch path (fp32, they must be identical),
# 3. the paged attention kernel's time against torch SDPA on the same shapes,
# 4. decode tokens/s at batch 1, 32 and 256 and prefill tokens/s of a Llama-3-8B-shaped
#    model with random weights (--load-format dummy).
# Each figure is one "gpu_check |" line; a summary repeats them at the end. Every step has
# a time limit, so the whole check ends within 8 minutes. Exit status: 0 when every
# step passed, 1 when one failed or timed out, 2 when the machine cannot run it.
#
# Nothing is downloaded there. torch with CUDA and triton must be installed; the few
# packages a bare CUDA image lacks (msgspec, pyzmq, gguf) are installed from wheels in
# .whl/ of this repo (or $WEFT_WHEELS), which a machine with network makes with
#
#     scripts/gpu_check.sh --download-wheels [python-version, default 3.12]
#
# The default model (models/SmolLM2-135M-Instruct.Q4_1.gguf, `make model`) is needed
# for step 2 and the end-to-end kernel test; without it they are reported as not run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
WHEELS=${WEFT_WHEELS:-$REPO/.whl}
PINNED_WHEELS="msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0"

if [[ "${1:-}" == "--download-wheels" ]]; then
    PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${2:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $PINNED_WHEELS
    echo "Wheels in $WHEELS; copy the repo (with them) to the GPU machine and run scripts/gpu_check.sh."
    exit 0
fi

PY=${PYTHON:-python3}
unset TRITON_INTERPRET WEFT_ATTENTION_BACKEND  # compiled kernels; each step picks its own backend
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY=$(mktemp)
SITE=$(mktemp -d)  # wheels installed here, if any are needed
LOGS=$(mktemp -d)
trap 'rm -rf "$SUMMARY" "$SITE" "$LOGS"' EXIT
FAILED=()

say() { echo "gpu_check | $*" | tee -a "$SUMMARY"; }

missing_modules() {
    "$PY" - <<'EOF'
import importlib.util
needed = ["msgspec", "zmq", "gguf", "numpy", "tokenizers", "jinja2", "tqdm", "yaml", "pytest"]
print(" ".join(m for m in needed if importlib.util.find_spec(m) is None))
EOF
}

# --- the machine ----------------------------------------------------------------------
if ! "$PY" - <<'EOF'
import sys
try:
    import torch
    import triton
except ImportError as e:
    sys.exit(f"gpu_check: {e}: this check needs torch (with CUDA) and triton installed.")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine.")
print(f"gpu_check | device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
EOF
then
    exit 2
fi

missing=$(missing_modules)
if [[ -n "$missing" ]]; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
        export PYTHONPATH="$PYTHONPATH:$SITE"
        missing=$(missing_modules)
    fi
    if [[ -n "$missing" ]]; then
        echo "gpu_check: Python modules missing here: $missing." >&2
        echo "  On a machine with network: scripts/gpu_check.sh --download-wheels (writes $WHEELS), copy it over." >&2
        exit 2
    fi
fi

have_model=0
if [[ -f "${WEFT_MODELS_DIR:-$REPO/models}/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then have_model=1; fi

# run_step NAME SECONDS COMMAND...: run with a time limit; a failure is recorded, the check goes on.
run_step() {
    local name=$1 limit=$2 start status=0
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" || status=$?
    grep "^gpu_check | " "$LOGS/$name.log" >>"$SUMMARY" || true
    if [[ $status -ne 0 ]]; then
        FAILED+=("$name")
        [[ $status -eq 124 ]] && say "$name: TIMED OUT after ${limit}s" || say "$name: FAILED (exit $status)"
    fi
    echo "=== $name: $(( $(date +%s) - start ))s"
}

# --- 1. kernel tests on the GPU --------------------------------------------------------
pytest_args=(-q -p no:cacheprovider tests/kernels)
if [[ $have_model -eq 0 ]]; then
    pytest_args+=(--deselect tests/kernels/test_e2e_triton.py::test_triton_backend_gives_the_torch_greedy_tokens)
    say "kernel tests: the end-to-end test is NOT RUN (default model missing; make model)"
fi
if "$PY" -c "import xdist" 2>/dev/null; then
    pytest_args+=(-n 8)  # Triton compiles each test's kernels: spread the compiling over processes
fi
run_step kernel-tests 180 "$PY" -m pytest "${pytest_args[@]}"
tests_line=$(grep -E "[0-9]+ (passed|failed)" "$LOGS/kernel-tests.log" | tail -1 || true)
say "kernel tests on the GPU: ${tests_line:-no result}"

# --- 2. end to end ---------------------------------------------------------------------
if [[ $have_model -eq 1 ]]; then
    run_step e2e 70 "$PY" -m services.cli bench gpu e2e
else
    say "e2e greedy: NOT RUN (default model missing; make model)"
fi

# --- 3. kernel time against torch SDPA ---------------------------------------------------
run_step kernel-timing 40 "$PY" -m services.cli bench gpu kernels

# --- 4. throughput, Llama-3-8B shape with dummy weights ----------------------------------
run_step throughput 135 "$PY" -m services.cli bench gpu throughput

echo
echo "===== gpu_check summary ====="
cat "$SUMMARY"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all steps passed"
