#!/usr/bin/env bash
# run_all.sh e2e under a watchdog: if it is still running after LIMIT seconds (default
# 480, under the device tool's 600 s per call), record where the servers are before
# killing them, instead of losing the call to the tool's timeout with nothing to show:
# nvidia-smi (a spinning kernel shows 100% utilization, a host deadlock 0%), then
# SIGABRT to every SGLang process so that faulthandler (PYTHONFAULTHANDLER=1, set here
# for the servers) writes every thread's Python stack into the server logs under $OUT.
# STALL=N (default 0: off): the same as soon as nothing under $OUT (server logs,
# e2e.log) has grown for N seconds -- a hung start-up or decode-graph capture is
# caught then, not at LIMIT.
# Usage: CASES=... POLICIES=... LIMIT=480 [STALL=90] bash bench/gpu/e2e_watchdog.sh
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LIMIT="${LIMIT:-480}"
STALL="${STALL:-0}"
export PYTHONFAULTHANDLER=1
bash "$(dirname "$0")/run_all.sh" e2e &
pid=$!
size=-1; still=0; why="still running after ${LIMIT} s"
for _ in $(seq "$LIMIT"); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; exit $?; }
    sleep 1
    if [ "$STALL" -gt 0 ]; then
        now=$(du -sb "$OUT" 2>/dev/null | cut -f1)
        if [ "$now" = "$size" ]; then still=$((still + 1)); else still=0; size=$now; fi
        if [ "$still" -ge "$STALL" ]; then why="no output for ${STALL} s"; break; fi
    fi
done
echo "watchdog: e2e ${why}; dumping state" | tee -a "$OUT/watchdog.txt"
nvidia-smi >> "$OUT/watchdog.txt" 2>&1
ps -eo pid,ppid,etimes,pcpu,args | grep -i "[s]glang\|[s]erver_compare" >> "$OUT/watchdog.txt"
pkill -ABRT -f "[s]glang::" ; sleep 5
pkill -9 -f "[s]glang.launch_server"; pkill -9 -f "[s]glang::"; kill "$pid" 2>/dev/null
exit 124
