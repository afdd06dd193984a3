#!/usr/bin/env bash
# A fresh lease's last wheelhouse call (bench/README "How the GPU runs are made"): the
# sixth part (carried as .gpu/p6) joins the five copied to /root/parts by the calls
# before, every wheel and this project's (.gpu/b3) go into /tmp/site, then run_all.sh
# runs the mode given (default: tests). A part missing (the machine went back between
# calls and the next one started bare) stops here, naming what /root/parts holds.
#
#   run(carry=[".gpu/p6", ".gpu/b3"], command="bash bench/gpu/install_lease.sh tests")
#   run(..., command="bash bench/gpu/install_lease.sh install && CASES=... bash bench/gpu/e2e_watchdog.sh")
#     (mode `install`: the wheels only, so that the same call can run what run_all.sh's
#     modes do not, such as the e2e under its watchdog)
#
# No server is started to build FlashInfer's JIT beside the tests: session 52's crashed
# next to them and the wait for it cost ~350 s; the first e2e's warm-up builds it
# (server_compare.warm_requests).
# LEASE_ROOT / SITE: where the parts and wheels go and where they install (/root,
# /tmp/site on the device; run_all.sh reads /tmp/site); the CPU test points them at a
# temporary directory.
set -uo pipefail
parts=${PARTS:-6}
root=${LEASE_ROOT:-/root}
site=${SITE:-/tmp/site}
mkdir -p "$root/parts" && cp .gpu/p6/* "$root/parts/"
have=$(ls "$root/parts" | wc -l)
if [ "$have" -ne "$parts" ]; then
    echo "install_lease: $have of $parts wheelhouse parts in $root/parts ($(ls "$root/parts" | tr '\n' ' ')): copy the missing ones first" >&2
    exit 1
fi
mkdir -p "$root/wh" && cat "$root"/parts/* | tar x -C "$root/wh" || exit 1
cp "$root"/wh/c*/*.whl .gpu/b3/*.whl "$root/wh/"
python3 -m pip install -q --no-index --no-deps --target "$site" "$root"/wh/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
[ "${1:-tests}" = install ] && exit 0
exec bash bench/gpu/run_all.sh "${1:-tests}"
