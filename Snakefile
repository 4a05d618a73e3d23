# draftpipe: verifier + prompt set -> EAGLE-3 draft that vLLM loads.
#   snakemake results/draft/model.safetensors --cores all
import sys

sys.path.insert(0, workflow.basedir)

from snakemake.utils import min_version

min_version("9.0")

from draftpipe.workflow.config import ConfigError, load_config_file, validate_config

try:
    # Snakemake's own reader names no file or line for a broken YAML (a tab, a bad indent); ours does. Ours also
    # refuses YTE templating (`__use_yte__`), whose Python Snakemake would run when it reads the file: before that
    # for config.yaml; a --configfile's Snakemake has read already, and the workflow stops here
    for _path in ["config.yaml", *workflow.overwrite_configfiles]:
        load_config_file(_path)
except ConfigError as exc:
    sys.exit(f"config error: {exc}")


configfile: "config.yaml"


try:
    # names the key of the first error, e.g. `completions.temprature: unknown key ...`, then fills in the defaults
    validate_config(config)
except ConfigError as exc:
    sys.exit(f"config error: {exc}")


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
        rules.prompt_set.output.stats,
        rules.completion_stats.output.stats,
        rules.draft.output.model,
        rules.draft.output.config,
        rules.compat_report.output.json,
        rules.bench_report.output.report,
        rules.model_card.output.card,


onstart:
    forward_stops()  # SIGINT/SIGTERM to Snakemake end its jobs too (draftpipe/runtime/stops.py)
    check_disk_before_start()
