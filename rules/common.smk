# Validation, verifier lookup, shard ids and input functions shared by every stage.
import json
import os
import sys

from draftpipe.plan import format_plan, plan

from draftpipe.config import ConfigError, check_config, verifier_identity
from draftpipe.verifier import VerifierNotFoundError, resolve_verifier

try:
    _config_json = config["verifier"].get("config_json")
    if _config_json and not os.path.exists(config["verifier"]["path"]):
        # Plan against a checked-in config.json; the weights are fetched where the jobs run.
        if not os.path.isfile(_config_json):
            raise ConfigError(f"verifier.config_json: {_config_json} does not exist")
        VERIFIER = {"kind": "hub", "id": config["verifier"]["path"], "config_path": _config_json}
    else:
        VERIFIER = resolve_verifier(config["verifier"]["path"], field="verifier.path")
    DERIVED = check_config(config, VERIFIER)
except (ConfigError, VerifierNotFoundError) as exc:
    raise WorkflowError(f"config error: {exc}")

# Where the rules read the verifier from: the converted directory for a GGUF, else the user's dir or hub id.
if VERIFIER["kind"] == "gguf":
    VERIFIER_DIR = "results/verifier"
elif VERIFIER["kind"] == "local":
    VERIFIER_DIR = str(VERIFIER["path"])
else:
    VERIFIER_DIR = VERIFIER["id"]


def canon(obj):
    """A knob for `params:` in canonical form (dict keys sorted): Snakemake compares params by their text, so
    the order of keys in config.yaml must not look like a change."""
    return json.loads(json.dumps(obj, sort_keys=True))


VERIFIER_ID = canon(verifier_identity(VERIFIER, config))

# The live vLLM check of the compatibility report: on by default where vLLM is installed.
_live = config["report"]["live_check"]
if _live == "auto":
    import importlib.util

    _live = importlib.util.find_spec("vllm") is not None
LIVE_CHECK = bool(_live)

SHARDS = [f"{i:05d}" for i in range(config["prompts"]["num_shards"])]


wildcard_constraints:
    shard=r"\d{5}",


def verifier_files(wildcards=None):
    """The verifier's config.json as an input file (empty for a hub id, tracked through params instead)."""
    if VERIFIER["kind"] == "hub":
        return []
    return [f"{VERIFIER_DIR}/config.json"]


def hidden_shards(wildcards=None):
    return expand("results/hidden_states/train_{shard}.safetensors", shard=SHARDS)


def completion_shards(wildcards=None):
    return expand("results/completions/train_{shard}.jsonl", shard=SHARDS)


def res(stage, key):
    """A job resource of a stage from config.yaml's `resources:` (schema defaults filled in)."""
    return config["resources"][stage][key]


def stage_resources(stage):
    """`resources:` of a stage's jobs: GPUs, memory and runtime from config.yaml, plus the SLURM site settings
    (config `slurm:` or DRAFTPIPE_SLURM_<KEY>) when set. Only the executor reads the slurm_* keys."""
    out = {
        "gpu": res(stage, "gpus"),
        "mem_mb": res(stage, "mem_mb"),
        "runtime": res(stage, "runtime"),
    }
    for key, name in (
        ("partition", "slurm_partition"),
        ("account", "slurm_account"),
        ("constraint", "constraint"),
        ("gpu_model", "gpu_model"),
    ):
        value = config["slurm"].get(key) or os.environ.get(f"DRAFTPIPE_SLURM_{key.upper()}")
        if value and (key != "gpu_model" or out["gpu"] > 0):
            out[name] = value
    return out


if workflow.is_main_process:
    print(format_plan(plan(config, {**DERIVED, "hidden_size": DERIVED["hidden_size"]})), file=sys.stderr)
