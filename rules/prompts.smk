# Stage 1: prompt set. Every source is read, normalised, deduplicated, split and sharded by content id.
rule prompt_set:
    input:
        sources=[s["path"] for s in config["prompts"]["sources"]],
    output:
        train=expand("results/prompts/train_{shard}.jsonl", shard=SHARDS),
        eval="results/prompts/eval.jsonl",
        stats="results/prompts/stats.json",
    params:
        sources=canon(config["prompts"]["sources"]),
        eval_fraction=config["prompts"]["eval_fraction"],
        split_seed=config["prompts"]["split_seed"],
        num_shards=config["prompts"]["num_shards"],
    log:
        "results/logs/prompt_set.log",
    benchmark:
        "results/benchmarks/prompt_set.tsv"
    threads: 1
    script:
        "../scripts/prompt_set.py"
