"""bench/gpu/install_lease.sh, the lease's last wheelhouse call, on the CPU: the parts of
a real tar of real wheels joined, every wheel installed with pip into the site
directory, then run_all.sh's mode; a missing part stops it before `tar`, naming what
is there. Stand-in (test only): bench/gpu/run_all.sh, which needs the GPU, is a script
that records its argument in the temporary checkout the test runs from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang_independent

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "install_lease.sh"


def _wheel(where: Path, name: str) -> Path:
    """A minimal pure-Python wheel that pip installs: one module, its metadata."""
    path = where / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": f"NAME = {name!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def _lease(tmp_path: Path, parts_copied: int):
    """A checkout with .gpu/p6 and .gpu/b3, the five earlier parts (or fewer) already
    copied to the lease root, and the stand-in run_all.sh."""
    work, root, site = tmp_path / "checkout", tmp_path / "root", tmp_path / "site"
    for d in ("c1", "c4"):
        (tmp_path / "wh" / d).mkdir(parents=True)
    _wheel(tmp_path / "wh" / "c1", "lease_dep_one")
    _wheel(tmp_path / "wh" / "c4", "lease_dep_two")
    with tarfile.open(tmp_path / "wh.tar", "w") as t:
        for d in ("c1", "c4"):
            t.add(tmp_path / "wh" / d, arcname=d)
    data = (tmp_path / "wh.tar").read_bytes()
    cut = [len(data) * i // 6 for i in range(7)]
    chunks = [data[cut[i]:cut[i + 1]] for i in range(6)]
    (root / "parts").mkdir(parents=True)
    for i in range(parts_copied):
        (root / "parts" / f"wh.part_0{i}").write_bytes(chunks[i])
    (work / ".gpu" / "p6").mkdir(parents=True)
    (work / ".gpu" / "p6" / "wh.part_05").write_bytes(chunks[5])
    (work / ".gpu" / "b3").mkdir()
    _wheel(work / ".gpu" / "b3", "lease_project")
    (work / "bench" / "gpu").mkdir(parents=True)
    (work / "bench" / "gpu" / "run_all.sh").write_text('echo "$1" > ran_mode\n')
    env = {**os.environ, "LEASE_ROOT": str(root), "SITE": str(site),
           # the script's python3 is this interpreter (its pip)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return work, root, site, env


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("mode", ["e2e", "install"])
def test_joins_the_parts_installs_every_wheel_and_runs_the_mode(tmp_path, mode):
    """Mode `install`: the wheels only (the call then runs what it names itself)."""
    work, root, site, env = _lease(tmp_path, parts_copied=5)
    out = subprocess.run(["bash", str(SCRIPT), mode], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    if mode == "install":
        assert not (work / "ran_mode").exists()
    else:
        assert (work / "ran_mode").read_text().strip() == mode
    installed = {p.name for p in site.iterdir()}
    assert {"lease_dep_one", "lease_dep_two", "lease_project"} <= installed, installed
    assert (site / "lease_dep_two" / "__init__.py").read_text() == "NAME = 'lease_dep_two'\n"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_missing_part_stops_before_the_tar(tmp_path):
    work, root, site, env = _lease(tmp_path, parts_copied=4)
    out = subprocess.run(["bash", str(SCRIPT)], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "5 of 6 wheelhouse parts" in out.stderr and "wh.part_05" in out.stderr, out.stderr
    assert not (work / "ran_mode").exists() and not site.exists() and not (root / "wh").exists()
