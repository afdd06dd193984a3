#!/usr/bin/env bash
# What a device call brings back, made ready under $OUT: run at the end of run_all.sh
# and by e2e_watchdog.sh after it stopped the servers, so that a call stopped at its
# LIMIT still returns its JIT snapshot and more than 8 files (session 55's call 6, the
# first e2e on a bare machine, ran out of time before run_all.sh's own end, where both
# were made then).
# Usage: OUT=... [JIT_SNAPSHOT=1] bash bench/gpu/finish_out.sh <what>  (the archive's name)
# JIT_ROOT: where the caches live (default /root; the CPU test points it elsewhere).
set -u
OUT="${OUT:-/tmp/out}"; what="${1:-run}"; root="${JIT_ROOT:-/root}"
# JIT_SNAPSHOT=1: every JIT cache (FlashInfer, tvm-ffi, Triton), to replace .gpu/jit. On
# a fresh machine the stock server's start-up took 4.3 min against 0.5 min warm (session
# 10: decode-graph capture 90 s vs 30 s, then ~2.5 min in its warm-up request). In
# parts under the device tool's 16 MiB a returned file; on the next lease run_all.sh
# restores them (cat .gpu/jit/jit_cache.tgz.part* | tar -xz -C /root).
if [ -n "${JIT_SNAPSHOT:-}" ] && [ -d "$root/.cache" ]; then
    rm -f "$OUT"/jit_cache.tgz.part*
    (cd "$root" && tar -cz .cache/flashinfer .cache/tvm-ffi .triton/cache 2>/dev/null | split -b 15M - "$OUT/jit_cache.tgz.part")
    ls -la "$OUT"/jit_cache.tgz.part* | tee -a "$OUT/e2e.log"
fi
# What this lease compiled in spite of a restored cache (session 17: stock's warm-up
# request still took 134 s on a fresh machine with it): every JIT output written after
# device.txt, i.e. missing from .gpu/jit or rebuilt by ninja.
if [ -f "$OUT/device.txt" ]; then
    find "$root/.cache" "$root/.triton" -newer "$OUT/device.txt" \( -name '*.so' -o -name '*.cubin' \) 2>/dev/null \
        | sed 's|/[^/]*$||' | sort | uniq -c > "$OUT/jit_built_this_lease.txt"
    echo "JIT outputs built this lease: $(wc -l < "$OUT/jit_built_this_lease.txt") directories ($OUT/jit_built_this_lease.txt)"
fi
# The device tool brings back at most 8 files a call (session 31 lost 11 of `fp8` and
# `splits` that way): past 8, the JIT cache's parts counted (session 56 lost two server
# logs beside them), every file but those parts (each under the tool's 16 MiB) goes
# into one archive, run_all_<what>.tgz.
others=$(cd "$OUT" && ls -1 | grep -v '^jit_cache\.tgz\.part' | grep -v '^run_all_.*\.tgz$')
if [ "$(ls -1 "$OUT" | grep -c .)" -gt 8 ]; then
    (cd "$OUT" && tar czf "run_all_$what.tgz" --remove-files $others)
    echo "more than 8 files under $OUT: packed into $OUT/run_all_$what.tgz"
fi
