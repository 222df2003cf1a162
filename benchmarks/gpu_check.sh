#!/usr/bin/env bash
# One-shot check of vx's GPU path on a CUDA machine, in under 5 minutes. Run from the repo root:
#     bash benchmarks/gpu_check.sh [RESULTS_FILE]
# Results go to RESULTS_FILE, else $OUT (a directory gets gpu_check_results.txt inside it), else
# ./gpu_check_results.txt. Steps: .venv (`make setup` when it is missing, as `make test` would), nvidia-smi and
# versions, `pytest -m gpu` (triton / flash_attn vs torch on CUDA, engine end to end), the CPU-side
# attention tests (Triton interpreter, selector), then benchmarks/throughput.py --dtype bfloat16.
# Each step gets a timeout from one overall budget; a failing step is recorded and the next one runs.
set -u

BUDGET_S=${GPU_CHECK_BUDGET_S:-290}
if [ $# -ge 1 ]; then
    RESULTS=$1
elif [ -n "${OUT:-}" ]; then
    if [ -d "$OUT" ]; then RESULTS="$OUT/gpu_check_results.txt"; else RESULTS=$OUT; fi
else
    RESULTS=gpu_check_results.txt
fi
mkdir -p "$(dirname "$RESULTS")"
: >"$RESULTS"
START=$(date +%s)
SUMMARY=()
FAILED=0

log() { echo "$@" | tee -a "$RESULTS"; }

# run_step NAME CAP_SECONDS CMD...: run CMD with a timeout of min(CAP, what is left of the budget).
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START)))
    local limit=$((cap < left ? cap : left))
    log ""
    log "===== $name (timeout ${limit}s) ====="
    if [ "$limit" -le 5 ]; then
        log "skipped: the ${BUDGET_S}s budget is spent"
        SUMMARY+=("$name: SKIPPED (budget)")
        FAILED=1
        return
    fi
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RESULTS"
    local rc=${PIPESTATUS[0]}
    local dt=$(($(date +%s) - t0))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("$name: ok (${dt}s)")
    else
        [ "$rc" -eq 124 ] && log "TIMED OUT after ${limit}s"
        SUMMARY+=("$name: FAILED rc=$rc (${dt}s)")
        FAILED=1
    fi
}

log "vx GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

if [ ! -x .venv/bin/python ]; then  # an existing .venv is used as it is
    run_step "make setup" 150 make setup
fi
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
    log "no .venv/bin/python: cannot continue"
    exit 1
fi
export TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the CUDA tests must compile real kernels

run_step "nvidia-smi" 20 nvidia-smi
run_step "versions" 60 "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
else:
    print("WARNING: torch sees no CUDA device (a CPU build of torch?): every gpu test will skip")
for mod in ("triton", "flash_attn"):
    try:
        print(mod, importlib.import_module(mod).__version__)
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
from vx.gpu.attention import get_attn_backend
for dt in (torch.float32, torch.bfloat16):
    for bs in (16, 256):
        print(f"auto backend on cuda, {dt}, block {bs}:",
              get_attn_backend("auto", "cuda", dtype=dt, block_size=bs).get_name())
EOF
run_step "pytest -m gpu" 150 "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider tests
run_step "attention tests (interpreter, selector)" 60 \
    "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu" tests/gpu/attention
# A lighter workload than the default (128 requests, HF batch-size search) so the step fits its share.
run_step "throughput bf16" 150 "$PY" benchmarks/throughput.py --dtype bfloat16 --device cuda \
    --num-requests 64 --max-output-len 128 --hf-batch-size 32

log ""
log "===== summary ($(($(date +%s) - START))s) ====="
for line in "${SUMMARY[@]}"; do log "$line"; done
log "results: $RESULTS"
exit $FAILED
