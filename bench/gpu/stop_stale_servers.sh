#!/usr/bin/env bash
# Stop SGLang servers that an earlier device call left running, before this call uses
# the GPU. server_compare.py and profile_decode.py start each server in a session of
# its own (so that they can kill its whole process group), and the device tool's
# end-of-call cleanup spares such a process: a call the tool stops at its 600 s limit
# leaves its server running on the warm machine, holding its KV pool and its share of
# the GPU. Session 55: 0q's call was stopped at 600 s with an sgl_sparse server up; in
# the next call it still answered on port 30000, the new servers could not start
# beside it, and every row of that call measured the stale server (discarded).
#
# Prints what it stopped (nothing when there was nothing) and exits 0; waits up to
# WAIT seconds (default 30) for the processes to be gone, so that their GPU memory is
# free when the caller starts its own servers. The processes: server_pattern.sh.
set -u
. "$(dirname "$0")/server_pattern.sh"
pattern=$SERVER_PATTERN
wait_s=${WAIT:-30}
pids=$(pgrep -f "$pattern")
[ -z "$pids" ] && exit 0
echo "stop_stale_servers: stopping $(echo "$pids" | wc -l) server process(es) an earlier call left running:"
ps -o pid=,etimes=,args= -p "$(echo "$pids" | paste -sd,)" | cut -c1-160
# SIGKILL at once: a server stopped by the tool's limit has nothing left to flush, and
# a SIGTERM'd scheduler can take tens of seconds to let go of the GPU.
echo "$pids" | xargs -r kill -9 2>/dev/null
for _ in $(seq "$wait_s"); do
    pgrep -f "$pattern" >/dev/null || exit 0
    sleep 1
done
echo "stop_stale_servers: still running after ${wait_s} s: $(pgrep -f "$pattern" | paste -sd' ')" >&2
exit 0
