"""The plugin as SGLang's CLI sees it, in `python -m sglang.launch_server` runs:
registration, flags, start-up errors that name the field, and the shadowed-package
pitfall failing loudly instead of as an argparse 'invalid choice'.

Each command line runs in a process of its own, forked after one import of what
launch_server imports first (tests/forked_runs.py): SGLang's plugins, this package's
entry point among them, are loaded by each run itself, from its own working directory,
as in a fresh process; the ~15 s SGLang import is paid once, not once per command line."""

from __future__ import annotations

import pytest

from tests.forked_runs import Run, run_forked
from tests.tiny_model import make_tiny_qwen3

pytestmark = pytest.mark.timeout(600)

# launch_server's own imports before it loads the plugins and parses its arguments.
PRELOAD = ["sglang.srt.server_args", "sglang.srt.utils"]

BAD_CONFIGS = [
    ("policies:\n  streaming:\n    window: 0\n", "policies.streaming.window: Input should be greater than or equal to 1"),
    ("default_policy: turbo\n", "default_policy: Input should be 'full', 'streaming', 'sadas', 'sfi', 'quest', "
     "'asyncspade' or 'lfps'"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-cli"), seed=1)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, model_dir):
    """name -> the result of `python -m sglang.launch_server ARGS` run in its own directory."""
    def run(name, args, prepare=None):
        cwd = tmp_path_factory.mktemp(name)
        if prepare:
            prepare(cwd)
        return name, Run(args=[a.replace("{cwd}", str(cwd)) for a in args], cwd=cwd, module="sglang.launch_server")

    model = str(model_dir)
    runs = [
        run("help", ["--help"]),
        *(run(f"bad-config-{i}", ["--model-path", model, "--device", "cpu", "--attention-backend", "sgl_sparse",
                                  "--sparse-config", "{cwd}/sparse.yaml"],
              lambda cwd, text=text: (cwd / "sparse.yaml").write_text(text))
          for i, (text, _) in enumerate(BAD_CONFIGS)),
        # asyncspade's cache GPU against the flags: refused before any process starts
        *(run(f"cache-device-{name}", ["--model-path", model, "--device", "cpu", "--attention-backend", "sgl_sparse",
                                       *extra, "--sparse-config", "{cwd}/sparse.yaml"],
              lambda cwd: (cwd / "sparse.yaml").write_text(
                  "query_aware:\n  asyncspade: {slots: 2, cache_device: 'cuda:1'}\n"))
          for name, extra in (("cpu", []), ("tp2", ["--tp-size", "2"]))),
        run("bad-default-policy", ["--model-path", model, "--attention-backend", "sgl_sparse",
                                   "--sparse-default-policy", "fast"]),
        run("flags-without-backend", ["--model-path", model, "--attention-backend", "torch_native",
                                      "--sparse-default-policy", "streaming"]),
        # e.g. a checkout or data folder with the package's name in the working directory
        run("shadowing-folder", ["--model-path", model, "--device", "cpu", "--attention-backend", "sgl_sparse"],
            lambda cwd: (cwd / "sgl_sparse").mkdir()),
    ]
    results = run_forked([r for _, r in runs], preload=PRELOAD)
    return {name: res for (name, _), res in zip(runs, results)}


def test_help_lists_backend_and_flags(launches):
    out = launches["help"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sgl_sparse" in out.stdout
    for flag in ("--sparse-default-policy", "--sparse-config"):
        assert flag in out.stdout


@pytest.mark.parametrize("case", range(len(BAD_CONFIGS)), ids=["window-0", "unknown-policy"])
def test_bad_config_file_stops_startup_naming_the_field(launches, case):
    out = launches[f"bad-config-{case}"]
    _, words = BAD_CONFIGS[case]
    assert out.returncode == 2
    assert words in out.stderr and "--sparse-config" in out.stderr


@pytest.mark.parametrize("case,words", [
    ("cpu", "the selection's cache GPU needs a GPU server; this one runs with --device cpu"),
    ("tp2", "one cache GPU serves one serving GPU, and --tp-size 2 --pp-size 1"),
])
def test_a_cache_device_the_flags_cannot_serve_stops_startup(launches, case, words):
    out = launches[f"cache-device-{case}"]
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--sparse-config: query_aware.asyncspade.cache_device 'cuda:1'" in out.stderr and words in out.stderr


def test_bad_default_policy_flag_is_an_argparse_error(launches):
    out = launches["bad-default-policy"]
    assert out.returncode == 2 and "--sparse-default-policy" in out.stderr and "invalid choice" in out.stderr


def test_sparse_flags_without_the_backend_are_rejected(launches):
    out = launches["flags-without-backend"]
    assert out.returncode == 2 and "need --attention-backend sgl_sparse" in out.stderr


def test_shadowing_folder_fails_loudly(launches):
    out = launches["shadowing-folder"]
    assert out.returncode != 0
    assert "sgl_sparse plugin failed to load" in out.stderr
    assert "shadows the installed package" in out.stderr
    assert "invalid choice" not in out.stderr
