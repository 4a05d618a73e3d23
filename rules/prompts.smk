# Stage 1: prompt set. Sources are read, normalised, deduplicated, split and sharded by content id.
# One job per part (each training shard, the eval split) so that a change to the sources rewrites only the parts
# whose prompts changed. A part's content is known when the workflow is planned (prompts_fp, rules/common.smk):
# the job is planned when that fingerprint changes, not when a source file is touched, renamed or grows elsewhere.
rule prompt_shard:
    output:
        "results/prompts/{part}.jsonl",
    params:
        fingerprint=prompt_part_fp,  # SHA-256 of the part's records: what this artifact holds
        eval_fraction=config["prompts"]["eval_fraction"],
        split_seed=config["prompts"]["split_seed"],
        num_shards=config["prompts"]["num_shards"],
        untracked=job_settings("prompt_shard", config),  # the sources and system prompt (the fingerprint tracks them)
    log:
        "results/logs/prompts/{part}.log",
    benchmark:
        "results/benchmarks/prompts/{part}.tsv"
    priority: 30  # every part before the completions: their first job then answers every shard with one load
    threads: 1
    conda:
        ML_ENV
    script:
        "../scripts/prompt_shard.py"


# Counts of what the sources held (read, empty, duplicates, kept, per source); nothing downstream reads it.
rule prompt_set:
    input:
        sources=[s["path"] for s in config["prompts"]["sources"] if s.get("path")],  # files (a Hub set: by its rows)
        parts=expand("results/prompts/train_{shard}.jsonl", shard=SHARDS) + ["results/prompts/eval.jsonl"],
    output:
        stats=report("results/prompts/stats.json", category="Prompt set"),
    params:
        sources=canon(config["prompts"]["sources"]),
        system_prompt=config["prompts"]["system_prompt"],
    log:
        "results/logs/prompt_set.log",
    benchmark:
        "results/benchmarks/prompt_set.tsv"
    threads: 1
    localrule: True
    conda:
        ML_ENV
    script:
        "../scripts/prompt_set.py"
