# Validation, verifier lookup, shard ids and input functions shared by every stage.
import functools
import json
import os
import sys
from pathlib import Path

from draftpipe.core.gpus import slurm_resources
from draftpipe.core.layout import ARTIFACT_STAT_CACHE, DAMAGE_RECORD, STORE, shard_ids
from draftpipe.bench.serve import serve_settings
from draftpipe.formats.chat import template_file_hash
from draftpipe.formats.verifier import VerifierNotFoundError
from draftpipe.runtime.integrity import damage_to_rebuild, repaired_pending
from draftpipe.runtime.stops import forward_stops
from draftpipe.runtime.store import code_digest, stored_already
from draftpipe.workflow.config import ConfigError, check_config
from draftpipe.workflow.identity import published_verifier, report_title, verifier_hub_id, verifier_identity
from draftpipe.workflow.identity import verifier_license
from draftpipe.workflow.sources import hub_dataset_ids
from draftpipe.workflow.fingerprint import NoTrainingPromptsError, prompt_fingerprints
from draftpipe.workflow.parse import configured_verifier, live_check, print_plan, quarantine_corrupt_shards
from draftpipe.workflow.parse import rendering, verifier_dir
from draftpipe.workflow.plan import DiskSpaceError, check_budget, check_disk
from draftpipe.workflow.draft import shaping_draft_settings
from draftpipe.workflow.settings import job_settings
from draftpipe.workflow.storage import check_storage

try:
    VERIFIER = configured_verifier(config)
    DERIVED = check_config(config, VERIFIER)
    # verifier.chat_template_file (checked above): its content is a param of the stages that render conversations
    CHAT_TEMPLATE_SHA = template_file_hash(config["verifier"]["chat_template_file"])
    # hidden_states.storage: disk (shards are artifacts) or stream (the draft job extracts as it trains)
    STREAM = check_storage(config, DERIVED)["storage"] == "stream"
except (ConfigError, VerifierNotFoundError) as exc:
    sys.exit(f"config error: {exc}")

# Where the rules read the verifier from: the converted directory for a GGUF, else the user's dir or hub id.
VERIFIER_DIR = verifier_dir(VERIFIER)


# The conda environment of every rule, for `--sdm conda` (envs/cpu.yaml or, with DRAFTPIPE_ENV=gpu, envs/gpu.yaml:
# the packages of envs/<name>.txt, which envs/setup.sh installs into .venv/ for a run without conda).
ML_ENV = f"../envs/{os.environ.get('DRAFTPIPE_ENV') or 'cpu'}.yaml"


def canon(obj):
    """A knob for `params:` in canonical form (dict keys sorted): Snakemake compares params by their text, so
    the order of keys in config.yaml must not look like a change."""
    return json.loads(json.dumps(obj, sort_keys=True))


VERIFIER_ID = canon(verifier_identity(VERIFIER, config, gguf=DERIVED.get("gguf")))

# How the stages that prompt the verifier with eval or benchmark prompts render them (a param of those rules).
RENDERING = canon(rendering(config, CHAT_TEMPLATE_SHA))

# The live vLLM check of the compatibility report: on by default where vLLM is installed.
LIVE_CHECK = live_check(config)

SHARDS = shard_ids(config["prompts"]["num_shards"])

# What each part of the prompt set (training shards, eval split) will hold, known before any job runs: a part's
# job is planned when its fingerprint changes (see draftpipe/workflow/fingerprint.py and rules/prompts.smk). The sources are
# read where the fingerprints are needed: when the main process plans, and in a prompt_shard job itself; a cluster
# job of another stage reads the workflow without reading them.
@functools.cache
def prompts_fp():
    """{"train": [fingerprint per shard], "eval": fingerprint} of the configured prompt set (read once)."""
    try:
        return prompt_fingerprints(
            config["prompts"]["sources"],
            config["prompts"]["eval_fraction"],
            config["prompts"]["num_shards"],
            config["prompts"]["split_seed"],
            config["prompts"]["system_prompt"],
        )
    except NoTrainingPromptsError as exc:
        sys.exit(f"config error: {exc}")
    except (OSError, ValueError) as exc:
        sys.exit(f"prompt source error: {exc}")


if workflow.is_main_process:
    # a bad source fails here, before any job is planned, naming the file and line; text a source's mapping leaves
    # out of its prompts is a warning
    for _warning in prompts_fp()["warnings"]:
        print(f"warning: {_warning}", file=sys.stderr)


def prompt_part_fp(wildcards):
    """Fingerprint of the records of prompt-set part `wildcards.part` (`train_NNNNN` or `eval`)."""
    if wildcards.part == "eval":
        return prompts_fp()["eval"]
    return prompts_fp()["train"][int(wildcards.part[6:])]


wildcard_constraints:
    shard=r"\d{5}",
    part=r"train_\d{5}|eval",


def verifier_files(wildcards=None):
    """The verifier's config.json as an input file (empty for a hub id, tracked through params instead). Every rule
    that reads the verifier names it, so it is also where the DAG being built learns what to force
    (:func:`force_repaired`)."""
    force_repaired()
    if VERIFIER["kind"] == "hub":
        return []
    return [f"{VERIFIER_DIR}/config.json"]


def hidden_shards(wildcards=None):
    return expand("results/hidden_states/train_{shard}.safetensors", shard=SHARDS)


def completion_shards(wildcards=None):
    return expand("results/completions/train_{shard}.jsonl", shard=SHARDS)


def draft_data(wildcards=None):
    """The draft's training data (unpacked into its inputs): the hidden-state shards, or, with
    `hidden_states.storage: stream`, the completions the draft job extracts them from."""
    return {"completions": completion_shards()} if STREAM else {"shards": hidden_shards()}


def served_summary(wildcards=None):
    """The served benchmark's summary as the report's input `serve` when `bench.serve` is set; nothing otherwise."""
    return {"serve": "results/bench/serve.json"} if config["bench"]["serve"] else {}


def draft_params():
    """The draft rule's param `draft`: what shapes the draft (draftpipe.workflow.draft.shaping_draft_settings)."""
    return canon(shaping_draft_settings(config["draft"]))


def stream_params():
    """With `hidden_states.storage: stream`, what the hidden_states rule's params would be, as the draft's param
    `stream` (a change of aux ids or dtype reruns only the draft); nothing with `disk`."""
    if not STREAM:
        return {}
    return {
        "stream": canon(
            {
                "aux_layer_ids": DERIVED["aux_layer_ids"],
                "num_layers": DERIVED["num_hidden_layers"],
                "hidden_size": DERIVED["hidden_size"],
                "dtype": config["hidden_states"]["dtype"],
                "max_len": config["verifier"]["max_model_len"],
                "model_dtype": config["verifier"]["dtype"],
            }
        )
    }


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
    if stage == "draft" and STREAM:  # the vLLM producer's devices beside the trainer's
        out["gpu"] += res("hidden_states", "gpus")
    if stage == "draft" and res("draft", "nodes") > 1:
        # several nodes: GPUs per node as gres, one torchrun task per node (draftpipe.stages.draft.ranks.slurm_resources)
        out.update(slurm_resources(config["resources"]["draft"]))
        out.pop("gpu")
        if "gpu_model" in out and "gres" in out:  # the plugin would add --gpus=<model>:1
            out["gres"] = f"gpu:{out.pop('gpu_model')}:{res('draft', 'gpus')}"
    return out


# What `draftpipe-verify --repair` quarantined and no run has rebuilt: forced, with what was built from it (Snakemake
# reruns nothing for a missing intermediate file whose dependents are up to date)
REPAIRED = repaired_pending("results") if workflow.is_main_process else {}
for _path, _dependents in REPAIRED.items():
    print(f"draftpipe: {_path} was quarantined by --repair; rebuilding it and {', '.join(_dependents)}", file=sys.stderr)


@functools.cache
def damaged():
    """Artifacts whose bytes are not those their manifests record (only files whose stat changed are read), and
    those whose rebuild an earlier run did not finish, each named with a line, when the main process builds its DAG
    (where Snakemake's settings are known)."""
    forced, lines = damage_to_rebuild("results", ARTIFACT_STAT_CACHE, DAMAGE_RECORD)
    for line in lines:
        print(line, file=sys.stderr)
    return forced


def force_repaired():
    """Add :data:`REPAIRED` and the damaged artifacts (:func:`damaged`) to the files the DAG being built forces (as
    `--forcerun` would), once, in the main process: the workflow is parsed before Snakemake knows its settings, and
    the DAG asks the input functions for their files before it decides what runs."""
    dag = getattr(workflow, "dag", None)
    if dag is None or not workflow.is_main_process:
        return
    forced = {**REPAIRED, **damaged()}
    if forced and not forced.keys() <= dag.forcefiles:
        dag.forcefiles.update(forced)


if workflow.is_main_process:
    # a corrupt hidden-state shard is moved aside before Snakemake plans, so that it is rebuilt, not trained on
    quarantine_corrupt_shards(hidden_shards())
    PLAN = print_plan(config, VERIFIER, DERIVED, prompts_fp())


def check_disk_before_start():
    """`onstart`: refuse to run when the hidden-state shards this run will write cannot fit (not in dry runs)."""
    if not config["hidden_states"]["disk_check"]:
        return
    if STREAM:  # no shard: the draft job's spool holds at most the budget
        if any(job.rule.name == "draft" for job in workflow.dag.needrun_jobs()):
            try:
                check_budget(PLAN["disk_budget"], "results/draft")
            except DiskSpaceError as exc:
                raise WorkflowError(f"not enough disk: {exc}")
        return
    # a shard whose result is in the stage store is only linked: it needs no space
    store = Path("results") / STORE / "hidden_states"
    code = code_digest([Path(workflow.basedir) / "scripts" / "hidden_states.py"])
    todo = sum(
        1
        for job in workflow.dag.needrun_jobs()
        if job.rule.name == "hidden_states" and not stored_already(job, store, ".safetensors", code)
    )
    try:
        check_disk(PLAN, "results/hidden_states", todo, len(SHARDS))
    except DiskSpaceError as exc:
        raise WorkflowError(f"not enough disk: {exc}")
