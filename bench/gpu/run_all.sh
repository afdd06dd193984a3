#!/usr/bin/env bash
# Everything the lent GPU runs, in one place. Assumes the wheelhouse (SGLang 0.5.17,
# FlashInfer, this project's wheel) was installed into /tmp/site as in
# ../shared/gpu/README.md (see bench/README.md, "How the GPU runs are made", for the exact device calls).
#
#   bash bench/gpu/run_all.sh kernels   # GPU kernel tests (4K-128K) + kernel benchmarks (decode, query-aware selection, ragged top-k)
#   bash bench/gpu/run_all.sh tests     # every GPU-marked test alone (~2 min; what a short lease can verify)
#   bash bench/gpu/run_all.sh fp8       # fp8 KV caches: the fp8 tests of the decode kernel and every policy's kernels, its time at
#                                       # 32768 x 8 reading fp8 against bf16 (needs only this project's wheel: a bare machine)
#   bash bench/gpu/run_all.sh splits    # our decode kernel at forced split counts over the grid's shapes (bare machine)
#   bash bench/gpu/run_all.sh lfps      # lfps's selection kernels: tests compiled, the priorities and the table update by chunks, its Top-K shapes (bare machine)
#   bash bench/gpu/run_all.sh slowstep  # SFI's slow-step launch at 131072 x 4 over e4m3, plain and balanced round-robin, then the pair
#                                       # under Nsight Compute (bare machine)
#   bash bench/gpu/run_all.sh fastbalance  # a fast step's balanced launch against the unbalanced one (bench_mixed_rows by
#                                       # BALANCE_FACTOR, the pair under Nsight Compute at 8192 x 32 and 32768 x 8; bare machine)
#   bash bench/gpu/run_all.sh selector  # SFI refresh (Selector + repack) per layer vs dense attention
#   bash bench/gpu/run_all.sh e2e       # SGLang server: flashinfer vs sgl_sparse, same run (env CASES, POLICIES, REPEATS, OUT_LEN, SHAPE;
#                                       # POLICIES=full+sfi-pinned: one batch of both, requests dealt round-robin (the mixed graph variant);
#                                       # INTERLEAVE=1: both servers at once, batches alternating: rows whose KV fits twice;
#                                       # NO_QA_COVERING=1: without the covering quest/asyncspade/lfps greedy checks;
#                                       # PREFILL_RUNS: prefill-only batches per row, default 2;
#                                       # ITL=1: one more streamed batch per row, per-step latency mean/p50/p99;
#                                       # EXTRA: SGLang flags of both servers, default --disable-prefill-cuda-graph;
#                                       # GRAPH_MAX_BS: both servers' decode-graph sizes, default auto: up to the cases' largest batch (sglang: its own list);
#                                       # BACKENDS: default flashinfer,sgl_sparse; sgl_sparse@CONFIG: one more sgl_sparse server with that --sparse-config;
#                                       # QK_NORM_GAIN: the random model's q/k norm weights, default 1 (make_random_model.py: peakier attention))
#   bash bench/gpu/run_all.sh profile   # GPU time per decode step by kernel (SGLang's torch profiler; env CASE, RUNS, SPARSE_CONFIG, MEM_FRACTION, EXTRA;
#                                       # TIMELINE=N: every kernel of N steps to $OUT/timeline-<backend>-<policy>.csv)
#
# Results land in $OUT (device tool) and are committed under bench/results/.
set -uo pipefail
export PYTHONPATH=/tmp/site CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
what="${1:-kernels}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
bash "$(dirname "$0")/stop_stale_servers.sh" | tee -a "$OUT/device.txt"
# A JIT cache from an earlier lease (JIT_SNAPSHOT=1 below, carried as .gpu/jit): a fresh
# machine skips FlashInfer's and tvm-ffi's builds, ~5 min of the first server's start-up
# (session 16: stock-only e2e at 8192 x 32, 6.4 min fresh). Ninja rebuilds an output
# older than any of its inputs, headers included (its deps log), and this lease's pip
# install dated every file under /tmp/site now. Session 16 dated back the files with
# a C/C++/CUDA extension only; session 17's fresh lease still rebuilt FlashInfer's
# decode, prefill and norm modules (134 s in the stock server's warm-up request,
# results/jit_built_fresh_lease_h100_s17.txt): their deps include libcudacxx's
# extensionless headers (nv/target, cuda/std/...). So every file but Python sources and
# bytecode (whose .pyc records the source's mtime) is dated back; ninja -d explain on a
# CPU: "output older than most recent input nv/target" before, "no work to do" after.
# With the wheelhouse's last part and this project's wheel the tree passes the device
# tool's 64 MiB a call (session 42): the cache may come in a call of its own, copied to
# /root/jitc (`mkdir -p /root/jitc && cp .gpu/jit/* /root/jitc/`), and is read there.
jit=.gpu/jit; ls $jit/jit_cache.tgz.part* >/dev/null 2>&1 || jit=/root/jitc
if ls $jit/jit_cache.tgz.part* >/dev/null 2>&1 && [ ! -d /root/.cache/flashinfer ]; then
    cat $jit/jit_cache.tgz.part* | tar -xz -C /root
    find /tmp/site -type f ! -name '*.py' ! -name '*.pyc' -exec touch -d 2000-01-01 {} +
    echo "JIT cache restored from $jit" | tee -a "$OUT/device.txt"
fi
[ "$what" = fp8 ] || [ "$what" = splits ] || [ "$what" = lfps ] || [ "$what" = slowstep ] || [ "$what" = fastbalance ] || python3 -c "import torch, triton, sglang, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$OUT/device.txt"

case "$what" in
kernels)
    python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log" | tail -5
    python3 bench/kernels/bench_decode.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernel_bench.log" | tail -60
    python3 bench/kernels/bench_query_aware.py --out "$OUT/query_aware_kernels.json" 2>&1 | tee "$OUT/query_aware_kernels.log" | tail -40
    python3 bench/kernels/bench_topk.py --out "$OUT/topk.json" 2>&1 | tee "$OUT/topk.log" | tail -30
    ;;
fp8)
    # every fp8 test of the decode kernel, quest's bounds, SFI's evidence and key norms and
    # asyncspade's scoring (raw keys and copies), compiled (the gpu-marked 32K one included)
    python3 -m pytest -q tests/kernels/test_two_segment_decode.py tests/kernels/test_quest_pages.py \
        tests/kernels/test_sfi_kernels.py tests/kernels/test_token_scores.py tests/kernels/test_index_keys.py -k fp8 \
        -p no:cacheprovider 2>&1 | tee "$OUT/fp8_tests.log" | tail -5
    # lfps's kernels, fp8 pools among their cases
    python3 -m pytest -q tests/kernels/test_lfps_sparsity.py tests/kernels/test_lfps_tables.py -p no:cacheprovider \
        2>&1 | tee -a "$OUT/fp8_tests.log" | tail -3
    # each cache dtype at the heuristic's splits (the table) and at forced ones ("splits" lines;
    # "slow step": SFI's dense launch with its logits kept, at the heuristic's and those);
    # FP8_VARIANTS=1: e4m3 also with the values widened by the compiler (v_asm0) and with
    # bf16 dots (f16dots0), session 31's A/B
    for run in model fp8_e4m3 fp8_e5m2 ${FP8_VARIANTS:+fp8_e4m3:SGLANG_SPARSE_FP8_V_ASM=0 fp8_e4m3:SGLANG_SPARSE_FP8_F16_DOTS=0}; do
        kv=${run%%:*}; var=${run#*:}; [ "$var" = "$run" ] && var=""
        tag=$kv${var:+_$(echo "${var#SGLANG_SPARSE_FP8_}" | tr 'A-Z=' 'a-z_' | tr -d '_')}
        env $var python3 bench/kernels/bench_decode.py --contexts 32768 --batches 8 --fractions 1/64,1/16,1 --no-indexed \
            --split-counts 4,8,16,32 --slow-step --kv-dtype "$kv" --out "$OUT/decode_32k8_kv_$tag.json" 2>&1 \
            | tee "$OUT/decode_32k8_kv_$tag.log" | grep -E "splits ctx|slow step|ours_dense \||ours_sparse \||FAIL" \
            | sed "s/^/$tag /"
    done
    ;;
lfps)
    # lfps's per-layer selection kernels (bare machine): their tests compiled (the
    # 32K priority layer among them), the priorities and the table update by chunks a
    # row, the Top-K's shapes
    python3 -m pytest -q tests/kernels/test_lfps_sparsity.py tests/kernels/test_lfps_tables.py -p no:cacheprovider \
        2>&1 | tee "$OUT/lfps_tests.log" | tail -3
    python3 bench/kernels/bench_lfps_priority.py --out "$OUT/lfps_priority.json" 2>&1 | tee "$OUT/lfps_priority.log"
    python3 bench/kernels/bench_lfps_finish.py --out "$OUT/lfps_finish.json" 2>&1 | tee "$OUT/lfps_finish.log"
    python3 bench/kernels/bench_topk.py --cases lfps --out "$OUT/topk_lfps.json" 2>&1 | tee "$OUT/topk_lfps.log" | tail -12
    ;;
slowstep)
    # session 37's open question: the balanced launch in a grid of 16 with 16 splits a
    # request (the plain launch's exact partition) at 625 us against the plain one's 399,
    # every balanced row timed after the plain ones. Here round-robin (--slow-step-rounds),
    # then the pair once each under Nsight Compute, then the pair timed alternately.
    python3 bench/kernels/bench_decode.py --contexts 131072 --batches 4 --fractions 1 --no-indexed --no-fused --slow-step \
        --kv-dtype fp8_e4m3 --split-counts 16 --copy-gib 1 --rep 50 --out "$OUT/slow_step_rounds.json" 2>&1 \
        | tee "$OUT/slow_step_rounds.log" | grep -E "slow step|HBM|FAIL"
    python3 bench/kernels/probe_balanced_launch.py --out "$OUT/probe_timed.json" 2>&1 | tail -2
    if command -v ncu >/dev/null; then
        ncu --clock-control none --set full -k regex:_two_segment_decode_stage1 --launch-skip 4 --launch-count 2 -f \
            -o "$OUT/balance" python3 bench/kernels/probe_balanced_launch.py --rounds 1 --out "$OUT/probe_ncu.json" 2>&1 | tail -3
        ncu --import "$OUT/balance.ncu-rep" --page details > "$OUT/balance_ncu_details.txt" 2>&1
        grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Grid Size|Block Limit" \
            "$OUT/balance_ncu_details.txt" | head -40
    fi
    ;;
fastbalance)
    # session 38: with every row alike the balanced launch took 24-31% longer than the
    # unbalanced one at 32768 x 8 and 8192 x 32 (28 layers, bench_mixed_rows), the same
    # partition a request; natural sfi balances every step. Session 39's pair under
    # Nsight Compute: the same instructions and average SM-active cycles, 1.55-1.75x the
    # elapsed ones. Session 40: the gated pair (BALANCE_GATE, now the default: the plain
    # twin runs where rows are all alike) brought it to ~the plain launch; split-major
    # (BALANCE_SPLIT_MAJOR) was slower there but faster with a dense row among sparse
    # ones. Here: by the grid's factor, the balanced launch alone, split-major, gated,
    # and gated split-major (the next default's candidate), every row dense too ("all":
    # an all-slow SFI step, which balances where that doubles its programs); then the
    # four launches (five kernels) timed, recorded and profiled.
    # and the balanced launch filling the GPU (the gate keeps it to mixed steps): the
    # grid's factor 4 / 16 by the shares' P at the heuristic's 2 an SM (0), 4 (an fp8
    # tile's resident programs) or 8 (two waves) (BALANCE_FACTOR, BALANCE_PROGRAMS_PER_SM)
    # session 41: factor 16 / P 4 became fp8's defaults (0:0); 4:2 is the old default.
    # (Session 42 timed a compact grid here, one program a request's split: no faster; gone.)
    for fp in 0:0 4:2; do
        f=${fp%:*}; p=${fp#*:}
        python3 bench/kernels/bench_mixed_rows.py --cases 8192x32,32768x8,131072x4 --dense 0,1,all --kv-dtype fp8_e4m3 \
            --factor $f --programs-per-sm $p --variants --out "$OUT/mixed_rows_factor${f}_pps$p.json" 2>&1 \
            | tee "$OUT/mixed_rows_factor${f}_pps$p.log" | grep -E "^\| [0-9]|Error" | sed "s/^/f$f p$p /"
    done
    # one layer's four launches alternately, CUDA events (medians of 30), then each once
    # recording where its programs ran (SM, start, end: the block scheduler's deal)
    for cb in 8192:32 32768:8; do
        python3 bench/kernels/probe_balanced_launch.py --rows sparse --ctx ${cb%:*} --batch ${cb#*:} --variants \
            --record --rounds 30 --out "$OUT/probe_timed_${cb%:*}x${cb#*:}.json" 2>&1 | tail -5
    done
    if command -v ncu >/dev/null; then
        for cb in 8192:32 32768:8; do
            ncu --clock-control none --set full -k regex:_two_segment_decode_stage1 --launch-skip 10 --launch-count 5 -f \
                -o "$OUT/fast_${cb%:*}x${cb#*:}" python3 bench/kernels/probe_balanced_launch.py --rows sparse --ctx ${cb%:*} \
                --batch ${cb#*:} --variants --rounds 1 --out "$OUT/probe_fast_${cb%:*}x${cb#*:}.json" 2>&1 | tail -2
            ncu --import "$OUT/fast_${cb%:*}x${cb#*:}.ncu-rep" --page details > "$OUT/fast_${cb%:*}x${cb#*:}_ncu.txt" 2>&1
            grep -E "^  _two|Duration|SM Active Cycles|Elapsed Cycles  |Registers Per|Grid Size|Achieved Occupancy|DRAM Throughput" \
                "$OUT/fast_${cb%:*}x${cb#*:}_ncu.txt" | head -30
            rm -f "$OUT/fast_${cb%:*}x${cb#*:}.ncu-rep"
        done
    fi
    ;;
splits)
    # our kernel at forced split counts over the grid's shapes (bf16; what the split
    # heuristic should pick on this GPU), CUDA-graph replay
    python3 bench/kernels/bench_decode.py --contexts 8192,32768,131072 --batches 1,4,8,32 --fractions 1/64,1/16,1/4,1 \
        --no-indexed --no-fused --no-flashinfer --split-counts 1,2,4,8,16,32,64 --copy-gib 1 \
        --out "$OUT/decode_splits.json" 2>&1 | tee "$OUT/decode_splits.log" | grep -E "splits ctx|HBM|FAIL"
    ;;
tests)
    python3 -m pytest -q -rP -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    ;;
selector)
    python3 bench/kernels/bench_selector.py --out "$OUT/selector.json" --stats-ab --pack-ab ${PROFILE:+--profile $PROFILE} 2>&1 | tee "$OUT/selector.log" | tail -16
    ;;
e2e)
    python3 bench/gpu/make_random_model.py --shape "${SHAPE:-qwen3-1.7b}" --out /root/model --max-pos 140000 --qk-norm-gain "${QK_NORM_GAIN:-1}"
    python3 bench/gpu/server_compare.py --model /root/model --cases "${CASES:-8192x8,2048x64}" --backends "${BACKENDS:-flashinfer,sgl_sparse}" \
        --repeats "${REPEATS:-3}" --out-len "${OUT_LEN:-128}" --sparse-extra "--sparse-config ${SPARSE_CONFIG:-bench/gpu/sparse_config.yaml}" --policies "${POLICIES:-full,streaming:2048,sadas:2048}" \
        ${INTERLEAVE:+--interleave} ${NO_QA_COVERING:+--no-qa-covering} ${ITL:+--itl} ${GRAPH_MAX_BS:+--graph-max-bs "$GRAPH_MAX_BS"} --extra="${EXTRA---disable-prefill-cuda-graph}" --prefill-runs "${PREFILL_RUNS:-2}" --out "$OUT/e2e.json" --logdir "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -30
    # what the first server's start-up compiled (FlashInfer's JIT, ~4 min on a bare
    # machine): whether it is small enough to carry to the next lease
    du -sh ~/.cache/* 2>/dev/null | tee -a "$OUT/e2e.log"
    # Our kernels that Triton compiled after the servers were up (compile_watch.py):
    # each one stalled a live batch.
    grep -h "Triton compiled .* while serving" "$OUT"/server-*.log | tee "$OUT/compiles_while_serving.txt" | tail -20
    # SFI refresh graphs captured (selector/graphs.py): each held one step, timestamped.
    grep -H "SFI refresh graph captured" "$OUT"/server-*.log > "$OUT/refresh_graph_captures.txt"
    wc -l "$OUT/refresh_graph_captures.txt" | tee -a "$OUT/e2e.log"
    ;;
profile)
    python3 bench/gpu/make_random_model.py --shape "${SHAPE:-qwen3-1.7b}" --out /root/model --max-pos 140000 --qk-norm-gain "${QK_NORM_GAIN:-1}"
    python3 bench/gpu/profile_decode.py --model /root/model --case "${CASE:-32768x8}" \
        --runs "${RUNS:-flashinfer:stock,sgl_sparse:streaming:16,sgl_sparse:streaming:2048,sgl_sparse:sfi-pinned}" \
        --sparse-extra "--sparse-config ${SPARSE_CONFIG:-bench/gpu/sparse_config.yaml}" \
        --mem-fraction-static "${MEM_FRACTION:-0.8}" ${TIMELINE:+--timeline "$TIMELINE"} --extra="${EXTRA:-}" --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" | tail -40
    ;;
esac
# the JIT snapshot (JIT_SNAPSHOT=1), what this lease compiled, past 8 files one archive
bash "$(dirname "$0")/finish_out.sh" "$what"
