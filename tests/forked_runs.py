"""Several short Python runs that each need SGLang imported, for one SGLang import.

    from tests.forked_runs import Run, run_forked

    runs = [Run(args=["--help"], cwd=d1, module="sglang.launch_server"),
            Run(args=["-c", model], cwd=d2, code=SNIPPET)]
    results = run_forked(runs, preload=["sglang.srt.server_args"])
    results[0].returncode, results[0].stdout, results[0].stderr

A fresh ``python -m sglang.launch_server`` spends ~15 s of CPU importing SGLang before it
reads its arguments; tests that check how start-up handles a command line (exit code,
what stderr names) pay that per command line, once per SGLang version in CI. Here one
Python process (``server_env()``: the CPU stand-ins, as for a server) imports
``preload`` once, then forks one child per run, one after the other. The child starts
from that state as a fresh process would be after those imports: it enters the run's
working directory, puts it first on ``sys.path`` (what ``python -m`` / ``-c`` do) and
runs the module as ``__main__`` (``runpy``, like ``-m``) or the code (like ``-c``) with
the run's ``sys.argv``; its stdout and stderr go to files, its exit status is what
``SystemExit`` or an uncaught exception gives the interpreter. Everything the runs load
beyond ``preload`` (SGLang's plugins: this package's entry point) is loaded by each
child itself, so preload only what a fresh process imports before the behaviour under
test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tests.server import server_env

_ZYGOTE = r"""
import importlib, json, os, runpy, signal, sys, time, traceback

runs, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in preload:
    importlib.import_module(name)


def child(run):
    os.setsid()  # its own process group: a run that starts a server is killed whole
    with open(run["stdout"], "wb") as out, open(run["stderr"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    os.chdir(run["cwd"])
    sys.path[0] = run["cwd"]
    try:
        if run["module"]:
            sys.argv = [run["module"], *run["args"]]
            runpy.run_module(run["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = run["args"]
            exec(compile(run["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as e:  # as the interpreter treats it at exit
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


codes = []
for run in runs:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(run)
        finally:
            os._exit(70)  # not reached unless child() itself broke
    deadline = time.monotonic() + run["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes.append(None)
            break
        time.sleep(0.05)
    try:  # whatever the run left in its process group
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
print("FORKED_RUNS " + json.dumps(codes))
"""


@dataclass
class Run:
    args: Sequence[str]
    cwd: Path
    module: Optional[str] = None  # run as `python -m module *args`
    code: Optional[str] = None  # or as `python -c code *args` (args[0] is then "-c")
    timeout: float = 240.0


@dataclass
class Result:
    returncode: Optional[int]  # None: killed at the run's timeout
    stdout: str
    stderr: str


def run_forked(runs: Sequence[Run], preload: Sequence[str], timeout: float = 600.0) -> list[Result]:
    assert all((r.module is None) != (r.code is None) for r in runs), "a module or code per run"
    with tempfile.TemporaryDirectory(prefix="forked-runs-") as tmp:
        spec = [{"args": list(r.args), "cwd": str(Path(r.cwd).resolve()), "module": r.module, "code": r.code,
                 "timeout": r.timeout, "stdout": f"{tmp}/{i}.out", "stderr": f"{tmp}/{i}.err"}
                for i, r in enumerate(runs)]
        # Started outside the checkout: `-c` puts its working directory on sys.path, and
        # the preload must not pick up anything from there.
        proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(spec), json.dumps(list(preload))],
                              cwd=tmp, env=server_env(), capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FORKED_RUNS ")]
        assert proc.returncode == 0 and lines, f"the forking process failed:\n{proc.stderr[-3000:]}"
        codes = json.loads(lines[-1][len("FORKED_RUNS "):])
        return [Result(code, Path(s["stdout"]).read_text(errors="replace"), Path(s["stderr"]).read_text(errors="replace"))
                for code, s in zip(codes, spec)]
