"""Launch a real SGLang server subprocess on a CPU-only machine (for tests).

    from tests.server import launch_server, running_server

    handle = launch_server(model_dir, "torch_native")
    try:
        requests.post(handle.url + "/generate", json={...})
    finally:
        handle.stop()

    # or, as a context manager / in a pytest fixture:
    with running_server(model_dir, "torch_native") as handle:
        ...

The server is ``python -m sglang.launch_server`` run with the *current*
interpreter (``sys.executable``; override with ``python=``), in its own process
group (``stop()`` kills the whole group: tokenizer manager, scheduler and
detokenizer subprocesses).  Its environment gets:

* ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU engine switch),
* ``tests/cpu_stand_ins`` prepended to ``PYTHONPATH`` (pure-torch ``sgl_kernel``
  and a ``torchvision`` stub; see tests/cpu_stand_ins/README.md).  The
  scheduler/detokenizer processes are started with multiprocessing "spawn" and
  inherit the environment, so they see the stand-ins too.

stdout+stderr go to a log file (``handle.log_path``); if the process dies or
``/health`` does not answer in time, ``ServerLaunchError`` is raised with the
log tail.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
STAND_INS_DIR = Path(__file__).resolve().parent / "cpu_stand_ins"

# Arguments every CPU test server gets (sized for a tiny model on a 2-core box).
DEFAULT_CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--host", "127.0.0.1",
    "--tp-size", "1",
    "--max-total-tokens", "8192",
    "--max-running-requests", "8",
    "--max-prefill-tokens", "4096",
    "--chunked-prefill-size", "4096",
    "--mem-fraction-static", "0.05",
    "--disable-cuda-graph",
    "--random-seed", "0",
    "--log-level", "info",
    # An idle scheduler otherwise polls in a busy loop: one of CI's two cores per
    # server, taken from the tests and servers running beside it.
    "--sleep-on-idle",
)


class ServerLaunchError(RuntimeError):
    pass


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def find_free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port below the kernel's ephemeral range. A port the kernel hands out
    (bind to port 0) can be handed out again, to another socket, before the server we
    pick it for binds it: a `--tp-size 2` server picks its rendezvous port and opens its
    gloo sockets that way while it starts, and one took the HTTP port once in CI
    (uvicorn: address already in use; the server then never got healthy)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        # a margin below `low`: SGLang derives a few ports of its own from --port
        port = rng.randrange(10000, max(10001, low - 1100))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in [10000, {low - 1100})")


def _tail(path: Path, n: int = 80) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines[-n:])


def run_snippet(code: str, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter with the installed SGLang (its CPU stand-ins on
    the path, as a CPU server has them) and return the JSON it printed last on a line
    starting ``RESULT ``."""
    import json

    proc = subprocess.run([sys.executable, "-c", code], env=server_env(), capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def server_env(env_extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment a CPU test server (and its subprocesses) runs with."""
    env = dict(os.environ)
    extra = dict(env_extra or {})
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # PYTHONPATH = stand-ins, then env_extra's PYTHONPATH, then the caller's.
    paths = [str(STAND_INS_DIR)]
    for p in (extra.pop("PYTHONPATH", None), env.get("PYTHONPATH")):
        if p:
            paths.append(p)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Keep the 2-core CI box responsive; tiny models gain nothing from threads.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


@dataclass
class ServerHandle:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    startup_s: float = float("nan")
    _log_file: object = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 80) -> str:
        return _tail(self.log_path, n)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server and everything in its process group.

        SIGTERM goes to the server process first (SGLang then shuts down its
        scheduler/detokenizer itself); whatever is left of the process group
        after ``timeout`` seconds, or after the server exits, gets SIGKILL.
        """
        proc = self.process
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        # The group id is the server's pid (start_new_session=True), so this
        # cannot hit unrelated processes; it reaps scheduler/detokenizer too.
        if pgid is not None and pgid == proc.pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def launch_server(
    model_dir: os.PathLike | str,
    attention_backend: str = "torch_native",
    port: Optional[int] = None,
    extra_args: Sequence[str] = (),
    env_extra: Optional[Mapping[str, str]] = None,
    *,
    dtype: str = "float32",
    timeout: float = 300.0,
    log_path: Optional[os.PathLike | str] = None,
    python: Optional[str] = None,
) -> ServerHandle:
    """Start ``sglang.launch_server`` on CPU and wait until ``/health`` is 200.

    ``dtype`` defaults to float32 because SGLang's ``--dtype auto`` maps a
    float32 checkpoint (what tests/tiny_model.py writes) to float16.
    ``extra_args`` are appended last, so they override the defaults.
    """
    host = "127.0.0.1"
    port = port or find_free_port(host)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"sglang-{attention_backend}-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    cmd = [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path", str(model_dir),
        "--attention-backend", attention_backend,
        "--port", str(port),
        "--dtype", dtype,
        *DEFAULT_CPU_ARGS,
        *extra_args,
    ]
    log_file = open(log_path, "w")
    log_file.write("$ " + " ".join(cmd) + "\n")
    log_file.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=server_env(env_extra),
        cwd=str(REPO_ROOT),
        start_new_session=True,  # own process group -> stop() kills all of it
    )
    handle = ServerHandle(
        url=f"http://{host}:{port}",
        port=port,
        process=proc,
        log_path=log_path,
        command=cmd,
        _log_file=log_file,
    )
    deadline = t0 + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise ServerLaunchError(
                    f"SGLang server exited with code {proc.returncode} during start-up "
                    f"(log {log_path}):\n{handle.log_tail()}"
                )
            if _health_ok(handle.url):
                break
            if time.monotonic() > deadline:
                raise ServerLaunchError(
                    f"SGLang server not healthy after {timeout:.0f}s (log {log_path}):\n"
                    f"{handle.log_tail()}"
                )
            time.sleep(0.5)
    except BaseException:
        handle.stop()
        raise
    handle.startup_s = time.monotonic() - t0
    return handle


@contextlib.contextmanager
def running_server(
    model_dir: os.PathLike | str,
    attention_backend: str = "torch_native",
    port: Optional[int] = None,
    extra_args: Sequence[str] = (),
    env_extra: Optional[Mapping[str, str]] = None,
    **kwargs,
) -> Iterator[ServerHandle]:
    """Context-manager form of :func:`launch_server`; always stops the server.

    pytest fixture example::

        @pytest.fixture(scope="module")
        def server(tmp_path_factory):
            model = make_tiny_qwen3(tmp_path_factory.mktemp("m"))
            with running_server(model, "torch_native") as h:
                yield h
    """
    handle = launch_server(model_dir, attention_backend, port, extra_args, env_extra, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


def greedy_generate(url: str, ids: Sequence[int], sparse: Optional[dict] = None, max_new_tokens: int = 16,
                    timeout: float = 600) -> dict:
    """POST /generate: greedy, `max_new_tokens` exactly, the request's sgl_sparse metadata
    (None: the server default); the JSON answer, after asserting HTTP 200."""
    import requests

    sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    if sparse is not None:
        sp["custom_params"] = {"sparse": sparse}
    resp = requests.post(url + "/generate", json={"input_ids": list(ids), "sampling_params": sp}, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()
