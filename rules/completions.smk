# Stage 2: synthetic completions. The verifier regenerates the answers with vLLM, one job per shard.
rule completions:
    input:
        prompts="results/prompts/train_{shard}.jsonl",
        verifier=verifier_files,
    output:
        "results/completions/train_{shard}.jsonl",
    params:
        # the stage's shards (ids 00000..num_shards-1): the first job fills every stale one (draftpipe/runtime/store.py); a
        # count, not the id list, which would make every job's params, and the dry run, grow with the shard count
        num_shards=len(SHARDS),
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        # the quality gate max_truncated_fraction shapes nothing: it is untracked
        sampling=canon({k: v for k, v in config["completions"].items() if k != "max_truncated_fraction"}),
        max_model_len=config["verifier"]["max_model_len"],
        chat_template=config["verifier"]["chat_template"],
        chat_template_sha256=CHAT_TEMPLATE_SHA,  # of verifier.chat_template_file (a verifier directory's own
        # template is part of verifier_id)
        dtype=config["verifier"]["dtype"],
        untracked=job_settings("completions", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/completions/train_{shard}.log",
    benchmark:
        "results/benchmarks/completions/train_{shard}.tsv"
    priority: 20  # all shards of a stage before the next stage: one verifier load per stage
    threads: res("completions", "threads")
    resources:
        **stage_resources("completions"),
    conda:
        ML_ENV
    script:
        "../scripts/completions.py"


# Counts of the completions (rows, turns, truncated, thinking); refuses rows of two chat templates.
rule completion_stats:
    input:
        completions=completion_shards,
    output:
        stats=report("results/completions/stats.json", category="Completions"),
    log:
        "results/logs/completion_stats.log",
    benchmark:
        "results/benchmarks/completion_stats.tsv"
    threads: 1
    localrule: True
    conda:
        ML_ENV
    script:
        "../scripts/completion_stats.py"
