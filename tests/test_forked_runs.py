"""tests/forked_runs.py, the one-import-many-runs helper of the CLI tests: each run's
exit status, output, working directory and sys.path as a fresh `python -c` / `-m` would
have them, what one run imports is not seen by the next, and a run past its timeout is
killed with its process group."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.forked_runs import Run, run_forked

pytestmark = pytest.mark.sglang_independent

CODE = r"""
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd() == sys.path[0] == os.path.realpath("."))
print("seen", "json" in sys.modules, "wave" in sys.modules)
import wave  # noqa: F401  (loaded here: the next run must not have it)
what = sys.argv[1]
if what == "raise":
    raise ValueError("boom")
if what == "exit-message":
    sys.exit("stopped: reason")
if what == "exit-3":
    sys.exit(3)
if what == "sleep":
    import subprocess, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open("grandchild.pid", "w").write(str(child.pid))
    time.sleep(600)
print("done", file=sys.stderr)
"""


def test_runs_look_like_fresh_processes(tmp_path):
    dirs = [tmp_path / str(i) for i in range(5)]
    for d in dirs:
        d.mkdir()
    (dirs[4] / "local_mod.py").write_text("import sys\nprint('local', sys.argv[1:])\nsys.exit(5)\n")
    runs = [Run(args=["-c", what], cwd=d, code=CODE, timeout=5 if what == "sleep" else 60)
            for what, d in zip(["ok", "raise", "exit-message", "sleep"], dirs)]
    runs += [Run(args=["-c", "exit-3"], cwd=dirs[0], code=CODE), Run(args=["x"], cwd=dirs[4], module="local_mod")]
    ok, raised, message, slept, three, module = run_forked(runs, preload=["json"])
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "argv ['ok'] cwd True\nseen True False\n", "done\n")
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: boom")
    assert "Traceback" in raised.stderr and "seen True False" in raised.stdout  # wave: not from the run before
    assert message.returncode == 1 and message.stderr == "stopped: reason\n"
    assert three.returncode == 3
    assert (module.returncode, module.stdout) == (5, "local ['x']\n")  # `-m`: the working directory's module
    assert slept.returncode is None and "argv ['sleep']" in slept.stdout
    grandchild = int((dirs[3] / "grandchild.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild):  # killed with the run's process group
        assert time.monotonic() < deadline, "the run's subprocess outlived its timeout"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie (killed, not yet reaped by init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
