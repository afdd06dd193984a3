"""The device calls' guards against the tool's 600 s limit, on the CPU, with real
processes: bench/gpu/stop_stale_servers.sh stops server processes an earlier call left
running in sessions of their own (and nothing else); bench/gpu/e2e_watchdog.sh counts
its LIMIT from the call's start (the age of the oldest process above it, up to its
session's leader, younger than CALL_LIMIT), so it fires before the tool would stop
the call. Both take SERVER_PATTERN here so that they touch only this
test's processes: CI's other leg runs real SGLang servers meanwhile. Stand-in (test
only): bench/gpu/run_all.sh, which needs the GPU, is a script that sleeps."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang_independent,
              pytest.mark.skipif(shutil.which("bash") is None or shutil.which("pgrep") is None,
                                 reason="needs bash and procps")]

GPU = Path(__file__).resolve().parents[1] / "bench" / "gpu"


def _fake_server(name: str) -> subprocess.Popen:
    """A process whose command line carries `name`, in a session of its own, as
    server_compare.py starts SGLang's."""
    return subprocess.Popen(["bash", "-c", f"exec -a '{name} --port 1' sleep 300"], start_new_session=True)


def test_stops_the_matching_processes_only_and_waits_for_them(tmp_path):
    tag = f"sgl-sparse-stale-{uuid.uuid4().hex[:8]}"
    stale = [_fake_server(f"python3 -m {tag}.serve"), _fake_server(f"{tag}::scheduler")]
    other = _fake_server(f"python3 -m not-{tag[::-1]}.server")
    try:
        env = {**os.environ, "SERVER_PATTERN": f"{tag}[.]serve|{tag}::"}
        out = subprocess.run(["bash", str(GPU / "stop_stale_servers.sh")], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "stopping 2 server process(es)" in out.stdout, out.stdout
        assert f"{tag}::scheduler" in out.stdout
        # the script returned only once they were gone: reaping them now does not block
        assert [p.wait(timeout=5) for p in stale] == [-9, -9]
        assert other.poll() is None
        again = subprocess.run(["bash", str(GPU / "stop_stale_servers.sh")], env=env, capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 0 and again.stdout == "", again.stdout
    finally:
        for p in (*stale, other):
            p.kill()
            p.wait()


def _checkout(tmp_path: Path) -> Path:
    work = tmp_path / "checkout"
    (work / "bench" / "gpu").mkdir(parents=True)
    for script in ("e2e_watchdog.sh", "finish_out.sh", "server_pattern.sh"):
        shutil.copy(GPU / script, work / "bench" / "gpu")
    (work / "bench" / "gpu" / "run_all.sh").write_text("sleep 120 >/dev/null 2>&1\n")  # not holding the call's stdout
    return work


@pytest.mark.parametrize("late_start,launch", [(True, "exec bash"), (True, "bash"), (False, "exec bash")])
def test_watchdog_counts_its_limit_from_the_calls_start(tmp_path, late_start, launch):
    """A call that spent 3 s before the watchdog (the install), CALL_LIMIT 8: the
    watchdog fires after ~5 s, not at its LIMIT of 100; its state dump runs and the
    server it names is stopped. A process older than CALL_LIMIT is not a call's start:
    with none younger up to the session's leader, LIMIT stands (checked up to the
    first line). The walk stops at the session's leader: the pytest process above it
    may be younger than these CALL_LIMITs."""
    work, out_dir = _checkout(tmp_path), tmp_path / "out"
    tag = f"sgl-sparse-wd-{uuid.uuid4().hex[:8]}"
    server = _fake_server(f"python3 -m {tag}.serve")
    env = {**os.environ, "OUT": str(out_dir), "LIMIT": "100", "CALL_LIMIT": "8" if late_start else "2",
           "SERVER_PATTERN": f"{tag}[.]serve"}
    # setsid: the call's shell leads a session of its own, as the device tool's does
    # (the watchdog exec'd by the call's shell, or its child: the shell's age counts)
    call = subprocess.Popen(["setsid", "bash", "-c", f"sleep 3; {launch} bench/gpu/e2e_watchdog.sh"], cwd=work,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if not late_start:
            first = call.stdout.readline()
            assert "no process above this one younger than 2 s; LIMIT 100 s" in first, first
            return
        t0 = time.monotonic()
        text, _ = call.communicate(timeout=60)
        took = time.monotonic() - t0
        assert call.returncode == 124, text
        assert "the call started 3 s ago; LIMIT 5 s" in text, text
        # 5 s of LIMIT after the 3 s, then the dump's 5 s pause for the stacks
        assert 8 < took < 20, (took, text)
        assert "still running after 5 s" in (out_dir / "watchdog.txt").read_text()
        assert server.wait(timeout=10) in (-6, -9)
    finally:
        try:  # the call's session: the watchdog and the stand-in's sleep
            os.killpg(call.pid, 9)
        except ProcessLookupError:
            pass
        call.wait()
        server.kill()
        server.wait()


def test_watchdog_stopping_the_e2e_still_returns_the_jit_snapshot_and_packs_past_8_files(tmp_path):
    """The stand-in run_all.sh writes four server logs and a JIT output, then hangs:
    the watchdog's stop must leave what run_all.sh's end would have (finish_out.sh):
    the JIT caches in parts that restore to the same files, what this lease compiled,
    and every other file in one archive, since the device tool returns at most 8 (here
    8 besides the JIT part: session 56's count left the part out and lost two logs)."""
    work, out_dir, root = _checkout(tmp_path), tmp_path / "out", tmp_path / "root"
    (root / ".cache" / "flashinfer" / "decode").mkdir(parents=True)
    (root / ".triton" / "cache" / "ab").mkdir(parents=True)
    (work / "bench" / "gpu" / "run_all.sh").write_text(
        'echo h200 > "$OUT/device.txt"; sleep 1\n'
        'for i in $(seq 4); do echo "$i" > "$OUT/server-$i.log"; done\n'
        'echo so > "$JIT_ROOT/.cache/flashinfer/decode/decode.so"\n'
        'sleep 120 >/dev/null 2>&1\n')
    env = {**os.environ, "OUT": str(out_dir), "LIMIT": "3", "JIT_SNAPSHOT": "1", "JIT_ROOT": str(root),
           "SERVER_PATTERN": f"sgl-sparse-none-{uuid.uuid4().hex[:8]}"}
    call = subprocess.Popen(["setsid", "bash", "bench/gpu/e2e_watchdog.sh"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = call.communicate(timeout=60)
        assert call.returncode == 124, text
        returned = sorted(p.name for p in out_dir.iterdir())
        assert returned == ["jit_cache.tgz.partaa", "run_all_e2e.tgz"], (returned, text)
        assert "JIT outputs built this lease: 1 directories" in text, text
        packed = subprocess.run(["tar", "tzf", str(out_dir / "run_all_e2e.tgz")], capture_output=True,
                                text=True, check=True).stdout.split()
        assert {f"server-{i}.log" for i in range(1, 5)} | {"device.txt", "watchdog.txt",
                                                            "jit_built_this_lease.txt"} <= set(packed), packed
        restored = tmp_path / "restored"
        restored.mkdir()
        subprocess.run(["tar", "xzf", str(out_dir / "jit_cache.tgz.partaa"), "-C", str(restored)], check=True)
        assert (restored / ".cache" / "flashinfer" / "decode" / "decode.so").read_text() == "so\n"
    finally:
        try:
            os.killpg(call.pid, 9)
        except ProcessLookupError:
            pass
        call.wait()


# The tool's limit on what one call carries: the tracked tree plus the carried paths.
CARRY_LIMIT = 64 * 2**20
# The install call's carry beside the tree: the wheelhouse's last part (23.5 MB) and
# this project's wheel (bench/README "How the GPU runs are made"), with room to spare.
INSTALL_CARRY = 26 * 2**20


def test_the_tracked_tree_leaves_room_for_the_install_call():
    """Every device call carries the tracked tree, and the install call the
    wheelhouse's last part and our wheel beside it, under the tool's 64 MiB. Session
    56 found the tree at 38 MiB, 3 MiB short of refusal, mostly results' JSON: a
    result over 100 KB is kept as .json.gz."""
    root = GPU.parents[1]
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    paths = [root / f for f in files.decode().split("\0") if f]
    tree = sum(p.stat().st_size for p in paths if p.is_file())
    assert tree + INSTALL_CARRY <= CARRY_LIMIT, f"tracked tree {tree / 2**20:.1f} MiB"
    big = [str(p.relative_to(root)) for p in paths
           if p.suffix == ".json" and "results" in p.parts and p.is_file() and p.stat().st_size > 100_000]
    assert not big, f"gzip these results (gzip -9, and .json.gz where bench/README names them): {big}"
