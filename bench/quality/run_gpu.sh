#!/usr/bin/env bash
# Quality evidence on the lent GPU: train the tiny recall model, then measure task
# accuracy through an SGLang server (sgl_sparse) and attention fidelity.
# Same environment as bench/gpu/run_all.sh: the wheelhouse (SGLang 0.5.17,
# FlashInfer, this project's wheel) installed into /tmp/site as in
# ../shared/gpu/README.md, then
#
#   bash bench/quality/run_gpu.sh train     # <= ~8 min: writes $CKPT (kept in /root while the machine is warm);
#                                           # TRAIN_FLAGS (default: run 4's "--recipe kv-easy --lr 3e-3 --seed 1 --time-budget 400"
#                                           # plus "--think-long 0.15": the think-long variant) picks the recipe
#   bash bench/quality/run_gpu.sh eval      # both server evals (~4 min start-up on a fresh machine) + fidelity
#                                           # = eval-main (CUDA graphs on), eval-qa (query-aware policies,
#                                           # --disable-cuda-graph, sparse_config_eval.yaml), fidelity:
#                                           # run them as three calls if one would pass the 10-minute limit
#   bash bench/quality/run_gpu.sh eval-long # ~5 min: the think-long variant (long answers) at 8K and 32K, the
#                                           # policies of the issue's target, decode CUDA graphs on (LONG_* knobs below)
#   bash bench/quality/run_gpu.sh all       # both (only if one command may take ~15 min)
#   bash bench/quality/run_gpu.sh sweep     # <= ~9 min: 4 training recipes at once on the one GPU
#   bash bench/quality/run_gpu.sh restore DIR   # the checkpoint from the ckpt.tgz.* parts a train call
#                                           # returned in $OUT (carried back in DIR): eval without training
#
# sweep: one train_tiny.py process per variant, all in parallel (the model is tiny: one
# process leaves the GPU mostly idle), each with its own checkpoint /root/sweep/NAME,
# log $OUT/quality_sweep_NAME.log, 2 DataLoader workers and a time budget of $SWEEP_BUDGET
# seconds (default 400: stages 85% of it, the rest evals); then one summary line per
# variant. VARIANTS overrides the list: "name flags;name flags;..." (flags for
# train_tiny.py). Evaluate a variant afterwards with CKPT=/root/sweep/NAME ... eval.
#
# Results: $OUT/quality_{eval,eval_qa,fidelity}.{json,md}, $OUT/quality_train_log.txt and the
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

# name|train_tiny.py flags (all on the default GPU shape; see README "Sweep" and "Bug hunt")
# recipe kv-easy (the recall circuit first on 4 pairs at 16 tokens): at the default lr,
# at lr 3e-3 (as on CPU) and with another seed (the plateau's end is stochastic), and with the (now fixed)
# previous-token init
DEFAULT_VARIANTS="kv-easy|--recipe kv-easy;\
kv-easy-lr3e-3|--recipe kv-easy --lr 3e-3;\
kv-easy-lr3e-3-s1|--recipe kv-easy --lr 3e-3 --seed 1;\
kv-easy-prev|--recipe kv-easy --prev-token-init 1"
# --think-long 0.15: 15% of the sentence rows' questions (from the plain share) in the
# think-long variant (tasks.THINK_LONG_BODY), for eval-long; same stages and budget
TRAIN_FLAGS="${TRAIN_FLAGS:---recipe kv-easy --lr 3e-3 --seed 1 --time-budget 400 --think-long 0.15}"

sweep() {
    local budget="${SWEEP_BUDGET:-400}" dir="${SWEEP_DIR:-/root/sweep}" names=() pids=() IFS_OLD="$IFS"
    mkdir -p "$dir"
    IFS=';' read -ra specs <<< "${VARIANTS:-$DEFAULT_VARIANTS}"; IFS="$IFS_OLD"
    for spec in "${specs[@]}"; do
        spec="$(echo "$spec" | sed 's/^[[:space:]]*//')"; [ -n "$spec" ] || continue
        local name="${spec%%|*}" flags="${spec#*|}"
        names+=("$name")
        # shellcheck disable=SC2086
        timeout $((budget + 150)) python3 "$here/train_tiny.py" --out "$dir/$name" \
            --log "$OUT/quality_sweep_$name.log" --workers "${SWEEP_WORKERS:-2}" --time-budget "$budget" --eval-n "${SWEEP_EVAL_N:-24}" \
            $flags > "$OUT/quality_sweep_$name.out" 2>&1 &
        pids+=($!)
        echo "started $name (pid $!): $flags"
    done
    for i in "${!pids[@]}"; do wait "${pids[$i]}"; echo "${names[$i]} exited $?"; done
    echo "== sweep summary (held-out exact match, teacher-forced, per prompt length; answer acc = value token) =="
    for name in "${names[@]}"; do
        local log="$OUT/quality_sweep_$name.log"
        local fin; fin="$(grep '^final exact match' "$log" 2>/dev/null | sed 's/.*by prompt length: //')"
        local last; last="$(grep '^step' "$log" 2>/dev/null | tail -1 | sed 's/ lr .*//')"
        echo "$name: final ${fin:-none (see $OUT/quality_sweep_$name.out)}"
        echo "    last: $last"
        grep -E '^(eval after|!)' "$log" 2>/dev/null | sed 's/^/    /' | cut -c1-220
    done
    cp "$OUT"/quality_sweep_*.log "$results/" 2>/dev/null || true
}

train() {
    # shellcheck disable=SC2086
    python3 "$here/train_tiny.py" --out "$CKPT" --log "$OUT/quality_train_log.txt" $TRAIN_FLAGS 2>&1 | tail -40
    cp "$OUT/quality_train_log.txt" "$here/train_log.txt"
    # The checkpoint comes back too (15 MiB parts: the device returns files of at
    # most 16 MiB), so a later lease can evaluate without training again:
    # cat ckpt.tgz.* | tar xz -C /root (the weights are never committed).
    [ -f "$CKPT/model.safetensors" ] && tar cz -C "$(dirname "$CKPT")" "$(basename "$CKPT")" | split -b 15m - "$OUT/ckpt.tgz."
}

# The default server (decode CUDA graphs on) serves eval.py's default policies but the
# query-aware ones, which it rejects with 400 there; those get a second server with
# --disable-cuda-graph and sparse_config_eval.yaml (query-aware max_context past 32K +
# completion, slots = eval.py's concurrency), each row with `full` as its control.
MAIN_POLICIES="${MAIN_POLICIES:-full,sfi,sfi:budget=256:recent=64,sfi:prompt_evidence=every,sfi:budget=256:recent=64:prompt_evidence=every,sfi:beta=1.0,sfi:beta=1.0:prompt_evidence=every,sfi:budget=256:recent=64:beta=1.0,sfi:budget=256:recent=64:beta=1.0:prompt_evidence=every,sadas:window=64,sadas,streaming:window=64,streaming:window=1024}"
QA_POLICIES="${QA_POLICIES:-full,asyncspade,lfps,quest}"

need_ckpt() {
    [ -f "$CKPT/model.safetensors" ] || { echo "no checkpoint at $CKPT: run '$0 train' first"; return 1; }
}

# run_eval NAME POLICIES "EXTRA SERVER ARGS": one eval.py server run -> $OUT/quality_NAME.{json,md,log}
run_eval() {
    need_ckpt || return 1
    local name="$1" policies="$2" extra="$3"
    python3 "$here/eval.py" --model "$CKPT" --launch --lengths "$LENGTHS" --n "${N:-8}" --policies "$policies" --dump-failures "${DUMP:-4}" \
        --server-args "--dtype bfloat16 --disable-prefill-cuda-graph $extra ${SERVER_ARGS:-}" \
        --server-log "$OUT/quality_server${name#eval}.log" \
        --out-json "$OUT/quality_$name.json" --out-md "$OUT/quality_$name.md" 2>&1 | tee "$OUT/quality_$name.log" | tail -40
}

eval_main() { run_eval eval "$MAIN_POLICIES" ""; }

# eval-long: the issue's target (sfi >= 99% of full at 32K, retention <= 20%) on long
# answers. In the think-long variant SFI's dense slow steps (the first decode step and
# one per sentence end of the think block: 5) are ~9% of ~53 decode steps, not the ~20%
# of plain's ~5 that held run 5's retention at 0.207 (README "think-long"). Same server
# as eval-main (decode CUDA graphs on); per-variant retention from meta_info.
LONG_POLICIES="${LONG_POLICIES:-full,sfi,sfi:beta=1.0:prompt_evidence=every,sfi:budget=256:recent=64:beta=1.0:prompt_evidence=every,sfi:budget=512:recent=64:beta=1.0:prompt_evidence=every,sadas,streaming:window=64}"
eval_long() {
    need_ckpt || return 1
    python3 "$here/eval.py" --model "$CKPT" --launch --lengths "${LONG_LENGTHS:-8192,32768}" --n "${LONG_N:-24}" \
        --variants "${LONG_VARIANTS:-think-long}" --policies "$LONG_POLICIES" --dump-failures "${DUMP:-4}" \
        --server-args "--dtype bfloat16 --disable-prefill-cuda-graph ${SERVER_ARGS:-}" \
        --server-log "$OUT/quality_server_long.log" \
        --out-json "$OUT/quality_eval_long.json" --out-md "$OUT/quality_eval_long.md" 2>&1 | tee "$OUT/quality_eval_long.log" | tail -40
}
eval_qa() { run_eval eval_qa "$QA_POLICIES" "--disable-cuda-graph --sparse-config $here/sparse_config_eval.yaml"; }

fidelity() {
    need_ckpt || return 1
    # both variants: think examples add sfi-later (the server's later w = 1 slow step)
    python3 "$here/fidelity.py" --model "$CKPT" --lengths "${FID_LENGTHS:-2048,8192,16384,32768}" \
        --budgets "${BUDGETS:-64,256,1024,2048}" --n "${FID_N:-4}" --variants "${FID_VARIANTS:-plain,think}" \
        --out-json "$OUT/quality_fidelity.json" --out-md "$OUT/quality_fidelity.md" 2>&1 | tail -60
}

evaluate() {
    eval_main; eval_qa; fidelity
}

case "$what" in
train) train ;;
eval) evaluate ;;
eval-main) eval_main ;;
eval-long) eval_long ;;
eval-qa) eval_qa ;;
fidelity) fidelity ;;
all) train && evaluate ;;
sweep) sweep ;;
restore) mkdir -p "$(dirname "$CKPT")" && cat "${2:?restore DIR: the ckpt.tgz.* parts a train call returned}"/ckpt.tgz.* | tar xz -C "$(dirname "$CKPT")" && ls -l "$CKPT" ;;
*) echo "usage: $0 {train|eval|eval-main|eval-long|eval-qa|fidelity|all|sweep|restore DIR}"; exit 2 ;;
esac
for f in "$OUT"/quality_*.json "$OUT"/quality_*.md; do [ -f "$f" ] && cp "$f" "$results/"; done
