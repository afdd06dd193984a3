"""Which tests CI runs under one SGLang version only, and the guard that keeps that sound.

.ci/run tests every supported SGLang version in a venv of its own. A test module that
declares ``pytestmark = pytest.mark.sglang_independent`` (and every test under
tests/kernels, marked here) runs in the first version's run only: it must give the
same result under every version, i.e. load neither SGLang, nor the compatibility layer
(sgl_sparse.compat), nor any package whose version differs between the versions' venvs.
Tests are run under every version unless marked, so a new test module is covered by
default.

The mark is checked, so that a test touching SGLang is not silently run once:

* importing the marked modules loads none of those (tests/test_ci_layout.py, in a
  fresh interpreter);
* while a marked test (its fixtures included) runs: importing one of them raises
  ImportError, also when an earlier test already loaded it (it is hidden from
  ``sys.modules`` for the test, with every first-party module that uses it); a Python
  subprocess gets the same import block (``sitecustomize`` on ``PYTHONPATH``; one started
  with an environment of its own, e.g. ``server_env()``, gets it added to that mapping).

"The packages whose version differs": those SGLang pins (its metadata requirements with
an == version, torch aside: .ci/install_sglang.sh pins one torch for all) plus,
in CI, ``$SGL_SPARSE_VERSIONED_DISTS``: the distributions whose versions differ between
the venvs, as .ci/run computes them after installing every version.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess  # noqa: F401  (its audit events are what the guard watches)
import sys
import tempfile
from pathlib import Path

import pytest

MARK = "sglang_independent"
#: Tests that do load SGLang, but only to drive one of our own features (a store
#: layout, the load-test scenarios, a benchmark script) through the server entry points
#: that the unmarked tests already exercise under every version: CI runs them under
#: the first version only (.ci/run), to keep the later versions' run to the SGLang
#: surface itself. Not guarded: they may import anything.
FIRST_VERSION_ONLY = "first_version_only"
KERNELS = Path(__file__).resolve().parent / "kernels"
FIRST_PARTY = ("sgl_sparse", "sgl_sparse_entry", "tests")
ENV_BLOCKED = "SGL_SPARSE_BLOCKED_IMPORTS"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def versioned_dists() -> set[str]:
    """Distribution names (normalized) whose versions may differ between SGLang versions."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    names = {"sglang"}
    try:
        requires = distribution("sglang").requires or []
    except PackageNotFoundError:
        requires = []
    for raw in requires:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if any(s.operator in ("==", "===") for s in req.specifier) and _norm(req.name) != "torch":
            names.add(_norm(req.name))
    names |= {_norm(n) for n in os.environ.get("SGL_SPARSE_VERSIONED_DISTS", "").split()}
    return names


def blocked_modules() -> list[str]:
    """Top-level import names of versioned_dists() installed here, and sgl_sparse.compat."""
    from importlib.metadata import packages_distributions

    dists = versioned_dists()
    tops = {top for top, ds in packages_distributions().items() if any(_norm(d) in dists for d in ds)}
    return sorted(tops | {"sglang", "sgl_sparse.compat"})


def is_blocked(name: str, blocked) -> bool:
    return any(name == b or name.startswith(b + ".") for b in blocked)


class ImportBlocker:
    """A sys.meta_path finder that refuses the blocked modules."""

    def __init__(self, blocked):
        self.blocked = tuple(blocked)

    def find_spec(self, name, path=None, target=None):
        if is_blocked(name, self.blocked):
            raise ImportError(f"{name} imported by a test marked {MARK}: it runs under one SGLang version "
                              f"only (tests/ci_legs.py); drop the mark if it needs {name}")
        return None


# What a Python subprocess of a marked test runs first (Guard puts it on PYTHONPATH).
_SITECUSTOMIZE = f"""\
import os, sys
class _Blocker:
    blocked = tuple(os.environ.get({ENV_BLOCKED!r}, "").split(","))
    def find_spec(self, name, path=None, target=None):
        if any(b and (name == b or name.startswith(b + ".")) for b in self.blocked):
            raise ImportError(name + " imported by a subprocess of a test marked {MARK} (tests/ci_legs.py)")
sys.meta_path.insert(0, _Blocker())
"""


class Guard:
    def __init__(self):
        self.blocked = tuple(blocked_modules())
        self.blocker = ImportBlocker(self.blocked)
        self.site_dir = tempfile.mkdtemp(prefix="sgl-sparse-guard-")
        atexit.register(shutil.rmtree, self.site_dir, True)
        self.extended = []
        Path(self.site_dir, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        self.active = False
        self.python = {os.path.realpath(sys.executable)}
        sys.addaudithook(self._audit)

    def _audit(self, event, args):
        if not self.active or event != "subprocess.Popen":
            return
        executable, argv, _cwd, env = args
        prog = os.fsdecode(executable if executable is not None else (argv[0] if argv else ""))
        is_python = re.fullmatch(r"python[0-9.]*", os.path.basename(prog)) is not None or \
            os.path.realpath(prog) in self.python
        if is_python and env is not None:
            # An environment of its own (server_env(), ...): the mapping Popen is about
            # to pass on gets the import block too.
            # (undone when the test ends: the caller may reuse the mapping).
            try:
                before = {k: env.get(k) for k in ("PYTHONPATH", ENV_BLOCKED)}
                paths = (env.get("PYTHONPATH") or "").split(os.pathsep)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.site_dir] + [
                    p for p in paths if p != self.site_dir]))
                env[ENV_BLOCKED] = ",".join(self.blocked)
                self.extended.append((env, before))
            except TypeError as e:  # a read-only mapping
                raise RuntimeError(f"a test marked {MARK} starts {argv!r} with an environment the import guard "
                                   "cannot extend (tests/ci_legs.py)") from e

    def _uses_blocked(self, value, gone) -> bool:
        if id(value) in gone:
            return True
        try:
            mod = getattr(value, "__module__", None)
        except Exception:  # noqa: BLE001  (a proxy object may raise anything)
            return False
        return isinstance(mod, str) and is_blocked(mod, self.blocked)

    def _hide(self) -> list:
        """Take the blocked modules and the first-party modules using them out of
        sys.modules (and off their parent packages); returns what to put back."""
        hidden = {n: m for n, m in sys.modules.items() if is_blocked(n, self.blocked)}
        ours = {n: m for n, m in sys.modules.items()
                if n.split(".")[0] in FIRST_PARTY and n not in hidden and m is not None}
        grew = True
        while grew:  # modules using a hidden module (or an object of one), transitively
            grew = False
            gone = set(map(id, hidden.values()))
            for n, m in list(ours.items()):
                if any(self._uses_blocked(v, gone) for v in list(vars(m).values())):
                    hidden[n] = ours.pop(n)
                    grew = True
        restore = []
        for n, m in hidden.items():
            del sys.modules[n]
            parent, _, child = n.rpartition(".")
            p = sys.modules.get(parent)
            if p is not None and getattr(p, child, None) is m:
                delattr(p, child)
                restore.append((p, child, m))
        return [hidden, restore]

    def __enter__(self):
        self.saved = self._hide()
        self.env = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_BLOCKED)}
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [self.site_dir, self.env["PYTHONPATH"]]))
        os.environ[ENV_BLOCKED] = ",".join(self.blocked)
        sys.meta_path.insert(0, self.blocker)
        self.active = True

    def __exit__(self, *exc):
        self.active = False
        sys.meta_path.remove(self.blocker)
        for env, before in self.extended:
            for k, v in before.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
        self.extended.clear()
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        hidden, restore = self.saved
        for n in [n for n in sys.modules if is_blocked(n, self.blocked)]:
            del sys.modules[n]  # nothing blocked can have loaded; belt and braces
        sys.modules.update(hidden)
        for p, child, m in restore:
            setattr(p, child, m)


_guard: Guard | None = None


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}: loads neither SGLang nor the compatibility layer; CI runs it "
                                       "under the first SGLang version only (tests/ci_legs.py)")
    config.addinivalue_line("markers", f"{FIRST_VERSION_ONLY}: drives one of our features through server entry "
                                       "points other tests cover under every version; CI runs it under the first "
                                       "SGLang version only (tests/ci_legs.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if KERNELS in Path(str(item.fspath)).resolve().parents:
            item.add_marker(MARK)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _guarded(item):
        yield


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _guarded(item):
    global _guard
    if item.get_closest_marker(MARK) is None:
        return _Null()
    if _guard is None:
        _guard = Guard()
    return _guard
