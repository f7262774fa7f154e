#!/usr/bin/env bash
# The Triton environment `.venv-triton`, kept apart from `.venv` because
# nvidia-pytriton (which ships the `tritonserver` binary with the Python
# backend) pins numpy < 2 and protobuf < 7. It also holds what the
# Python-backend model `cosyvoice2` imports when the server runs it: numpy,
# onnxruntime, tokenizers, soxr, soundfile and this project (installed with
# --no-deps, so `cosyedge_models` and `cosyedge_cloud` import from it).
# `cosyedge triton` finds the server here. Idempotent: a stamp of this file
# and pyproject.toml skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=.venv-triton
log() { printf '[setup triton] %s\n' "$*" >&2; }
in_ci() { case "${CI:-}" in 1|true|TRUE|True|yes) return 0;; *) return 1;; esac; }
# Locally: say why and skip (the cloud tests then skip). CI=true: fail loudly.
skip_or_fail() { if in_ci; then log "ERROR (CI=true): $*"; exit 1; fi; log "$*; skipping $VENV"; exit 0; }

# The server's Python backend stub is built per Python minor version
# (3.8-3.13) and links against libpython, so the interpreter must be a shared
# build (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared; Debian: yes).
if [ "$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != 1 ]; then
    skip_or_fail "$PY is not a shared-library build (no libpython): the Triton Python backend cannot run"
fi
case "$(uname -m)" in
    x86_64) ;;
    *) skip_or_fail "nvidia-pytriton ships tritonserver for x86_64 only; on $(uname -m) use NVIDIA's Triton container" ;;
esac

stamp_src=$( (cat .ci/setup.d/triton.sh pyproject.toml; "$PY" -V) | sha256sum | cut -c1-16)
if [ -f "$VENV/.cosyedge-stamp" ] && [ "$(cat "$VENV/.cosyedge-stamp")" = "$stamp_src" ]; then
    log "$VENV is up to date"
    exit 0
fi
log "creating $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip==25.3
"$VENV/bin/python" -m pip install -q \
    nvidia-pytriton==0.7.0 \
    numpy==1.26.4 \
    onnxruntime==1.32.0 \
    tokenizers==0.21.4 \
    soxr==1.1.0 \
    soundfile==0.14.0
# The project itself, editable and without its dependencies (they pin numpy 2),
# so the server runs the code of this checkout under its cosyedge_* names.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/cosyedge-checkout.pth"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "import numpy, onnxruntime, tokenizers, soxr, soundfile, cosyedge_models, cosyedge_cloud; assert numpy.__version__.startswith('1.')"
# The server itself must start here (CI=true: or the setup fails), not only import.
"$VENV/bin/python" - <<'PY' || skip_or_fail "tritonserver from nvidia-pytriton does not run here"
import subprocess, sys, sysconfig
from pathlib import Path
import pytriton
server = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
env = {"LD_LIBRARY_PATH": sysconfig.get_config_var("LIBDIR") or ""}
out = subprocess.run([str(server), "--help"], capture_output=True, env=env, timeout=60)
sys.exit(0 if b"model-repository" in out.stdout + out.stderr else 1)  # --help exits 1 after the usage
PY
echo "$stamp_src" > "$VENV/.cosyedge-stamp"
log "$VENV ready"
