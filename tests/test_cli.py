"""The plugin as SGLang's CLI sees it, in fresh `python -m sglang.launch_server`
processes: registration, flags, start-up errors that name the field, and the
shadowed-package pitfall failing loudly instead of as an argparse 'invalid choice'."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server import server_env
from tests.tiny_model import make_tiny_qwen3

pytestmark = pytest.mark.timeout(600)


def _launch(args: list[str], cwd, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        cwd=cwd, env=server_env(), capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-cli"), seed=1)


def test_help_lists_backend_and_flags(tmp_path):
    out = _launch(["--help"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sgl_sparse" in out.stdout
    for flag in ("--sparse-default-policy", "--sparse-config"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    "text, words",
    [
        ("policies:\n  streaming:\n    window: 0\n", "policies.streaming.window: Input should be greater than or equal to 1"),
        ("default_policy: turbo\n", "default_policy: Input should be 'full', 'streaming', 'sadas', 'sfi', 'quest', "
         "'asyncspade' or 'lfps'"),
    ],
)
def test_bad_config_file_stops_startup_naming_the_field(tmp_path, model_dir, text, words):
    cfg = tmp_path / "sparse.yaml"
    cfg.write_text(text)
    out = _launch(["--model-path", str(model_dir), "--device", "cpu", "--attention-backend", "sgl_sparse",
                   "--sparse-config", str(cfg)], cwd=tmp_path)
    assert out.returncode == 2
    assert words in out.stderr and "--sparse-config" in out.stderr


def test_bad_default_policy_flag_is_an_argparse_error(tmp_path, model_dir):
    out = _launch(["--model-path", str(model_dir), "--attention-backend", "sgl_sparse",
                   "--sparse-default-policy", "fast"], cwd=tmp_path)
    assert out.returncode == 2 and "--sparse-default-policy" in out.stderr and "invalid choice" in out.stderr


def test_sparse_flags_without_the_backend_are_rejected(tmp_path, model_dir):
    out = _launch(["--model-path", str(model_dir), "--attention-backend", "torch_native",
                   "--sparse-default-policy", "streaming"], cwd=tmp_path)
    assert out.returncode == 2 and "need --attention-backend sgl_sparse" in out.stderr


def test_shadowing_folder_fails_loudly(tmp_path, model_dir):
    (tmp_path / "sgl_sparse").mkdir()  # e.g. a checkout or data folder with the package's name
    out = _launch(["--model-path", str(model_dir), "--device", "cpu", "--attention-backend", "sgl_sparse"], cwd=tmp_path)
    assert out.returncode != 0
    assert "sgl_sparse plugin failed to load" in out.stderr
    assert "shadows the installed package" in out.stderr
    assert "invalid choice" not in out.stderr
