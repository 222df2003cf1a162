#!/usr/bin/env bash
# One-shot check of vx's GPU path on a CUDA machine, in under 8 minutes. Run from the repo root:
#     bash benchmarks/gpu_check.sh [--dry-run] [RESULTS_FILE]
# Results go to RESULTS_FILE, else $OUT (a directory gets gpu_check_results.txt inside it), else
# ./gpu_check_results.txt. Steps, each with a timeout from one overall budget (a failing step is recorded and the
# next one runs):
#   1. .venv: `make setup` when missing (it takes the CUDA build of torch when nvidia-smi is there), then triton;
#      flash-attn only if a wheel installs within a minute (else skipped, and said);
#   2. nvidia-smi, versions, the attention backend `auto` picks;
#   3. `pytest -m gpu` (triton / flash_attn vs torch on CUDA, the engine end to end), benchmarks.cuda_probe (every
#      family's greedy tokens vs HF on CUDA, each engine feature, every case isolated) and the CPU-side
#      decode-graph and attention tests;
#   4. greedy vs Hugging Face on a Qwen2.5-0.5B-shaped random model: float32 exact, bf16 top-1 agreement;
#   5. throughput vx vs HF `generate` (its best batch size) on the mixed workload, CUDA graphs on and off, and one
#      stream's decode (batch 1) with its fraction of the HBM roofline.
# GPU_CHECK_PYTHON=python3 (a machine without a package index): use that Python's torch and triton, and install the
# wheels carried in .whl/ beside it instead of step 1. Test modules whose imports are missing there are reported
# and the rest run (--continue-on-collection-errors).
# --dry-run (on a CPU): no installs; runs the CPU-side tests and steps 4-5 on the `micro` model on the CPU, and
# marks each GPU-only step skipped. It checks the script, not the GPU.
set -u

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
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

# skip_step NAME WHY: record a step that does not run here.
skip_step() {
    log ""
    log "===== $1 ====="
    log "skipped: $2"
    SUMMARY+=("$1: SKIPPED ($2)")
}

log "vx GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')$( \
    [ $DRY_RUN = 1 ] && echo ', DRY RUN on the CPU')"

if [ $DRY_RUN = 1 ]; then
    skip_step "install (make setup, triton, flash-attn)" "dry run: the existing .venv is used as it is"
elif [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    # A machine with no package index (a lent GPU box): the Python that already holds CUDA torch and triton, plus
    # vx's missing dependencies carried as wheels in .whl/ (msgspec, pyzmq, gguf), installed beside it.
    skip_step "install (make setup, triton, flash-attn)" "GPU_CHECK_PYTHON=$GPU_CHECK_PYTHON: its packages are used"
    if ls .whl/*.whl >/dev/null 2>&1; then
        run_step "carried wheels (.whl/)" 60 "$GPU_CHECK_PYTHON" -m pip install -q --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target /tmp/vx-site .whl/*.whl
    fi
    export PYTHONPATH="/tmp/vx-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    if [ ! -x .venv/bin/python ]; then  # an existing .venv is used as it is
        run_step "make setup" 200 make setup
    fi
    run_step "triton" 60 .venv/bin/python -m pip install -q 'triton>=3.0'
    # flash-attn builds from source when no wheel fits, which takes far longer than this check may: a minute,
    # then it is left out (the triton and torch backends still run).
    run_step "flash-attn (wheel within 60 s, optional)" 60 .venv/bin/python -m pip install -q --only-binary=:all: \
        flash-attn || log "flash-attn not installed: its backend is skipped"
fi
PY=${GPU_CHECK_PYTHON:-.venv/bin/python}
if ! command -v "$PY" >/dev/null 2>&1; then
    log "no $PY: cannot continue"
    exit 1
fi
export TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the CUDA tests must compile real kernels
if [ $DRY_RUN = 1 ]; then
    DEVICE=cpu MODEL=micro
else
    DEVICE=cuda MODEL=qwen2.5-0.5b-random
fi

if [ $DRY_RUN = 1 ]; then skip_step "nvidia-smi" "dry run"; else run_step "nvidia-smi" 20 nvidia-smi; fi
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
if [ $DRY_RUN = 1 ]; then
    skip_step "pytest -m gpu" "dry run: needs CUDA"
else
    run_step "pytest -m gpu" 120 "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider \
        --continue-on-collection-errors tests/gpu tests/models
    run_step "every family and feature on CUDA (benchmarks.cuda_probe)" 150 "$PY" -m benchmarks.cuda_probe \
        --device cuda
fi
if [ -n "${GPU_CHECK_SKIP_CPU_TESTS:-}" ]; then
    skip_step "decode-graph and attention tests (CPU side)" "GPU_CHECK_SKIP_CPU_TESTS is set"
else run_step "decode-graph and attention tests (CPU side: capture logic, interpreter, selector)" 90 \
    "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu" tests/gpu/attention tests/gpu/graphs/test_cuda.py
fi
run_step "greedy vs HF, float32 (exact)" 100 "$PY" -m benchmarks.greedy_check --model $MODEL --device $DEVICE \
    --dtype float32
run_step "greedy vs HF, bf16 (top-1 agreement)" 50 "$PY" -m benchmarks.greedy_check --model $MODEL \
    --device $DEVICE --dtype bfloat16
# The mixed workload, lighter than the default (128 requests) so the step fits its share; HF at its best batch
# size of the search; vx with CUDA graphs and with enforce_eager.
if [ $DRY_RUN = 1 ]; then
    THROUGHPUT_ARGS="--num-requests 8 --max-prompt-len 64 --max-output-len 16 --hf-batch-sizes 4,8"
else
    THROUGHPUT_ARGS="--num-requests 64 --max-output-len 128 --hf-batch-sizes 16,32,64"
fi
run_step "throughput bf16, CUDA graphs on and off" 150 "$PY" -m benchmarks.throughput --model $MODEL \
    --dtype bfloat16 --device $DEVICE --eager-too $THROUGHPUT_ARGS
# One stream: 256 tokens after a 32-token prompt, graphs on and off, against the weights' HBM roofline.
run_step "batch-1 decode bf16, CUDA graphs on and off" 60 "$PY" -m benchmarks.throughput --model $MODEL \
    --dtype bfloat16 --device $DEVICE --eager-too --no-hf --num-requests 1 --min-prompt-len 32 \
    --max-prompt-len 32 --min-output-len $([ $DRY_RUN = 1 ] && echo 16 || echo 256) \
    --max-output-len $([ $DRY_RUN = 1 ] && echo 16 || echo 256)

log ""
log "===== summary ($(($(date +%s) - START))s) ====="
for line in "${SUMMARY[@]}"; do log "$line"; done
log "results: $RESULTS"
exit $FAILED
