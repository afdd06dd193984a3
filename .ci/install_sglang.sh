#!/usr/bin/env bash
# Install SGLang for CPU-only serving into a virtualenv.
#
#   .ci/install_sglang.sh VERSION VENV_DIR
#
# e.g. .ci/install_sglang.sh 0.5.23 /work/venvs/sgl-0.5.23
#
# What it does (idempotent; a re-run with nothing to do takes a few seconds):
#   1. python3.11 -m venv VENV_DIR (reused if it exists)
#   2. torch==2.13.0 (the CPU wheel; every later pip call gets a constraints
#      file pinning torch==2.13.0 so nothing can pull a CUDA torch)
#   3. pip install --no-deps sglang==VERSION
#   4. the CPU serving deps in .ci/requirements-cpu-serving.txt, constrained by
#      the pins SGLang declares in its own wheel METADATA (transformers,
#      tokenizers, openai, xgrammar, apache-tvm-ffi, ...)
#   5. test tools (pytest, pytest-timeout, pyyaml, ruff: tests/test_lint.py)
#   6. an import check (with tests/cpu_stand_ins on PYTHONPATH, which provides
#      the sgl_kernel / torchvision stand-ins; see tests/cpu_stand_ins/README.md)
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 VERSION VENV_DIR" >&2
    exit 2
fi
VERSION="$1"
VENV_DIR="$2"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3.11}"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
REQS="$HERE/requirements-cpu-serving.txt"
STAND_INS="$REPO/tests/cpu_stand_ins"

log() { echo "[install_sglang] $*" >&2; }

# pip, minus known noise: the dependency-resolver report that lists every
# (CUDA) requirement of sglang we skip on purpose, and index-location warnings.
# (pip byte-compiles what it installs: with PYTHONDONTWRITEBYTECODE=1, as on the CI
# machine, nothing else would, and every server start would compile sglang again.)
pip_i() {
    "${PIP[@]}" install -q "$@" 2>&1 | {
        grep -v -E "^ERROR: pip's dependency resolver|^sglang [^ ]+ requires |^WARNING: Location '" || true
    } >&2
    return "${PIPESTATUS[0]}"
}

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    log "creating venv $VENV_DIR"
    "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

# Fast path: everything already installed from the same inputs.
STAMP="$VENV_DIR/.sgl-sparse-install-stamp"
STAMP_KEY="$(cat "$REQS" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1) sglang=$VERSION torch=$TORCH_VERSION"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_KEY" ]]; then
    log "up to date ($VENV_DIR, sglang $VERSION)"
else
    CONSTRAINTS="$VENV_DIR/constraints-sgl-cpu.txt"
    echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

    # 2. torch (CPU wheel; pip's find-links/local index provides torch-2.13.0+cpu)
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
        log "installing torch==$TORCH_VERSION"
        pip_i "torch==$TORCH_VERSION" -c "$CONSTRAINTS"
    fi

    # 3. sglang itself, without its (CUDA) dependency tree
    log "installing sglang==$VERSION (--no-deps)"
    pip_i --no-deps "sglang==$VERSION"
    pip_i packaging -c "$CONSTRAINTS"  # for reading sglang's pins below

    # 4. pins that sglang declares for the packages we install
    "$PY" - "$REQS" >>"$CONSTRAINTS" <<'EOF'
import re, sys
from importlib.metadata import distribution
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

wanted = set()
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if line:
        wanted.add(canonicalize_name(re.split(r"[<>=!~\[; ]", line, 1)[0]))
for raw in distribution("sglang").requires or []:
    req = Requirement(raw)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # extras / other platforms
    name = canonicalize_name(req.name)
    if name in wanted and name != "torch" and req.specifier:
        print(f"{req.name}{req.specifier}")
EOF
    log "constraints: $(tr '\n' ' ' <"$CONSTRAINTS")"

    log "installing CPU serving deps + test tools"
    pip_i -r "$REQS" -c "$CONSTRAINTS" pytest pytest-timeout pyyaml "ruff>=0.6"

    # The sgl-sparse plugin itself is installed by the caller afterwards:
    #   "$VENV_DIR/bin/pip" install -c "$CONSTRAINTS" --no-deps -e "$REPO"

    # Guard: make sure nothing replaced the CPU torch.
    "$PY" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__; assert torch.version.cuda is None, 'CUDA torch got installed'"
    echo "$STAMP_KEY" >"$STAMP"
fi

# 6. import check (cheap; always run)
log "import check"
PYTHONWARNINGS=ignore PYTHONPATH="$STAND_INS${PYTHONPATH:+:$PYTHONPATH}" SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'EOF'
import importlib, sys, time
t = time.time()
import torch, sglang, transformers
for mod in [
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.models.qwen3",
]:
    importlib.import_module(mod)
print(
    f"[install_sglang] ok: sglang {sglang.__version__}, torch {torch.__version__}, "
    f"transformers {transformers.__version__}, python {sys.version.split()[0]} "
    f"(imports {time.time() - t:.1f}s)",
    file=sys.stderr,
)
EOF
