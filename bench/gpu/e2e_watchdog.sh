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
. "$(dirname "$0")/server_pattern.sh"  # the server processes
# The device tool stops a call at 600 s, and with it this watchdog when the same call
# spent time before it (session 55: the install, then LIMIT=570: stopped at 600 s
# before the watchdog fired, no state dumped, and a server left running into the next
# call; stop_stale_servers.sh now clears that). So LIMIT counts from the call's start
# as well, where that is known: the age of the oldest process above this one, up to
# its session's leader, that is younger than CALL_LIMIT (default 575; an older one,
# such as a daemon that runs the calls, is not a call's).
# 575 leaves the stop ~20 s: the stacks' 5 s pause, then finish_out.sh (JIT snapshot, archive).
CALL_LIMIT="${CALL_LIMIT:-575}"
call_age=""; p=$$; sid=$(ps -o sid= -p $$ | tr -d ' ')
while [ -n "$p" ] && [ "$p" -gt 1 ]; do
    age=$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')
    [ -z "$age" ] && break
    if [ "$age" -lt "$CALL_LIMIT" ] && [ "$age" -gt "${call_age:--1}" ]; then call_age=$age; fi
    [ "$p" = "$sid" ] && break
    p=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ')
done
if [ -n "$call_age" ]; then
    [ $((CALL_LIMIT - call_age)) -lt "$LIMIT" ] && LIMIT=$((CALL_LIMIT - call_age))
    echo "watchdog: the call started ${call_age} s ago; LIMIT ${LIMIT} s"
else
    echo "watchdog: no process above this one younger than ${CALL_LIMIT} s; LIMIT ${LIMIT} s"
fi
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
pkill -ABRT -f "$SERVER_PATTERN"; sleep 5
pkill -9 -f "$SERVER_PATTERN"; kill "$pid" 2>/dev/null
# run_all.sh's end did not come: what it would have made ready comes from here
bash "$(dirname "$0")/finish_out.sh" e2e
exit 124
