# draftpipe: verifier + prompt set -> EAGLE-3 draft that vLLM loads.
#   snakemake results/draft/model.safetensors --cores all
import sys

sys.path.insert(0, workflow.basedir)

from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


from draftpipe.config import ConfigError, validate_config

try:
    # names the key of the first error, e.g. `completions.temprature: unknown key ...`, then fills in the defaults
    validate_config(config)
except ConfigError as exc:
    raise WorkflowError(f"config error: {exc}")


include: "rules/common.smk"
include: "rules/verifier.smk"
include: "rules/prompts.smk"
include: "rules/completions.smk"
include: "rules/hidden_states.smk"
include: "rules/vocab.smk"
include: "rules/draft.smk"
include: "rules/report.smk"
include: "rules/bench.smk"


rule all:
    default_target: True
    input:
        "results/prompts/stats.json",
        "results/completions/stats.json",
        "results/draft/model.safetensors",
        "results/draft/config.json",
        "results/report/compat.json",
        "results/bench/report.md",


onstart:
    check_disk_before_start()
