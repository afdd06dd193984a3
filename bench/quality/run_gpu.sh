#!/usr/bin/env bash
# Quality evidence on the lent GPU: train the tiny recall model, then measure task
# accuracy through an SGLang server (sgl_sparse) and attention fidelity.
# Same environment as bench/gpu/run_all.sh: the wheelhouse (SGLang 0.5.17,
# FlashInfer, this project's wheel) installed into /tmp/site as in
# ../shared/gpu/README.md, then
#
#   bash bench/quality/run_gpu.sh train     # <= ~8 min: writes $CKPT (kept in /root while the machine is warm)
#   bash bench/quality/run_gpu.sh eval      # server eval (~4 min start-up on a fresh machine) + fidelity
#   bash bench/quality/run_gpu.sh all       # both (only if one command may take ~15 min)
#
# Results: $OUT/quality_{eval,fidelity}.{json,md}, $OUT/quality_train_log.txt and the
# server log; also copied to bench/results/ in this tree (commit them from there).
set -uo pipefail
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
CKPT="${CKPT:-/root/tiny-recall}"
LENGTHS="${LENGTHS:-2048,8192,16384,32768}"
what="${1:-all}"
here="$(cd "$(dirname "$0")" && pwd)"
results="$here/../results"; mkdir -p "$results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

train() {
    python3 "$here/train_tiny.py" --out "$CKPT" --log "$OUT/quality_train_log.txt" 2>&1 | tail -40
    cp "$OUT/quality_train_log.txt" "$here/train_log.txt"
}

evaluate() {
    [ -f "$CKPT/model.safetensors" ] || { echo "no checkpoint at $CKPT: run '$0 train' first"; return 1; }
    python3 "$here/eval.py" --model "$CKPT" --launch --lengths "$LENGTHS" --n "${N:-8}" \
        --server-args "--dtype bfloat16 --disable-prefill-cuda-graph ${SERVER_ARGS:-}" \
        --server-log "$OUT/quality_server.log" \
        --out-json "$OUT/quality_eval.json" --out-md "$OUT/quality_eval.md" 2>&1 | tee "$OUT/quality_eval.log" | tail -40
    python3 "$here/fidelity.py" --model "$CKPT" --lengths "${FID_LENGTHS:-2048,8192,32768}" \
        --budgets "${BUDGETS:-64,256,1024,2048}" --n 4 \
        --out-json "$OUT/quality_fidelity.json" --out-md "$OUT/quality_fidelity.md" 2>&1 | tail -40
}

case "$what" in
train) train ;;
eval) evaluate ;;
all) train && evaluate ;;
*) echo "usage: $0 {train|eval|all}"; exit 2 ;;
esac
for f in "$OUT"/quality_*.json "$OUT"/quality_*.md; do [ -f "$f" ] && cp "$f" "$results/"; done
