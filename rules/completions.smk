# Stage 2: synthetic completions. The verifier regenerates the answers with vLLM, one job per shard.
rule completions:
    input:
        prompts="results/prompts/train_{shard}.jsonl",
        verifier=verifier_files,
    output:
        "results/completions/train_{shard}.jsonl",
    params:
        shards=SHARDS,  # the stage's shards: the first job fills every stale one (draftpipe/stage.py)
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        sampling=canon(config["completions"]),
        max_model_len=config["verifier"]["max_model_len"],
        chat_template=config["verifier"]["chat_template"],
        dtype=config["verifier"]["dtype"],
    log:
        "results/logs/completions/train_{shard}.log",
    benchmark:
        "results/benchmarks/completions/train_{shard}.tsv"
    priority: 20  # all shards of a stage before the next stage: one verifier load per stage
    threads: res("completions", "threads")
    resources:
        **stage_resources("completions"),
    script:
        "../scripts/completions.py"
